"""Zone and line events on the live WebSocket, through the real app on SQLite and PostgreSQL: a
client sees each crossing and zone transit as it is stored, with its track id, filtered like the
detections."""

from __future__ import annotations

import time
from typing import Any

from fleet_protocol import TopicKind
from fleet_protocol.messages import CrossDirection, Event, EventKind, LineCrossing, ZoneTransit
from tests.support.controller_app import Fleet
from tests.support.messages import detection_batch


def _send(
    fleet: Fleet, seq: int, kind: EventKind, data: ZoneTransit | LineCrossing, camera: str = "cam1"
) -> None:
    ev = Event(seq=seq, ts=data.at, kind=kind, camera=camera, data=data.model_dump(mode="json"))
    fleet.send("d1", TopicKind.EVENTS, ev)


def test_zone_and_line_events_reach_live_clients_with_their_track_ids(fleet: Fleet) -> None:
    now = time.time()
    crossing = LineCrossing(line="door", track_id=7, label="person", direction=CrossDirection.OUT, at=now)
    entered = ZoneTransit(zone="desk", track_id=8, label="person", at=now)
    with fleet.client.websocket_connect("/api/v1/detections/live?device=d1&camera=cam1") as ws:
        assert ws.receive_json()["type"] == "hello"
        _send(fleet, 1, EventKind.LINE_CROSSED, crossing)
        _send(fleet, 2, EventKind.ZONE_ENTERED, entered.model_copy(update={"track_id": 9}), camera="cam2")
        _send(fleet, 3, EventKind.ZONE_ENTERED, entered)
        fleet.send("d1", TopicKind.DETECTIONS, detection_batch(4, captured_at=now))
        got: list[dict[str, Any]] = [ws.receive_json() for _ in range(3)]
    line, zone, det = got
    assert (line["type"], line["kind"], line["line"], line["direction"], line["track_id"]) == (
        "line_event",
        "line_crossed",
        "door",
        "out",
        7,
    )
    assert (zone["type"], zone["kind"], zone["zone"], zone["track_id"], zone["camera"]) == (
        "zone_event",
        "zone_entered",
        "desk",
        8,
        "cam1",
    )
    assert det["type"] == "detection"  # cam2's transit was filtered out, not queued before it


def test_a_label_filter_applies_to_zone_and_line_events(fleet: Fleet) -> None:
    now = time.time()
    with fleet.client.websocket_connect("/api/v1/detections/live?label=car") as ws:
        assert ws.receive_json()["type"] == "hello"
        for seq, label in enumerate(["person", "car"], 1):
            crossing = LineCrossing(
                line="gate", track_id=seq, label=label, direction=CrossDirection.IN, at=now
            )
            _send(fleet, seq, EventKind.LINE_CROSSED, crossing)
        got = ws.receive_json()
    assert (got["type"], got["label"], got["track_id"]) == ("line_event", "car", 2)
