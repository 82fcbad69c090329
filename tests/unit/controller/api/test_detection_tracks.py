"""Tracks at the controller, through the real app on SQLite and PostgreSQL (``fleet``): a detection's
track id stored and served (list, filter, live socket), an older agent's detections without one,
track events stored and searchable like any device event, and the per-label thresholds and minimum
box area of a camera from the API into the signed desired state."""

from __future__ import annotations

import time
from typing import Any

import pytest

from fleet_protocol import TopicKind
from fleet_protocol.messages import (
    Box,
    DetectionBatch,
    Event,
    EventKind,
    TrackSighting,
)
from tests.support.controller_app import Fleet, enroll
from tests.support.messages import detection_batch

BOX = Box(x0=10, y0=20, x1=110, y1=220)


def _tracked(seq: int, track_ids: list[int | None], at: float) -> DetectionBatch:
    """One frame with a person per entry of ``track_ids``, each with that track id."""
    batch = detection_batch(seq, ["person"] * len(track_ids), captured_at=at)
    frame = batch.frames[0]
    frame.detections = [
        d.model_copy(update={"track_id": t}) for d, t in zip(frame.detections, track_ids, strict=True)
    ]
    return batch


def _detections(fleet: Fleet, **params: Any) -> list[dict[str, Any]]:
    r = fleet.client.get("/api/v1/detections", params={"device": "d1", **params})
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def test_track_ids_are_stored_served_and_filtered_and_an_older_agents_detections_have_none(
    fleet: Fleet,
) -> None:
    now = time.time()
    fleet.send("d1", TopicKind.DETECTIONS, _tracked(1, [1_764_000_000_001, None], now - 3))
    fleet.send("d1", TopicKind.DETECTIONS, _tracked(2, [1_764_000_000_001, 1_764_000_000_002], now - 2))
    fleet.send("d1", TopicKind.DETECTIONS, detection_batch(3, captured_at=now - 1))  # an older agent's
    fleet.wait_ack("d1", lambda a: a.upto == 3, "three batches stored")
    # Newest capture first, then the highest id: batch 3, batch 2's two, batch 1's two.
    got = [d["track_id"] for d in _detections(fleet)]
    assert got == [None, 1_764_000_000_002, 1_764_000_000_001, None, 1_764_000_000_001]
    one = _detections(fleet, track_id=1_764_000_000_001)
    assert [d["seq"] for d in one] == [2, 1] and all(d["track_id"] == 1_764_000_000_001 for d in one)
    assert _detections(fleet, track_id=7) == []
    assert fleet.client.get("/api/v1/detections", params={"track_id": -1}).status_code == 422
    assert fleet.client.get("/api/v1/detections", params={"track_id": 2**63}).status_code == 422


def test_the_live_socket_carries_the_track_id(fleet: Fleet) -> None:
    with fleet.client.websocket_connect("/api/v1/detections/live?device=d1") as ws:
        assert ws.receive_json()["type"] == "hello"
        fleet.send("d1", TopicKind.DETECTIONS, _tracked(1, [42, None], time.time()))
        got = [ws.receive_json(), ws.receive_json()]
    assert [m["track_id"] for m in got] == [42, None]


def test_track_events_are_stored_and_found_by_kind(fleet: Fleet) -> None:
    now = time.time()
    started = TrackSighting(
        track_id=42, label="person", class_id=0, first_seen=now - 5, last_seen=now - 4, box=BOX
    )
    ended = started.model_copy(update={"last_seen": now - 1, "frames": 40})
    for seq, (kind, sighting) in enumerate(
        [(EventKind.TRACK_STARTED, started), (EventKind.TRACK_ENDED, ended)], 1
    ):
        fleet.send(
            "d1",
            TopicKind.EVENTS,
            Event(
                seq=seq, ts=now, kind=kind, camera="cam1", message="t", data=sighting.model_dump(mode="json")
            ),
        )
    fleet.wait_ack("d1", lambda a: a.upto == 2, "both events stored")
    assert fleet.counters()[TopicKind.EVENTS.value].get("unknown_fields", 0) == 0
    r = fleet.client.get("/api/v1/events/search", params={"device": "d1", "kind": "track_ended"})
    assert r.status_code == 200, r.text
    (ev,) = r.json()
    assert ev["camera"] == "cam1" and TrackSighting.model_validate(ev["data"]) == ended


def test_a_cameras_per_label_thresholds_and_minimum_box_area_reach_its_desired_state(fleet: Fleet) -> None:
    enroll(fleet, "d1")
    r = fleet.client.put(
        "/api/v1/devices/d1/cameras/cam1/model",
        json={
            "model": "tiny",
            "version": "1",
            "threshold": 0.5,
            "label_thresholds": {"person": 0.3},
            "min_box_area": 0.002,
        },
    )
    assert r.status_code == 200, r.text
    cam = r.json()["cameras"]["cam1"]
    assert cam["label_thresholds"] == {"person": 0.3} and cam["min_box_area"] == 0.002
    # Unset again: left out of the state, as an agent before them expects.
    r = fleet.client.put("/api/v1/devices/d1/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200 and not {"label_thresholds", "min_box_area"} & set(
        r.json()["cameras"]["cam1"]
    )


@pytest.mark.parametrize(
    "settings",
    [{"label_thresholds": {"person": 1.5}}, {"label_thresholds": {"x" * 65: 0.5}}, {"min_box_area": 2.0}],
)
def test_settings_out_of_bounds_are_refused_with_422(fleet: Fleet, settings: dict[str, Any]) -> None:
    enroll(fleet, "d1")
    body = {"model": "tiny", "version": "1", **settings}
    r = fleet.client.put("/api/v1/devices/d1/cameras/cam1/model", json=body)
    assert r.status_code == 422, r.text
    r = fleet.client.post(
        "/api/v1/deployments", json={"model": "tiny", "version": "1", "cameras": [settings]}
    )
    assert r.status_code == 422, r.text
