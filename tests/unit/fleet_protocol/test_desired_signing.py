"""Whole desired states are signed: every field but the signature's own, bounded versions, one
canonical form on both sides (PROTOCOL.md "What is signed")."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from fleet_protocol import TopicKind, decode, encode
from fleet_protocol.codec import ProtocolError
from fleet_protocol.messages import (
    MAX_DESIRED_VERSION,
    ArtifactRef,
    CameraDesired,
    DecoderKind,
    DesiredState,
    InputSpec,
    ModelManifest,
)
from fleet_protocol.signing import (
    DESIRED_CONTEXT,
    MALFORMED,
    STATE_MISMATCH,
    UNSIGNED_STATE,
    SignatureError,
    desired_canonical_bytes,
    generate_private_key,
    key_id,
    signed,
    signed_desired,
    verify_desired,
)

KEY = generate_private_key()
PUB = KEY.public_key()

REF = signed(
    ArtifactRef(
        manifest=ModelManifest(
            name="ped_ssdlite",
            version="1",
            sha256="ab" * 32,
            size=12_301_105,
            decoder=DecoderKind.TF_OD,
            input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=300, height=300),
            labels=["person"],
            decoder_params={"class_offset": 1, "scale": 0.25},
        ),
    ),
    KEY,
)


def state(**kw: Any) -> DesiredState:
    base: dict[str, Any] = {
        "version": 7,
        "issued_at": 1_700_000_000.125,
        "device_id": "dev-1",
        "cameras": {
            "cam1": CameraDesired(model=REF, threshold=0.4, max_fps=5.0, labels=["person"]),
            "cam2": CameraDesired(),
        },
    }
    return DesiredState(**{**base, **kw})


def test_a_signed_state_verifies_after_the_wire_and_carries_the_key_id() -> None:
    s = signed_desired(state(), KEY)
    assert s.key_id == key_id(PUB) and s.signature
    back = decode(TopicKind.TWIN_DESIRED, encode(s))
    assert isinstance(back, DesiredState)
    verify_desired(back, PUB)
    assert desired_canonical_bytes(back) == desired_canonical_bytes(s)


def test_canonical_form_is_sorted_compact_and_leaves_out_only_the_signature_fields() -> None:
    s = signed_desired(state(), KEY)
    raw = desired_canonical_bytes(s)
    data = json.loads(raw)
    assert set(data) == {"v", "type", "version", "issued_at", "device_id", "cameras"}
    assert raw == json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    # The ref's own signature is inside what the state's signature covers.
    assert data["cameras"]["cam1"]["model"]["signature"] == REF.signature
    assert DESIRED_CONTEXT.startswith(b"edgefleet/v1 desired state")


def _with(s: DesiredState, path: tuple[str, ...], value: Any) -> DesiredState:
    data = s.model_dump(mode="json")
    node = data
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return DesiredState.model_validate(data)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("version",), 8),
        (("issued_at",), 1_800_000_000.0),
        (("device_id",), "dev-2"),
        (("device_id",), None),
        (("cameras", "cam1", "threshold"), 1.0),
        (("cameras", "cam1", "max_fps"), 0.01),
        (("cameras", "cam1", "labels"), ["__nothing__"]),
        (("cameras", "cam1", "labels"), None),
        (("cameras", "cam2", "model"), REF.model_dump(mode="json")),
        (("cameras", "cam1", "model", "variant"), "int8"),
        (("cameras", "cam1", "model", "manifest", "decoder_params", "scale"), 0.5),
        (("cameras", "cam1", "model", "signature"), None),
        (("cameras",), {}),
    ],
    ids=lambda v: ".".join(v) if isinstance(v, tuple) else None,
)
def test_any_change_to_a_signed_field_breaks_the_signature(path: tuple[str, ...], value: Any) -> None:
    s = signed_desired(state(), KEY)
    with pytest.raises(SignatureError, match="desired state altered"):
        verify_desired(_with(s, path, value), PUB)


def test_a_camera_added_or_removed_breaks_the_signature() -> None:
    s = signed_desired(state(), KEY)
    more = s.model_copy(update={"cameras": {**s.cameras, "cam3": CameraDesired(model=REF)}})
    fewer = s.model_copy(update={"cameras": {"cam1": s.cameras["cam1"]}})
    for bad in (more, fewer):
        with pytest.raises(SignatureError, match=STATE_MISMATCH):
            verify_desired(bad, PUB)


def test_the_key_id_is_only_a_hint() -> None:
    s = signed_desired(state(), KEY)
    verify_desired(s.model_copy(update={"key_id": "0123456789abcdef"}), PUB)


def test_unsigned_malformed_and_foreign_key_states_are_refused_naming_why() -> None:
    with pytest.raises(SignatureError, match=UNSIGNED_STATE):
        verify_desired(state(), PUB)
    with pytest.raises(SignatureError, match=MALFORMED):
        verify_desired(state(signature="not base64!"), PUB)
    with pytest.raises(SignatureError, match=MALFORMED):
        verify_desired(state(signature="AAAA"), PUB)
    other = generate_private_key()
    with pytest.raises(SignatureError, match=rf"signed with key {key_id(other.public_key())}"):
        verify_desired(signed_desired(state(), other), PUB)


def test_a_signature_made_for_a_ref_is_not_one_for_a_state() -> None:
    """Domain separation: the contexts differ, so one kind of signature never passes as the other."""
    s = state(signature=REF.signature)
    with pytest.raises(SignatureError):
        verify_desired(s, PUB)


def test_a_state_with_nan_has_no_canonical_form_and_is_refused() -> None:
    payload = encode(signed_desired(state(), KEY)).replace(b'"scale":0.25', b'"scale":NaN')
    try:
        bad = decode(TopicKind.TWIN_DESIRED, payload)
    except ProtocolError:
        return  # refused at decode: as good
    assert isinstance(bad, DesiredState)
    with pytest.raises(SignatureError):
        verify_desired(bad, PUB)


def test_versions_are_bounded_by_the_controllers_column() -> None:
    assert MAX_DESIRED_VERSION == 2**31 - 1
    DesiredState(version=MAX_DESIRED_VERSION, issued_at=1.0)
    for bad in (MAX_DESIRED_VERSION + 1, 2**63 - 1, -1):
        with pytest.raises(ValidationError):
            DesiredState(version=bad, issued_at=1.0)
    payload = encode(state()).replace(b'"version":7', f'"version":{2**31}'.encode())
    with pytest.raises(ProtocolError):
        decode(TopicKind.TWIN_DESIRED, payload)


def test_non_finite_issue_time_and_fps_are_refused_by_the_schema() -> None:
    with pytest.raises(ValidationError):
        DesiredState(version=1, issued_at=float("inf"))
    with pytest.raises(ValidationError):
        CameraDesired(max_fps=float("inf"))
