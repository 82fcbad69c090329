"""Tracking end to end: a real agent process runs the bundled person detector on the bundled footage
(people walking through a hall) against a real controller on a real Mosquitto; the detections the
API serves carry track ids, and track_started and track_ended events arrive and are stored with the
sighting of each track."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet_protocol.messages import TrackSighting
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE
from tests.support.processes import AgentProcess, ControllerProcess, start_controller
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

DEVICE = "tracks-1"


@pytest.fixture
def controller(tmp_path: Path, broker: MosquittoBroker) -> Iterator[ControllerProcess]:
    c = start_controller(tmp_path, broker)
    yield c
    c.stop()


def _events(api: httpx.Client, kind: str) -> list[dict[str, Any]]:
    r = api.get("/api/v1/events/search", params={"device": DEVICE, "kind": kind, "limit": 500})
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()
    return found


def test_detections_carry_track_ids_and_tracks_start_and_end(
    tmp_path: Path, broker: MosquittoBroker, controller: ControllerProcess
) -> None:
    agent = AgentProcess(
        tmp_path,
        DEVICE,
        broker.url,
        cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
        controller=controller,
        # Short losses end tracks quickly, so that the test sees ends within the footage's first pass.
        tracking={"confirm_frames": 3, "lost_after_s": 1.0},
    )
    try:
        with controller.client() as api:
            assert api.post("/api/v1/devices", json={"id": DEVICE}).status_code in (200, 201)
            r = api.put(
                f"/api/v1/devices/{DEVICE}/cameras/cam1/model",
                json={"model": "ped_ssdlite", "version": "1", "min_box_area": 0.001},
            )
            assert r.status_code == 200, r.text
            agent.start()

            def tracked() -> list[dict[str, Any]] | None:
                assert agent.alive(), agent.log.read_text()[-3000:]
                items: list[dict[str, Any]] = api.get(
                    "/api/v1/detections", params={"device": DEVICE, "limit": 500}
                ).json()["items"]
                with_ids = [d for d in items if d["track_id"] is not None]
                return with_ids if len({d["frame"] for d in with_ids}) >= 10 else None

            with_ids = wait_for(tracked, timeout=120, what="detections with track ids from 10 frames")
            # A track's detections come back by its id, all of one label on one camera.
            some = with_ids[0]["track_id"]
            one = api.get("/api/v1/detections", params={"device": DEVICE, "track_id": some}).json()["items"]
            assert one and {(d["camera"], d["label"], d["track_id"]) for d in one} == {
                ("cam1", "person", some)
            }

            ended = wait_for(lambda: _events(api, "track_ended"), timeout=120, what="a track_ended event")
            started = {e["data"]["track_id"]: e for e in _events(api, "track_started")}
            for e in ended:
                end = TrackSighting.model_validate(e["data"])
                assert e["camera"] == "cam1" and end.label == "person"
                # Every end is of a track whose start was sent, with the same first sighting.
                assert end.track_id in started, (end, sorted(started))
                start = TrackSighting.model_validate(started[end.track_id]["data"])
                assert start.first_seen == end.first_seen and end.last_seen >= start.last_seen
                assert end.frames >= 3
            # Every id the detections carried belongs to a track whose start was sent.
            assert {d["track_id"] for d in with_ids} <= set(started)
    finally:
        agent.stop()
