"""Zones and counting lines at the controller, through the real app on SQLite and PostgreSQL
(``fleet``): the agent's zone and line events stored and searchable like any device event, a
camera's occupancy kept with its heartbeat, and ``GET /api/v1/counts`` counting crossings per line and
direction and entries and exits per zone, per label and time bucket, with the occupancy now."""

from __future__ import annotations

import time
from typing import Any

import pytest

from fleet_protocol import TopicKind
from fleet_protocol.messages import (
    CameraState,
    CameraStats,
    CrossDirection,
    Event,
    EventKind,
    Heartbeat,
    LineCrossing,
    ZoneTransit,
)
from tests.support.controller_app import Fleet, enroll
from tests.support.waiting import wait_for

# A start on a whole two minutes, so that the test's events fall in known 60- and 120-second buckets.
T0 = float(int(time.time() // 120 * 120) - 3600)


def _event(seq: int, kind: EventKind, data: ZoneTransit | LineCrossing, camera: str = "cam1") -> Event:
    return Event(seq=seq, ts=data.at, kind=kind, camera=camera, data=data.model_dump(mode="json"))


def _crossing(
    line: str, direction: CrossDirection, at: float, label: str = "person", track: int = 1
) -> LineCrossing:
    return LineCrossing(line=line, track_id=track, label=label, direction=direction, at=at)


def _transit(zone: str, at: float, label: str = "person", track: int = 1) -> ZoneTransit:
    return ZoneTransit(zone=zone, track_id=track, label=label, at=at)


IN, OUT = CrossDirection.IN, CrossDirection.OUT
# What d1 sends: two minutes of crossings and zone transits on cam1, one on cam2.
EVENTS = [
    (EventKind.LINE_CROSSED, _crossing("door", IN, T0 + 1)),
    (EventKind.LINE_CROSSED, _crossing("door", IN, T0 + 2, track=2)),
    (EventKind.LINE_CROSSED, _crossing("door", OUT, T0 + 3, track=3)),
    (EventKind.LINE_CROSSED, _crossing("door", IN, T0 + 4, label="car", track=4)),
    (EventKind.ZONE_ENTERED, _transit("desk", T0 + 5)),
    (EventKind.ZONE_LEFT, _transit("desk", T0 + 61)),
    (EventKind.LINE_CROSSED, _crossing("door", OUT, T0 + 62, track=2)),
    (EventKind.LINE_CROSSED, _crossing("gate", IN, T0 + 63, track=5)),
]


def _send_all(fleet: Fleet) -> None:
    for seq, (kind, data) in enumerate(EVENTS, 1):
        fleet.send("d1", TopicKind.EVENTS, _event(seq, kind, data))
    n = len(EVENTS)
    fleet.send(
        "d1", TopicKind.EVENTS, _event(n + 1, EventKind.ZONE_ENTERED, _transit("desk", T0 + 7), "cam2")
    )
    fleet.wait_ack("d1", lambda a: a.upto == n + 1, "every zone and line event stored")


def _counts(fleet: Fleet, **params: Any) -> dict[str, Any]:
    window = {"since": _iso(T0), "until": _iso(T0 + 120), "bucket": 60}
    r = fleet.client.get("/api/v1/counts", params={**window, **params})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _iso(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


def test_zone_and_line_events_are_stored_and_found_by_kind(fleet: Fleet) -> None:
    _send_all(fleet)
    assert fleet.counters()[TopicKind.EVENTS.value].get("unknown_fields", 0) == 0
    r = fleet.client.get("/api/v1/events/search", params={"device": "d1", "kind": "line_crossed"})
    assert r.status_code == 200, r.text
    crossings = [LineCrossing.model_validate(e["data"]) for e in r.json()]
    assert crossings[0] == EVENTS[-1][1] and len(crossings) == 6
    r = fleet.client.get("/api/v1/events/search", params={"device": "d1", "kind": "zone_left"})
    (left,) = r.json()
    assert left["camera"] == "cam1" and ZoneTransit.model_validate(left["data"]) == EVENTS[5][1]


def _occupied_beat(fleet: Fleet, occupancy: dict[str, dict[str, int]]) -> None:
    cams = [CameraStats(camera="cam1", state=CameraState.UP, fps=10.0, occupancy=occupancy)]
    ts = time.time()
    fleet.send("d1", TopicKind.HEARTBEAT, Heartbeat(ts=ts, cameras=cams))
    wait_for(
        lambda: (fleet.device("d1")["last_health"] or {}).get("ts") == ts, timeout=10, what="heartbeat stored"
    )


def test_a_cameras_occupancy_is_kept_with_its_heartbeat(fleet: Fleet) -> None:
    enroll(fleet, "d1")
    _occupied_beat(fleet, {"desk": {"person": 2}, "hall": {}})
    (cam,) = fleet.device("d1")["last_health"]["cameras"]
    assert cam["occupancy"] == {"desk": {"person": 2}, "hall": {}}
    assert fleet.counters()[TopicKind.HEARTBEAT.value].get("unknown_fields", 0) == 0


def _line(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["camera"], row["line"], row["label"], row["in"], row["out"])


def _zone(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["camera"], row["zone"], row["label"], row["entered"], row["left"])


def test_counts_per_bucket_line_direction_zone_and_label(fleet: Fleet) -> None:
    _send_all(fleet)
    body = _counts(fleet, device="d1")
    first, second = body["buckets"]
    assert first["start"].startswith(_iso(T0)[:16]) and second["start"].startswith(_iso(T0 + 60)[:16])
    assert [_line(r) for r in first["lines"]] == [
        ("cam1", "door", "car", 1, 0),
        ("cam1", "door", "person", 2, 1),
    ]
    assert [_zone(r) for r in first["zones"]] == [
        ("cam1", "desk", "person", 1, 0),
        ("cam2", "desk", "person", 1, 0),
    ]
    assert [_line(r) for r in second["lines"]] == [
        ("cam1", "door", "person", 0, 1),
        ("cam1", "gate", "person", 1, 0),
    ]
    assert [_zone(r) for r in second["zones"]] == [("cam1", "desk", "person", 0, 1)]
    assert [_line(r) for r in body["totals"]["lines"]] == [
        ("cam1", "door", "car", 1, 0),
        ("cam1", "door", "person", 2, 2),
        ("cam1", "gate", "person", 1, 0),
    ]
    # One bucket over the two minutes adds them up the same way.
    (whole,) = _counts(fleet, bucket=120)["buckets"]
    assert [_line(r) for r in whole["lines"]] == [_line(r) for r in body["totals"]["lines"]]


@pytest.mark.parametrize(
    ("params", "lines", "zones"),
    [
        ({"line": "door"}, [("cam1", "door", "car", 1, 0), ("cam1", "door", "person", 2, 2)], []),
        ({"zone": "desk", "camera": "cam1"}, [], [("cam1", "desk", "person", 1, 1)]),
        ({"label": "car"}, [("cam1", "door", "car", 1, 0)], []),
        ({"camera": "cam2"}, [], [("cam2", "desk", "person", 1, 0)]),
        ({"device": "d2"}, [], []),
    ],
)
def test_counts_filter_by_place_camera_label_and_device(
    fleet: Fleet, params: dict[str, str], lines: list[tuple[Any, ...]], zones: list[tuple[Any, ...]]
) -> None:
    _send_all(fleet)
    got = _counts(fleet, **params)["totals"]
    assert [_line(r) for r in got["lines"]] == lines and [_zone(r) for r in got["zones"]] == zones


def test_counts_give_each_zones_occupancy_now_from_the_latest_heartbeat(fleet: Fleet) -> None:
    enroll(fleet, "d1")
    _occupied_beat(fleet, {"desk": {"person": 2, "dog": 1}, "hall": {}})
    occ = fleet.client.get("/api/v1/counts", params={"device": "d1"}).json()["occupancy"]
    assert [(o["zone"], o["label"], o["count"], o["online"]) for o in occ] == [
        ("desk", "dog", 1, True),
        ("desk", "person", 2, True),
        ("hall", None, 0, True),
    ]
    _occupied_beat(fleet, {"desk": {}, "hall": {"person": 1}})
    occ = fleet.client.get("/api/v1/counts", params={"zone": "hall"}).json()["occupancy"]
    assert [(o["device"], o["camera"], o["zone"], o["label"], o["count"]) for o in occ] == [
        ("d1", "cam1", "hall", "person", 1)
    ]
    assert fleet.client.get("/api/v1/counts", params={"line": "door"}).json()["occupancy"] == []


@pytest.mark.parametrize(
    "params",
    [
        {"bucket": 0},
        {"bucket": 1, "since": "2026-01-01T00:00:00Z", "until": "2026-02-01T00:00:00Z"},
        {"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
        {"zone": "desk", "line": "door"},
        {"zone": "no spaces"},
        {"since": "yesterday"},
    ],
)
def test_bad_count_queries_are_refused_with_422_naming_the_parameter(
    fleet: Fleet, params: dict[str, Any]
) -> None:
    r = fleet.client.get("/api/v1/counts", params=params)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][0] == "query"
