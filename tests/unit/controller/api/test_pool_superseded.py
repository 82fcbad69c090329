"""One analyser per pool camera in the counts: a device cut off from the controller goes on analysing
the cameras it ran, and once its cameras have moved, what it uploads after the link is back is kept but
marked superseded, from the move until it has stopped the camera. The camera's new device is never
marked, nor the old device's detections from before the move; the detection stats count one analyser
unless asked for all. Through the real app on SQLite and PostgreSQL (``fleet``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlmodel import Session, select

from controller.db.tables import SupersededAnalysis
from controller.fleet.pools import PoolReplanner
from fleet_protocol import TopicKind
from fleet_protocol.messages import CameraReported, ReportedState
from tests.support.controller_app import Fleet, FleetFactory, enroll_measured, set_availability
from tests.support.messages import detection_batch
from tests.support.pools import cameras_on, devices_of, get_pool, moved_events, pool_camera, put_pool
from tests.support.waiting import wait_for

POOL = "site-north"
BOXES = ("box-1", "box-2", "box-3")


@pytest.fixture
def fleet(make_fleet: FleetFactory) -> Fleet:
    return make_fleet(pool_replan_interval_s=0)


def _runtime(fleet: Fleet) -> Any:
    return fleet.client.app.state.runtime  # type: ignore[attr-defined]


def _round(fleet: Fleet, now: float) -> None:
    """One round of the leader's replan, as of ``now``."""
    PoolReplanner(_runtime(fleet).pools, interval_s=3600.0, stop=threading.Event()).replan(now)


def _detections(fleet: Fleet, camera: str) -> list[dict[str, Any]]:
    r = fleet.client.get("/api/v1/detections", params={"camera": camera})
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def _send(fleet: Fleet, device: str, seq: int, camera: str, at: float, stored: int) -> None:
    fleet.send(device, TopicKind.DETECTIONS, detection_batch(seq, camera=camera, captured_at=at))
    wait_for(
        lambda: len(_detections(fleet, camera)) == stored, timeout=10, what=f"{stored} detections of {camera}"
    )


def _person_count(fleet: Fleet, camera: str, since: float, **params: Any) -> int:
    r = fleet.client.get(
        "/api/v1/detections/stats",
        params={"camera": camera, "since": since - 60, "until": since + 60, "bucket": 3600, **params},
    )
    assert r.status_code == 200, r.text
    return int(r.json()["labels"].get("person", 0))


def test_what_a_cut_off_device_analysed_after_its_camera_moved_is_kept_and_marked(fleet: Fleet) -> None:
    for box in BOXES:
        enroll_measured(fleet, box, site="north")
    site = put_pool(
        fleet,
        {
            "name": POOL,
            "selector": "site=north",
            "failover_grace_s": 1,
            "cameras": [pool_camera(f"door-{i}") for i in range(1, 7)],
        },
    )
    on_1 = sorted(cameras_on(site, "box-1"))
    cam = on_1[0]
    running = {c: CameraReported(model="tiny:1", state="running") for c in on_1}
    fleet.send(
        "box-1", TopicKind.TWIN_REPORTED, ReportedState(ts=time.time(), desired_version=1, cameras=running)
    )
    wait_for(
        lambda: set(fleet.device("box-1")["models"]) == set(on_1), timeout=10, what="box-1 runs its cameras"
    )
    start = time.time()
    _send(fleet, "box-1", 1, cam, start, stored=1)  # before the cut: box-1 is the camera's analyser

    # Cut off: the controller sees box-1 offline and, past the grace, moves its cameras.
    set_availability(fleet, "box-1", "offline")
    _round(fleet, time.time() + 2)
    target = devices_of(get_pool(fleet, POOL))[cam]
    assert target != "box-1"
    (moved,) = [e for e in moved_events(fleet) if e["camera"] == cam]
    assert moved["data"]["reason"] == "device_offline"
    after = time.time() + 3  # captured after the move (the round ran as of now + 2)

    _send(fleet, target, 1, cam, after, stored=2)  # the new analyser
    _send(fleet, "box-1", 2, cam, after + 0.5, stored=3)  # box-1, still running it, uploads once back
    marks = {(d["device"], d["seq"]): d["superseded"] for d in _detections(fleet, cam)}
    assert marks == {("box-1", 1): False, (target, 1): False, ("box-1", 2): True}
    assert _person_count(fleet, cam, start) == 2
    assert _person_count(fleet, cam, start, superseded="true") == 3

    # Back, box-1 takes its new desired state and stops the camera: the span closes at the next round.
    set_availability(fleet, "box-1", "online")
    engine = _runtime(fleet).engine
    with Session(engine) as s:
        (span,) = s.exec(select(SupersededAnalysis).where(SupersededAnalysis.camera == cam)).all()
        assert (span.device_id, span.until) == ("box-1", None)
    _round(fleet, time.time() + 4)  # box-1 still reports it running (its last report): stays open
    with Session(engine) as s:
        assert [
            x.until for x in s.exec(select(SupersededAnalysis).where(SupersededAnalysis.camera == cam))
        ] == [None]
    fleet.send("box-1", TopicKind.TWIN_REPORTED, ReportedState(ts=time.time(), desired_version=1, cameras={}))
    wait_for(lambda: fleet.device("box-1")["models"] == {}, timeout=10, what="box-1's report stored")
    _round(fleet, time.time() + 5)
    with Session(engine) as s:
        closed = [x.until for x in s.exec(select(SupersededAnalysis).where(SupersededAnalysis.camera == cam))]
    assert len(closed) == 1 and closed[0] is not None
