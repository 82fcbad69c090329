"""Whether a device takes a desired state (PROTOCOL.md, "Desired and reported state"): the reasons a
state is refused as a whole, and the two checks, pure, so the agent and the fleet simulator apply the
same rules."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fleet_protocol.messages import DesiredState
from fleet_protocol.signing import SignatureError, verify_desired

REFUSED_SIGNATURE = "signature"  # unsigned, malformed, or not by the trusted key
REFUSED_DEVICE = "device"  # signed for another device, or for none
REFUSED_STALE = "stale"  # a version older than the one the device has
REFUSED_CONFLICT = "conflict"  # the version the device has, with other content
REFUSED_ISSUED_AT = "issued_at"  # issued before the state the device has
REFUSED_UNDECODABLE = "undecodable"  # not a valid DesiredState (e.g. a version out of bounds)

Problem = tuple[str, str]  # (reason, message)


def trust_problem(state: DesiredState, key: Ed25519PublicKey | None, device_id: str) -> Problem | None:
    """Why ``state`` is not the controller's word for ``device_id``, or None.

    With a key: the whole state must carry a valid signature by it and name this device. Without one
    (development) the signature cannot be checked, but a state naming another device is still not for
    this one.
    """
    if key is not None:
        try:
            verify_desired(state, key)
        except SignatureError as exc:
            return REFUSED_SIGNATURE, str(exc)
        if state.device_id != device_id:
            named = f"device {state.device_id!r}" if state.device_id else "no device"
            return REFUSED_DEVICE, f"signed for {named}, not for this device {device_id!r}"
    elif state.device_id is not None and state.device_id != device_id:
        return REFUSED_DEVICE, f"for device {state.device_id!r}, not for this device {device_id!r}"
    return None


def order_problem(
    state: DesiredState,
    content: bytes,
    have: DesiredState | None,
    have_content: bytes | None,
    applied_version: int | None = None,
) -> Problem | None:
    """Why ``state`` (canonical bytes ``content``) does not follow ``have``, the state taken (with
    ``have_content``), or None. With nothing taken, a version not above ``applied_version`` (when
    given: what runs) is stale.

    The reason is "" for the state already taken coming again (the retained copy on every reconnect):
    ignored without an event.
    """
    if have is None:
        if applied_version is not None and state.version <= applied_version:
            return REFUSED_STALE, f"v{state.version} is not newer than v{applied_version} it runs"
        return None
    if state.version < have.version:
        return REFUSED_STALE, f"v{state.version} is older than v{have.version} it already has"
    if state.version == have.version:
        if content == have_content:
            return "", f"v{state.version} already taken"
        return (
            REFUSED_CONFLICT,
            f"v{state.version} differs from the v{have.version} it already has (replayed or forged)",
        )
    if state.issued_at < have.issued_at:
        return (
            REFUSED_ISSUED_AT,
            f"v{state.version} was issued at {state.issued_at:.3f}, before v{have.version} "
            f"({have.issued_at:.3f}) it already has",
        )
    return None
