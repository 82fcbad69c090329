"""What a pool's plan makes devices run: each device's published desired state names the pool cameras
placed on it, with their source as declared (the secret reference, never a credential) and the plan's
frame rate; a drain moves the cameras' entries to the devices that take them and out of the drained
one's state; a changed source reaches only the device that runs the camera; a deleted pool leaves
nothing behind. Through the real app on SQLite and PostgreSQL (``fleet``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.controller_app import Fleet, FleetFactory, enroll_measured
from tests.support.pools import cameras_on, pool_camera, put_pool, sent_desired, sent_pool_cameras

POOL = "site-north"
BOXES = ("box-1", "box-2", "box-3")


@pytest.fixture
def fleet(make_fleet: FleetFactory) -> Fleet:
    return make_fleet(pool_replan_interval_s=0)


def _declaration(**over_cam: Any) -> dict[str, Any]:
    cams = [pool_camera(f"door-{i}") for i in range(1, 7)]
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


def test_a_drain_moves_the_entries_with_the_cameras(fleet: Fleet, site: dict[str, Any]) -> None:
    kept = {box: set(sent_pool_cameras(fleet, box)) for box in ("box-2", "box-3")}
    moved = cameras_on(site, "box-1")
    r = fleet.client.post(f"/api/v1/pools/{POOL}/devices/box-1/drain")
    assert r.status_code == 200, r.text
    assert sent_pool_cameras(fleet, "box-1") == {}
    after = {box: set(sent_pool_cameras(fleet, box)) for box in ("box-2", "box-3")}
    # Nothing the other devices ran left them; the drained device's cameras are each somewhere.
    assert all(kept[box] <= after[box] for box in after)
    assert set().union(*after.values()) == set().union(*kept.values()) | moved


def test_a_changed_source_reaches_only_the_device_that_runs_the_camera(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    holder = next(box for box in BOXES if "door-1" in cameras_on(site, box))
    versions = {box: sent_desired(fleet, box).version for box in BOXES}  # type: ignore[union-attr]
    new_source = "rtsp://{secret:north-cams}@10.0.9.1/stream2"
    put_pool(fleet, _declaration(source=new_source))
    assert sent_pool_cameras(fleet, holder)["door-1"].source == new_source
    for box in BOXES:
        now = sent_desired(fleet, box)
        assert now is not None
        assert now.version == versions[box] + (1 if box == holder else 0), box


def test_a_deleted_pool_leaves_no_camera_on_any_device(fleet: Fleet, site: dict[str, Any]) -> None:
    r = fleet.client.delete(f"/api/v1/pools/{POOL}")
    assert r.status_code in (200, 204), r.text
    for box in BOXES:
        assert sent_pool_cameras(fleet, box) == {}
        assert not any(a["pool"] for a in fleet.device(box)["assignments"].values())
