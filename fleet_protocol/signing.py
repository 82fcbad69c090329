"""Ed25519 signatures over artifact manifests and whole desired states (PROTOCOL.md "What is signed").

The controller signs every :class:`ArtifactRef` it puts in a desired state; an agent verifies the
signature with the controller's public key BEFORE it fetches or runs anything, so a forged or
tampered desired state cannot make it download or activate a model the controller did not approve.

What is signed is the canonical form of the fields that decide which bytes run and how they are
read: model, version, variant, sha256, size, chunk_size, decoder and labels (sorted keys, no
spaces, UTF-8), prefixed by :data:`SIGNING_CONTEXT` so that a signature made for an artifact can
never be mistaken for one over anything else the same key might sign in future.

The controller also signs each :class:`DesiredState` as a whole (:func:`signed_desired`): version,
issue time, device id and every camera setting, everything but the signature fields. An agent with the
key verifies it (:func:`verify_desired`) before it compares versions or stores anything, so a forged,
replayed, foreign or altered state is refused as a whole.

This is the one module of the contract that needs more than pydantic and the standard library: the
``cryptography`` package for Ed25519.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fleet_protocol.codec import ProtocolError
from fleet_protocol.messages import AgentPackageRef, ArtifactRef, DesiredState

ALGORITHM = "ed25519"
SIGNING_CONTEXT = b"edgefleet/v1 artifact manifest\n"
SIGNED_FIELDS = (
    "model",
    "version",
    "variant",
    "sha256",
    "size",
    "chunk_size",
    "decoder",
    "labels",
    "manifest",
)
KEY_FILE_MODE = 0o600

UNSIGNED = "unsigned artifact"
MISMATCH = "signature does not match: manifest tampered or signed by another key"
MALFORMED = "malformed signature"

_SIGNATURE_LEN = 64
_PUBLIC_KEY_LEN = 32


class SignatureError(ProtocolError):
    """An artifact reference whose signature does not check out; the message says why."""


class KeyFileError(ValueError):
    """A private key file that cannot be used; the message names the file and the problem."""


# --------------------------------------------------------------------------- canonical form


def signed_fields(ref: ArtifactRef) -> dict[str, Any]:
    """Everything that decides what runs and how its output is read: the whole manifest (input spec,
    decoder and its parameters, labels, thresholds included), the variant and the chunk size."""
    m = ref.manifest
    return {
        "model": m.name,
        "version": m.version,
        "variant": ref.variant,
        "sha256": m.sha256,
        "size": m.size,
        "chunk_size": ref.chunk_size,
        "decoder": m.decoder.value,
        "labels": list(m.labels),
        "manifest": m.model_dump(mode="json"),
    }


def canonical_bytes(ref: ArtifactRef) -> bytes:
    """Deterministic JSON of :data:`SIGNED_FIELDS`: the same ref gives the same bytes on every side."""
    return json.dumps(
        signed_fields(ref), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _message(ref: ArtifactRef) -> bytes:
    return SIGNING_CONTEXT + canonical_bytes(ref)


# --------------------------------------------------------------------------- sign / verify


def _signature_bytes(signature: str) -> bytes:
    """The raw Ed25519 signature of a base64 field, or :class:`SignatureError` (malformed)."""
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError(MALFORMED) from None
    if len(raw) != _SIGNATURE_LEN:
        raise SignatureError(MALFORMED)
    return raw


def sign(ref: ArtifactRef, private_key: Ed25519PrivateKey) -> str:
    """The base64 Ed25519 signature of ``ref``'s canonical form (its own signature fields are ignored)."""
    return base64.b64encode(private_key.sign(_message(ref))).decode("ascii")


def signed(ref: ArtifactRef, private_key: Ed25519PrivateKey) -> ArtifactRef:
    """A copy of ``ref`` carrying its signature and the signing key's id."""
    return ref.model_copy(
        update={"signature": sign(ref, private_key), "key_id": key_id(private_key.public_key())}
    )


def verify(ref: ArtifactRef, public_key: Ed25519PublicKey) -> None:
    """Return if ``ref`` was signed by ``public_key``'s private key, else raise :class:`SignatureError`."""
    if not ref.signature:
        raise SignatureError(UNSIGNED)
    raw = _signature_bytes(ref.signature)
    try:
        public_key.verify(raw, _message(ref))
    except InvalidSignature:
        trusted = key_id(public_key)
        if ref.key_id and ref.key_id != trusted:
            # key_id is not covered by the signature, so it is only a hint; but a useful one when a
            # controller's key was replaced and the device still trusts the old one.
            raise SignatureError(
                f"{MISMATCH} (signed with key {ref.key_id}, this device trusts {trusted})"
            ) from None
        raise SignatureError(MISMATCH) from None


# --------------------------------------------------------------------------- desired states

DESIRED_CONTEXT = b"edgefleet/v1 desired state\n"
# The only fields of a DesiredState the signature does not cover: the signature itself and the key
# hint. Everything else (schema version, type, version, issued_at, device_id, and each camera's model
# ref WITH its own signature, threshold, max_fps and labels, and which cameras there are) is signed.
DESIRED_UNSIGNED_FIELDS = frozenset({"signature", "key_id"})

UNSIGNED_STATE = "unsigned desired state"
STATE_MISMATCH = "signature does not match: desired state altered or signed by another key"


def desired_canonical_bytes(state: DesiredState) -> bytes:
    """Deterministic JSON of ``state`` as decoded, less :data:`DESIRED_UNSIGNED_FIELDS` (sorted keys,
    separators ``,`` ``:``, UTF-8, no NaN): the same state gives the same bytes on every side.

    Raises ``ValueError`` for a state that has no such form (a NaN/infinity inside a manifest's free
    ``decoder_params``); :func:`verify_desired` turns that into a refusal.
    """
    exclude = set(DESIRED_UNSIGNED_FIELDS)
    # pydantic's JSON mode turns a NaN inside a free-form dict into null, which would give a state with
    # NaN the bytes of one with null: such a state has no canonical form at all.
    _all_finite(state.model_dump(exclude=exclude))
    data = state.model_dump(mode="json", exclude=exclude)
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _all_finite(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a desired state with NaN or infinity has no canonical form")
    if isinstance(value, dict):
        for v in value.values():
            _all_finite(v)
    elif isinstance(value, list | tuple):
        for v in value:
            _all_finite(v)


def _desired_message(state: DesiredState) -> bytes:
    return DESIRED_CONTEXT + desired_canonical_bytes(state)


def signed_desired(state: DesiredState, private_key: Ed25519PrivateKey) -> DesiredState:
    """A copy of ``state`` carrying the signature over its canonical form and the key's id.

    Sign a state only once everything in it is final (its refs signed first, its ``device_id`` set):
    any later change breaks the signature.
    """
    sig = base64.b64encode(private_key.sign(_desired_message(state))).decode("ascii")
    return state.model_copy(update={"signature": sig, "key_id": key_id(private_key.public_key())})


def verify_desired(state: DesiredState, public_key: Ed25519PublicKey) -> None:
    """Return if ``state`` as a whole was signed by ``public_key``'s private key, else raise
    :class:`SignatureError` saying why (unsigned, malformed, or not matching)."""
    if not state.signature:
        raise SignatureError(UNSIGNED_STATE)
    raw = _signature_bytes(state.signature)
    try:
        message = _desired_message(state)
    except (ValueError, TypeError):
        raise SignatureError(f"{STATE_MISMATCH} (it has no canonical form)") from None
    try:
        public_key.verify(raw, message)
    except InvalidSignature:
        trusted = key_id(public_key)
        if state.key_id and state.key_id != trusted:
            raise SignatureError(
                f"{STATE_MISMATCH} (signed with key {state.key_id}, this device trusts {trusted})"
            ) from None
        raise SignatureError(STATE_MISMATCH) from None


# --------------------------------------------------------------------------- agent packages

AGENT_PACKAGE_CONTEXT = b"edgefleet/v1 agent package\n"
AGENT_PACKAGE_FIELDS = ("version", "sha256", "size", "chunk_size")


def agent_package_canonical_bytes(ref: AgentPackageRef) -> bytes:
    """Deterministic JSON of what decides which agent bytes get installed: version, sha256, size and
    chunk size (the health bound is covered by the desired state's own signature)."""
    data = {f: getattr(ref, f) for f in AGENT_PACKAGE_FIELDS}
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sign_agent_package(ref: AgentPackageRef, private_key: Ed25519PrivateKey) -> AgentPackageRef:
    """A copy of ``ref`` carrying the signature over its canonical form and the key's id."""
    sig = private_key.sign(AGENT_PACKAGE_CONTEXT + agent_package_canonical_bytes(ref))
    return ref.model_copy(
        update={
            "signature": base64.b64encode(sig).decode("ascii"),
            "key_id": key_id(private_key.public_key()),
        }
    )


def verify_agent_package(ref: AgentPackageRef, public_key: Ed25519PublicKey) -> None:
    """Return if ``ref`` was signed by ``public_key``'s private key, else raise :class:`SignatureError`."""
    if not ref.signature:
        raise SignatureError("unsigned agent package")
    raw = _signature_bytes(ref.signature)
    try:
        public_key.verify(raw, AGENT_PACKAGE_CONTEXT + agent_package_canonical_bytes(ref))
    except InvalidSignature:
        raise SignatureError(
            "signature does not match: agent package tampered or signed by another key"
        ) from None


# --------------------------------------------------------------------------- keys


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_key_raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_key_b64(public_key: Ed25519PublicKey) -> str:
    """The public key as base64 of its raw 32 bytes: what agents are configured with."""
    return base64.b64encode(public_key_raw(public_key)).decode("ascii")


def load_public_key(b64: str) -> Ed25519PublicKey:
    """Parse :func:`public_key_b64`'s form; raises :class:`SignatureError` saying what is wrong."""
    try:
        raw = base64.b64decode(b64.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("public key is not base64") from None
    if len(raw) != _PUBLIC_KEY_LEN:
        raise SignatureError(f"public key must be {_PUBLIC_KEY_LEN} raw bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def key_id(public_key: Ed25519PublicKey) -> str:
    """First 16 hex digits of the sha256 of the raw public key: short enough to compare by eye."""
    return hashlib.sha256(public_key_raw(public_key)).hexdigest()[:16]


def save_private_key(private_key: Ed25519PrivateKey, path: Path, *, exclusive: bool = False) -> None:
    """Write ``private_key`` as PKCS#8 PEM, mode 0600 from the first byte, atomically.

    ``exclusive``: raise ``FileExistsError`` instead of replacing a key already at ``path``.
    """
    pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # Created 0600 (never briefly world-readable), then fchmod in case the umask is unusual.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
    try:
        os.fchmod(fd, KEY_FILE_MODE)
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    if not exclusive:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # atomic create-if-absent: two processes never both think they made it
    finally:
        tmp.unlink(missing_ok=True)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Read a PEM Ed25519 private key; raises :class:`KeyFileError` naming the file and the problem."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the signing key: {exc.strerror or exc}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path}: not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: holds a {type(key).__name__}, not an Ed25519 private key")
    return key
