"""Rollouts of pool cameras through the real app, on SQLite and PostgreSQL: a deployment that names a
pool's cameras rolls out camera by camera (waves counted in cameras, the rollout API showing each
camera with the device that analyses it); a failover during a camera's judgement starts it again on
the new device, with an event, instead of failing the gate, while a camera whose new version fails
there still rolls the deployment back to the pool's model; and a new version whose measured cost does
not fit where the camera runs is held by the pool's plan, with why, nothing overloaded, and the
rollout fails with the pool's reason."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from controller.cli.rollouts import print_rollout
from tests.support.controller_app import (
    MODEL_BYTES,
    Fleet,
    FleetFactory,
    deploy,
    deployment,
    enroll_measured,
    measured_beat,
    set_availability,
    write_model,
)
from tests.support.pools import (
    cameras_on,
    get_pool,
    pool_camera,
    put_pool,
    report_pool_cameras,
    sent_model,
)
from tests.support.waiting import wait_for

POOL = "site-north"
BOXES = ("box-1", "box-2", "box-3")
CAMERAS = ("door-1", "door-2", "door-3")
GRACE_S = 0.5
# Long soaks: each test says when a wave may pass, and nothing passes on its own meanwhile.
SOAKING = {"soak_s": 3600, "step_timeout_s": 300, "offline_timeout_s": 300}


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    for v in ("1", "2"):
        write_model(d, "tiny", v, MODEL_BYTES + v.encode())
    return d


@pytest.fixture
def fleet(make_fleet: FleetFactory) -> Fleet:
    # The leader's own replan off: a test moves cameras by replanning as of a time it chooses.
    return make_fleet(pool_replan_interval_s=0)


def _site(fleet: Fleet) -> dict[str, Any]:
    for box in BOXES:
        enroll_measured(fleet, box, site="north")
    cams = [pool_camera(c) for c in CAMERAS]
    return put_pool(
        fleet, {"name": POOL, "selector": "site=north", "failover_grace_s": GRACE_S, "cameras": cams}
    )


def _rollout(fleet: Fleet, name: str) -> dict[str, Any]:
    ro: dict[str, Any] = deployment(fleet, name)["rollout"]
    return ro


def _camera_member(fleet: Fleet, name: str, camera: str, check: Any, what: str) -> dict[str, Any]:
    """The rollout's member for ``camera`` once ``check(member)`` holds."""

    def found() -> dict[str, Any] | None:
        for c in _rollout(fleet, name)["cameras"]:
            if c["camera"] == camera and check(c):
                return dict(c)
        return None

    return wait_for(found, timeout=15, what=what)


def _replan(fleet: Fleet, now: float) -> None:
    pools = fleet.client.app.state.runtime.pools  # type: ignore[attr-defined]
    pools.replan_if_changed(POOL, now=now, fence=lambda s: None)


def test_a_rollout_of_pool_cameras_goes_camera_by_camera_and_a_failover_restarts_the_soak(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    site = _site(fleet)
    deploy(
        fleet,
        name="doors-v2",
        version="2",
        selector="site=north",
        cameras=[{"camera": c} for c in CAMERAS],
        waves=[1, "100%"],
        gate=SOAKING,
    )
    ro = _rollout(fleet, "doors-v2")
    assert ro["plan"] == [1, 3]  # counted in cameras: three of them, no device member
    # The canary wave admits one camera, on the device that runs it; no device is a member.
    first = _camera_member(fleet, "doors-v2", "door-1", lambda c: c["target_version"], "door-1 sent tiny:2")
    holder = first["device_id"]
    assert holder == next(b for b in BOXES if "door-1" in cameras_on(site, b))
    ro = _rollout(fleet, "doors-v2")
    assert ro["devices"] == [] and [c["camera"] for c in ro["cameras"]] == ["door-1"]
    assert (ro["cameras"][0]["pool"], ro["cameras"][0]["wave"], ro["cameras"][0]["state"]) == (
        POOL,
        1,
        "applying",
    )
    assert get_pool(fleet, POOL)["placements"]["door-1"]["canary"] == "tiny/2"
    assert sent_model(fleet, holder, "door-1") == "tiny:2"
    other = (cameras_on(site, holder) - {"door-1"}).pop() if cameras_on(site, holder) - {"door-1"} else None
    if other is not None:
        assert sent_model(fleet, holder, other) == "tiny:1"  # only the admitted camera changes
    report_pool_cameras(fleet, holder, {"door-1": ("tiny:2", "running", None)})
    _camera_member(fleet, "doors-v2", "door-1", lambda c: c["state"] == "active", "door-1 active")

    # Its device dies during the soak: the pool moves the camera, and its judgement starts again there.
    set_availability(fleet, holder, "offline")
    _replan(fleet, time.time() + GRACE_S + 1)
    moved = _camera_member(
        fleet, "doors-v2", "door-1", lambda c: c["device_id"] not in (None, holder), "door-1 followed"
    )
    assert moved["state"] == "applying" and moved["soak_restarts"] == 1
    assert f"moved from {holder} (device_offline)" in moved["reason"]
    events = fleet.client.get("/api/v1/events", params={"kind": "rollout_soak_restarted"}).json()
    assert [(e["data"]["source"], e["data"]["target"], e["data"]["reason"]) for e in events] == [
        (holder, moved["device_id"], "device_offline")
    ]
    ro = _rollout(fleet, "doors-v2")
    assert ro["state"] == "running" and not ro["gates"]  # the move failed nothing
    new = moved["device_id"]
    wait_for(
        lambda: sent_model(fleet, new, "door-1") == "tiny:2", timeout=15, what=f"{new} sent door-1 on tiny:2"
    )
    report_pool_cameras(
        fleet,
        new,
        {
            c: ("tiny:2" if c == "door-1" else "tiny:1", "running", None)
            for c in cameras_on(get_pool(fleet, POOL), new)
        },
    )
    _camera_member(fleet, "doors-v2", "door-1", lambda c: c["state"] == "active", "door-1 active again")

    # The new version fails on its new device: that is the version's doing, and the rollout goes back.
    report_pool_cameras(fleet, new, {"door-1": ("tiny:2", "failed", "non-finite output")})
    wait_for(lambda: _rollout(fleet, "doors-v2")["state"] == "failed", timeout=15, what="the rollout failed")
    ro = _rollout(fleet, "doors-v2")
    assert f"camera door-1 failed on {new}: non-finite output" in ro["reason"]
    assert ro["cameras"][0]["state"] == "rolled_back"
    wait_for(lambda: sent_model(fleet, new, "door-1") == "tiny:1", timeout=15, what="door-1 back on tiny:1")
    assert get_pool(fleet, POOL)["placements"]["door-1"]["canary"] is None
    # `edgefleet rollouts show` prints the camera, where it ran last and how often it started again.
    monkeypatch.setenv("COLUMNS", "240")
    print_rollout(deployment(fleet, "doors-v2"))
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"│ {POOL}/door-1 ")]
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[:4] == [f"{POOL}/door-1", "1", "rolled_back", new] and cells[6] == "1", cells


def test_a_new_version_that_does_not_fit_is_held_by_the_pool_and_fails_the_rollout_with_why(
    fleet: Fleet,
) -> None:
    _site(fleet)
    # box-1 measured tiny:2 at 200 ms a frame (the others tiny:1 at 9 ms): 10 FPS of it is 2 s of
    # inference a second, on devices of one inference lane.
    measured_beat(fleet, "box-1", ms=200.0, model="tiny:2")
    before = {d["id"]: d["load"] for d in get_pool(fleet, POOL)["devices"]}
    deploy(
        fleet,
        name="doors-v2",
        version="2",
        selector="site=north",
        cameras=[{"camera": "door-1"}],
        waves=[1],
        gate={**SOAKING, "step_timeout_s": 1.0},
    )
    pool = wait_for(
        lambda: p if (p := get_pool(fleet, POOL))["placements"]["door-1"]["canary_held"] else None,
        timeout=15,
        what="door-1's new version held",
    )
    on = pool["placements"]["door-1"]["device"]
    assert pool["placements"]["door-1"]["canary"] is None
    assert pool["canary_held"]["door-1"].startswith(f"tiny/2 at 10 FPS does not fit on {on}: it would need")
    assert sent_model(fleet, on, "door-1") == "tiny:1"  # nothing changed on the device
    after = {d["id"]: d["load"] for d in pool["devices"]}
    assert after == before and all(load["util"] <= 1.0 for load in after.values())
    plan = fleet.client.post(f"/api/v1/pools/{POOL}/plan", json={}).json()
    assert plan["canary_held"]["door-1"] == pool["canary_held"]["door-1"]
    wait_for(lambda: _rollout(fleet, "doors-v2")["state"] == "failed", timeout=15, what="the rollout failed")
    assert f"its pool does not admit tiny:2 on {on}" in _rollout(fleet, "doors-v2")["reason"]
