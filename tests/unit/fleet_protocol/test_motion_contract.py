"""The contract's motion-gate additions (PROTOCOL.md "Motion-gated inference"): a camera's motion
settings in desired and reported state and its skipped frames in the heartbeat; each round-trips, and
each is additive both ways (an older peer's messages decode, and what this build sends is what it sent
before wherever the new fields are unset)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from fleet_protocol import TopicKind, decode, encode
from fleet_protocol.messages import (
    CameraDesired,
    CameraReported,
    CameraStats,
    DesiredState,
    MotionSettings,
    ReportedState,
)
from fleet_protocol.signing import (
    SignatureError,
    desired_canonical_bytes,
    generate_private_key,
    signed_desired,
    verify_desired,
)

KEY = generate_private_key()
MOTION = MotionSettings(enabled=True, threshold=30, min_area=0.002, full_frame_every_s=1.5)


def test_motion_settings_round_trip_in_a_signed_state_and_a_report() -> None:
    state = signed_desired(
        DesiredState(
            version=3, issued_at=1.7e9, device_id="dev-1", cameras={"c": CameraDesired(motion=MOTION)}
        ),
        KEY,
    )
    got = decode(TopicKind.TWIN_DESIRED, encode(state))
    assert got.cameras["c"].motion == MOTION
    verify_desired(got, KEY.public_key())
    reported = ReportedState(
        ts=1.7e9, desired_version=3, cameras={"c": CameraReported(state="running", motion=MOTION)}
    )
    assert decode(TopicKind.TWIN_REPORTED, encode(reported)).cameras["c"].motion == MOTION


def test_unset_the_new_fields_leave_the_bytes_older_peers_sign_and_read() -> None:
    state = DesiredState(
        version=1, issued_at=1.7e9, device_id="dev-1", cameras={"c": CameraDesired(threshold=0.4)}
    )
    assert b"motion" not in desired_canonical_bytes(state)
    stats = CameraStats(camera="c", state="up")
    assert "frames_skipped" not in json.loads(stats.model_dump_json())
    older = ReportedState(ts=1.7e9, desired_version=1, cameras={"c": CameraReported(state="running")})
    assert decode(TopicKind.TWIN_REPORTED, encode(older)).cameras["c"].motion is None


def test_motion_settings_altered_in_transit_fail_the_signature() -> None:
    state = signed_desired(
        DesiredState(
            version=5, issued_at=1.7e9, device_id="dev-1", cameras={"c": CameraDesired(motion=MOTION)}
        ),
        KEY,
    )
    wire = json.loads(encode(state))
    wire["cameras"]["c"]["motion"]["enabled"] = False  # someone on the path turns the gate off
    with pytest.raises(SignatureError):
        verify_desired(decode(TopicKind.TWIN_DESIRED, json.dumps(wire).encode()), KEY.public_key())


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"threshold": 0}, "threshold"),
        ({"threshold": 256}, "threshold"),
        ({"min_area": 0}, "min_area"),
        ({"min_area": 1.5}, "min_area"),
        ({"full_frame_every_s": 0}, "full_frame_every_s"),
        ({"full_frame_every_s": float("nan")}, "full_frame_every_s"),
        ({"threshhold": 3}, "threshhold"),
    ],
)
def test_motion_settings_out_of_bounds_or_unknown_are_refused(value: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        CameraDesired.model_validate({"motion": value})
