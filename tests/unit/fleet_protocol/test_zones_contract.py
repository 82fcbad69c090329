"""The contract's zones and lines (PROTOCOL.md "Zones and lines"): zones and counting lines per camera
in a signed desired state and in reported state, zone and line events, occupancy in the heartbeat's
camera stats; each round-trips, each is bounded, and each is additive (unset, the bytes are the ones
an older peer sends and verifies)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from fleet_protocol import TopicKind, decode, encode
from fleet_protocol.messages import (
    MAX_LINES,
    MAX_ZONE_POINTS,
    MAX_ZONES,
    CameraDesired,
    CameraReported,
    CameraState,
    CameraStats,
    CountLine,
    CrossDirection,
    DesiredState,
    Event,
    EventKind,
    Heartbeat,
    LineCrossing,
    Zone,
    ZoneTransit,
)
from fleet_protocol.signing import (
    desired_canonical_bytes,
    generate_private_key,
    signed_desired,
    verify_desired,
)

KEY = generate_private_key()
ZONE = Zone(id="desk", points=[(0.6, 0.1), (0.9, 0.1), (0.9, 0.4)], labels=["person"])
LINE = CountLine(id="door", a=(0.1, 0.5), b=(0.9, 0.5))


def test_zones_and_lines_round_trip_in_a_signed_state_and_unset_sign_what_an_older_agent_verifies() -> None:
    state = signed_desired(
        DesiredState(
            version=3,
            issued_at=1.7e9,
            device_id="dev-1",
            cameras={"cam1": CameraDesired(threshold=0.5, zones=[ZONE], lines=[LINE])},
        ),
        KEY,
    )
    got = decode(TopicKind.TWIN_DESIRED, encode(state))
    assert got.cameras["cam1"].zones == [ZONE] and got.cameras["cam1"].lines == [LINE]
    verify_desired(got, KEY.public_key())
    plain = DesiredState(version=1, issued_at=1.7e9, cameras={"cam1": CameraDesired(threshold=0.4)})
    cam = json.loads(desired_canonical_bytes(plain))["cameras"]["cam1"]
    assert set(cam) == {"model", "threshold", "max_fps", "labels"}


@pytest.mark.parametrize(
    "camera",
    [
        {"zones": [{"id": "z", "points": [[0, 0], [1, 0]]}]},  # two points are no polygon
        {"zones": [{"id": "z", "points": [[0, 0], [1.5, 0], [1, 1]]}]},  # not normalised
        {"zones": [{"id": "z", "points": [[i / 100, 0] for i in range(MAX_ZONE_POINTS + 1)]}]},
        {"zones": [{"id": f"z{i}", "points": [[0, 0], [1, 0], [1, 1]]} for i in range(MAX_ZONES + 1)]},
        {"zones": [{"id": "z", "points": [[0, 0], [1, 0], [1, 1]]}] * 2},  # the same id twice
        {"zones": [{"id": "a zone", "points": [[0, 0], [1, 0], [1, 1]]}]},
        {"lines": [{"id": "l", "a": [0.5, 0.5], "b": [0.5, 0.5]}]},  # no segment
        {"lines": [{"id": "l", "a": [0.5, -0.1], "b": [0.5, 0.5]}]},
        {"lines": [{"id": f"l{i}", "a": [0, 0], "b": [1, 1]} for i in range(MAX_LINES + 1)]},
        {"lines": [{"id": "l", "a": [0, 0], "b": [1, 1], "anchor": "top"}]},
    ],
)
def test_zones_and_lines_out_of_their_bounds_are_refused(camera: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CameraDesired.model_validate(camera)
    with pytest.raises(ValidationError):
        CameraReported.model_validate(camera)


def test_zone_and_line_events_and_occupancy_round_trip_and_are_absent_while_unset() -> None:
    crossing = LineCrossing(line="door", track_id=12, label="person", direction=CrossDirection.IN, at=1.7e9)
    event = Event(
        seq=3, ts=1.7e9, kind=EventKind.LINE_CROSSED, camera="cam1", data=crossing.model_dump(mode="json")
    )
    got = decode(TopicKind.EVENTS, encode(event))
    assert got.kind == EventKind.LINE_CROSSED and LineCrossing.model_validate(got.data) == crossing
    transit = ZoneTransit(zone="desk", track_id=12, label="person", at=1.7e9)
    assert ZoneTransit.model_validate(json.loads(transit.model_dump_json())) == transit
    stats = CameraStats(camera="cam1", state=CameraState.UP, occupancy={"desk": {"person": 2}, "door": {}})
    hb = Heartbeat(ts=1.7e9, cameras=[stats])
    assert decode(TopicKind.HEARTBEAT, encode(hb)).cameras[0].occupancy == {"desk": {"person": 2}, "door": {}}
    assert b"occupancy" not in encode(
        Heartbeat(ts=1.7e9, cameras=[CameraStats(camera="c", state=CameraState.UP)])
    )
    older = CameraReported(model="m:1", state="running", threshold=0.5)
    assert b"zones" not in older.model_dump_json().encode()
