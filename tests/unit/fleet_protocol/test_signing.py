"""Artifact signatures: what the controller signs verifies on the agent, and nothing else does."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path
from typing import Any

import pytest

from fleet_protocol import TopicKind, decode, encode
from fleet_protocol.messages import (
    ArtifactRef,
    CameraDesired,
    DecoderKind,
    DesiredState,
    InputSpec,
    ModelManifest,
)
from fleet_protocol.signing import (
    MALFORMED,
    MISMATCH,
    UNSIGNED,
    KeyFileError,
    SignatureError,
    canonical_bytes,
    generate_private_key,
    key_id,
    load_private_key,
    load_public_key,
    public_key_b64,
    save_private_key,
    sign,
    signed,
    verify,
)

KEY = generate_private_key()
PUB = KEY.public_key()

REF = ArtifactRef(
    manifest=ModelManifest(
        name="ped_ssdlite",
        version="1",
        sha256="ab" * 32,
        size=12_301_105,
        decoder=DecoderKind.TF_OD,
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=300, height=300),
        labels=["person"],
    ),
    chunk_size=256 * 1024,
    variant="fp32",
)


def tampered(ref: ArtifactRef, field: str) -> ArtifactRef:
    """``ref`` with one signed field changed after signing, keeping its signature."""
    data: dict[str, Any] = ref.model_dump(mode="json")
    m = data["manifest"]
    change = {
        "model": lambda: m.update(name="evil_model"),
        "version": lambda: m.update(version="2"),
        "variant": lambda: data.update(variant="int8"),
        "sha256": lambda: m.update(sha256="cd" * 32),
        "size": lambda: m.update(size=m["size"] + 1),
        "chunk_size": lambda: data.update(chunk_size=data["chunk_size"] * 2),
        "decoder": lambda: m.update(decoder="yolov8"),
        "labels": lambda: m.update(labels=["car"]),
        "manifest": lambda: m["input"].update(color="BGR" if m["input"]["color"] == "RGB" else "RGB"),
    }
    change[field]()
    return ArtifactRef.model_validate(data)


def test_signed_ref_verifies_and_travels_in_a_desired_state() -> None:
    ref = signed(REF, KEY)
    assert ref.key_id == key_id(PUB) and len(ref.key_id) == 16
    verify(ref, PUB)
    state = DesiredState(version=1, issued_at=1.7e9, cameras={"cam1": CameraDesired(model=ref)})
    back = decode(TopicKind.TWIN_DESIRED, encode(state))
    assert isinstance(back, DesiredState)
    back_ref = back.cameras["cam1"].model
    assert back_ref is not None
    verify(back_ref, PUB)


def test_canonical_bytes_are_sorted_compact_json_of_the_signed_fields() -> None:
    raw = canonical_bytes(REF)
    assert b" " not in raw
    obj = json.loads(raw)
    assert list(obj) == sorted(obj)
    assert obj.pop("manifest") == REF.manifest.model_dump(mode="json")  # input spec, params: all signed
    assert obj == {
        "chunk_size": 262144,
        "decoder": "tf_od",
        "labels": ["person"],
        "model": "ped_ssdlite",
        "sha256": "ab" * 32,
        "size": 12_301_105,
        "variant": "fp32",
        "version": "1",
    }
    # A signature does not sign itself: re-signing a signed ref gives the same signature.
    assert canonical_bytes(signed(REF, KEY)) == raw
    assert sign(signed(REF, KEY), KEY) == sign(REF, KEY)


@pytest.mark.parametrize(
    "field", ["model", "version", "variant", "sha256", "size", "chunk_size", "decoder", "labels", "manifest"]
)
def test_every_signed_field_changed_after_signing_is_refused(field: str) -> None:
    bad = tampered(signed(REF, KEY), field)
    with pytest.raises(SignatureError, match="manifest tampered or signed by another key"):
        verify(bad, PUB)


def test_signature_of_another_key_is_refused_naming_both_keys() -> None:
    other = generate_private_key()
    ref = signed(REF, other)
    with pytest.raises(SignatureError) as err:
        verify(ref, PUB)
    assert str(err.value).startswith(MISMATCH)
    assert key_id(other.public_key()) in str(err.value) and key_id(PUB) in str(err.value)
    # Without the key id hint the reason is the plain mismatch.
    with pytest.raises(SignatureError) as err:
        verify(ref.model_copy(update={"key_id": None}), PUB)
    assert str(err.value) == MISMATCH


@pytest.mark.parametrize("signature", [None, ""], ids=["none", "empty"])
def test_unsigned_ref_is_refused(signature: str | None) -> None:
    with pytest.raises(SignatureError) as err:
        verify(REF.model_copy(update={"signature": signature}), PUB)
    assert str(err.value) == UNSIGNED


@pytest.mark.parametrize(
    "signature",
    ["not base64 at all!", base64.b64encode(b"short").decode(), base64.b64encode(bytes(65)).decode()],
    ids=["not-base64", "too-short", "too-long"],
)
def test_malformed_signature_is_refused(signature: str) -> None:
    with pytest.raises(SignatureError) as err:
        verify(REF.model_copy(update={"signature": signature}), PUB)
    assert str(err.value) == MALFORMED


def test_well_formed_garbage_signature_does_not_match() -> None:
    ref = REF.model_copy(update={"signature": base64.b64encode(bytes(64)).decode()})
    with pytest.raises(SignatureError, match="does not match"):
        verify(ref, PUB)


def test_messages_without_signature_fields_still_parse() -> None:
    data = json.loads(encode(DesiredState(version=1, issued_at=1.0, cameras={"c": CameraDesired(model=REF)})))
    for cam in data["cameras"].values():
        del cam["model"]["signature"], cam["model"]["key_id"]
    state = decode(TopicKind.TWIN_DESIRED, json.dumps(data).encode())
    assert isinstance(state, DesiredState)
    model = state.cameras["c"].model
    assert model is not None and model.signature is None


def test_public_key_round_trips_as_base64_of_32_bytes() -> None:
    b64 = public_key_b64(PUB)
    assert len(base64.b64decode(b64)) == 32
    verify(signed(REF, KEY), load_public_key(b64))
    with pytest.raises(SignatureError, match="not base64"):
        load_public_key("%%%")
    with pytest.raises(SignatureError, match="32 raw bytes"):
        load_public_key(base64.b64encode(bytes(31)).decode())


def test_private_key_file_is_mode_0600_and_loads_the_same_key(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "artifact.pem"
    save_private_key(KEY, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = load_private_key(path)
    assert key_id(loaded.public_key()) == key_id(PUB)
    verify(signed(REF, loaded), PUB)


def test_unusable_private_key_files_say_why(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read"):
        load_private_key(tmp_path / "missing.pem")
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    with pytest.raises(KeyFileError, match="not an unencrypted PEM private key"):
        load_private_key(junk)
