"""What a pool's plan makes devices run: each device's published desired state names the pool cameras
placed on it, with their source as declared (the secret reference, never a credential) and the plan's
frame rate; a drain is make-before-break: the cameras' entries go to the devices that take them at
once, and leave the drained one's state only when each new device analyses the camera (it reports it
running, and its heartbeat, sent after the handover began, says it inferred a frame of it), or the
handover times out, or the old device goes offline, each end an event; every device probes the pool
cameras it could be given (their sources in its desired state), and one whose heartbeat says it cannot
reach a source is never given that camera; a changed source reaches the device that runs the camera and
those that probe it; a deleted pool leaves nothing behind. Through the real app on SQLite
and PostgreSQL (``fleet``)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from controller.fleet.pools import HANDOVER_TIMEOUT_S
from fleet_protocol import TopicKind
from fleet_protocol.messages import CameraState, CameraStats, Heartbeat
from tests.support.controller_app import Fleet, FleetFactory, enroll_measured, measured_beat
from tests.support.pools import (
    cameras_on,
    pool_camera,
    put_pool,
    report_pool_cameras,
    sent_desired,
    sent_pool_cameras,
)
from tests.support.waiting import wait_for

POOL = "site-north"
BOXES = ("box-1", "box-2", "box-3")
CAMERAS = tuple(f"door-{i}" for i in range(1, 7))


@pytest.fixture
def fleet(make_fleet: FleetFactory) -> Fleet:
    return make_fleet(pool_replan_interval_s=0)


def _declaration(**over_cam: Any) -> dict[str, Any]:
    cams = [pool_camera(cam) for cam in CAMERAS]
    cams[0].update(over_cam)
    return {"name": POOL, "selector": "site=north", "cameras": cams}


@pytest.fixture
def site(fleet: Fleet) -> dict[str, Any]:
    for box in BOXES:
        enroll_measured(fleet, box, site="north")
    return put_pool(fleet, _declaration())


def test_each_device_is_sent_the_pool_cameras_its_plan_gives_it(fleet: Fleet, site: dict[str, Any]) -> None:
    for box in BOXES:
        sent = sent_pool_cameras(fleet, box)
        assert set(sent) == cameras_on(site, box) and len(sent) == 2
        for cam, cd in sent.items():
            assert cd.source == pool_camera(cam)["source"]  # the reference as declared
            assert cd.max_fps == 10
            assert cd.model is not None and (cd.model.manifest.name, cd.model.manifest.version) == (
                "tiny",
                "1",
            )
        assignments = fleet.device(box)["assignments"]
        assert {c: a["pool"] for c, a in assignments.items() if a["pool"]} == dict.fromkeys(sent, POOL)
        assert all(assignments[c]["source"] == "pool" for c in sent)


def _drain(fleet: Fleet, device: str) -> dict[str, Any]:
    r = fleet.client.post(f"/api/v1/pools/{POOL}/devices/{device}/drain")
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _report_running(fleet: Fleet, device: str, cameras: set[str]) -> None:
    """What the device's agent reports once it runs ``cameras`` (its desired state taken) and has
    inferred a frame of each (its next heartbeat)."""
    report_pool_cameras(fleet, device, {c: ("tiny:1", "running", None) for c in cameras})
    _beat(fleet, device, time.time(), dict.fromkeys(cameras, time.time()))


def _round(fleet: Fleet, now: float | None = None) -> list[tuple[str, str, str]]:
    """One handover round of the leader, as of ``now``."""
    pools = fleet.client.app.state.runtime.pools  # type: ignore[attr-defined]
    ended: list[tuple[str, str, str]] = pools.release_handovers(
        now=time.time() if now is None else now, fence=lambda s: None
    )
    return ended


def test_a_drain_is_make_before_break(fleet: Fleet, site: dict[str, Any]) -> None:
    kept = {box: set(sent_pool_cameras(fleet, box)) for box in ("box-2", "box-3")}
    moved = cameras_on(site, "box-1")
    drained = _drain(fleet, "box-1")
    after = {box: set(sent_pool_cameras(fleet, box)) for box in ("box-2", "box-3")}
    # Nothing the other devices ran left them; the drained device's cameras are each somewhere.
    assert all(kept[box] <= after[box] for box in after)
    assert set().union(*after.values()) == set().union(*kept.values()) | moved
    # ... and box-1 still runs them until they run there.
    assert set(sent_pool_cameras(fleet, "box-1")) == moved
    assert {
        c: p["handover_from"] for c, p in drained["placements"].items() if p["handover_from"]
    } == dict.fromkeys(moved, "box-1")
    assert _round(fleet) == []  # nobody runs them yet

    takers = {box: after[box] - kept[box] for box in after if after[box] - kept[box]}
    left = set(moved)
    for box in sorted(takers):
        _report_running(fleet, box, after[box])
        assert sorted(_round(fleet)) == sorted((POOL, c, "box-1") for c in takers[box])
        left -= takers[box]
        assert set(sent_pool_cameras(fleet, "box-1")) == left
    assert left == set()
    events = fleet.client.get("/api/v1/events", params={"kind": "camera_handover"}).json()
    assert sorted(e["camera"] for e in events) == sorted(moved)
    assert {(e["data"]["source"], e["data"]["end"]) for e in events} == {("box-1", "running")}


def _beat(fleet: Fleet, device: str, ts: float, inferred: dict[str, float | None]) -> None:
    """A heartbeat of an agent that reports the placement figures: per pool camera, the rate its source
    gives and when it last inferred a frame of it (None: not yet)."""
    cams = [
        CameraStats(camera=c, state=CameraState.UP, fps=1.0, source_fps=10.0, last_inferred_at=at)
        for c, at in inferred.items()
    ]
    fleet.send(device, TopicKind.HEARTBEAT, Heartbeat(ts=ts, cameras=cams))
    wait_for(
        lambda: (fleet.device(device)["last_health"] or {}).get("ts") == ts, what=f"{device}'s beat stored"
    )


def test_a_handover_ends_at_the_new_devices_first_inferred_frame_not_at_its_model_running(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    moved = cameras_on(site, "box-1")
    drained = _drain(fleet, "box-1")
    taker = {c: p["device"] for c, p in drained["placements"].items() if c in moved}
    box = taker[min(moved)]
    cams = {c for c, d in taker.items() if d == box}
    now = time.time()
    _beat(fleet, box, now - 30, dict.fromkeys(cams, now - 31))  # sent before the handover: says nothing
    report_pool_cameras(fleet, box, {c: ("tiny:1", "running", None) for c in cams})
    assert _round(fleet) == []  # its model runs, but no frame of the camera is known to be analysed
    _beat(fleet, box, time.time(), dict.fromkeys(cams))
    assert _round(fleet) == []
    _beat(fleet, box, time.time(), dict.fromkeys(cams, time.time()))
    assert sorted(_round(fleet)) == sorted((POOL, c, "box-1") for c in cams)
    events = fleet.client.get("/api/v1/events", params={"kind": "camera_handover"}).json()
    assert {(e["camera"], e["data"]["end"]) for e in events} == {(c, "running") for c in cams}
    assert all("analyses it" in e["message"] for e in events)


def test_a_handover_ends_when_the_old_device_goes_or_the_new_one_never_runs_it(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    moved = cameras_on(site, "box-1")
    _drain(fleet, "box-1")
    # Not yet over: 119 s on, nobody runs them and box-1 is online.
    assert _round(fleet, time.time() + HANDOVER_TIMEOUT_S - 1) == []
    ended = _round(fleet, time.time() + HANDOVER_TIMEOUT_S + 1)
    assert sorted(c for _, c, _ in ended) == sorted(moved)
    assert sent_pool_cameras(fleet, "box-1") == {}
    events = fleet.client.get("/api/v1/events", params={"kind": "camera_handover"}).json()
    assert {(e["data"]["end"], e["severity"]) for e in events} == {("timeout", "warning")}


def test_a_changed_source_reaches_the_device_that_runs_the_camera_and_those_that_probe_it(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    holder = next(box for box in BOXES if "door-1" in cameras_on(site, box))
    before = {box: sent_desired(fleet, box) for box in BOXES}
    new_source = "rtsp://{secret:north-cams}@10.0.9.1/stream2"
    put_pool(fleet, _declaration(source=new_source))
    for box in BOXES:
        now, was = sent_desired(fleet, box), before[box]
        assert now is not None and was is not None
        if box == holder:
            assert now.cameras["door-1"].source == new_source and "door-1" not in now.probe
        else:
            assert now.probe["door-1"] == new_source and "door-1" not in now.cameras
        # Nothing else of any state changed.
        assert {c: cd.source for c, cd in now.cameras.items() if c != "door-1"} == {
            c: cd.source for c, cd in was.cameras.items() if c != "door-1"
        }
        assert {c: u for c, u in now.probe.items() if c != "door-1"} == {
            c: u for c, u in was.probe.items() if c != "door-1"
        }


def test_a_deleted_pool_leaves_no_camera_on_any_device(fleet: Fleet, site: dict[str, Any]) -> None:
    r = fleet.client.delete(f"/api/v1/pools/{POOL}")
    assert r.status_code in (200, 204), r.text
    for box in BOXES:
        assert sent_pool_cameras(fleet, box) == {}
        assert not any(a["pool"] for a in fleet.device(box)["assignments"].values())


def test_each_device_probes_the_pool_cameras_it_could_be_given(fleet: Fleet, site: dict[str, Any]) -> None:
    for box in BOXES:
        state = sent_desired(fleet, box)
        assert state is not None
        others = set(CAMERAS) - cameras_on(site, box)
        assert state.probe == {cam: pool_camera(cam)["source"] for cam in others}


def test_a_device_that_cannot_reach_a_source_is_never_given_that_camera(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    on_1 = sorted(cameras_on(site, "box-1"))
    # box-2 cannot reach the first of box-1's cameras, and nobody but box-1 reaches the second.
    measured_beat(fleet, "box-2", reach={on_1[0]: False, on_1[1]: False})
    measured_beat(fleet, "box-3", reach={on_1[1]: False})
    r = fleet.client.post(f"/api/v1/pools/{POOL}/plan", json={"fail": ["box-1"]})
    assert r.status_code == 200, r.text
    plan = r.json()
    targets = {m["camera"]: m["target"] for m in plan["moves"]}
    assert targets == {on_1[0]: "box-3"}
    assert "no usable device reaches its source" in plan["unplaced"][on_1[1]]
