"""Camera pools through the real app: a pool declared over three enrolled devices that report their
inference costs in heartbeats, planned at once and spread; a dry-run failure that moves only the failed
device's cameras and stores nothing; cordon, drain, uncordon and manual moves with their recorded
events; sources with a literal password refused and kept nowhere; unknown names and read-only tokens
refused. On SQLite and PostgreSQL (``fleet``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from sqlmodel import SQLModel

from fleet_protocol import TopicKind
from fleet_protocol.messages import Availability
from tests.support.controller_app import Fleet, FleetFactory, enroll_measured
from tests.support.pools import cameras_on, devices_of, get_pool, moved_events, pool_camera, put_pool
from tests.support.processes import bearer
from tests.support.waiting import wait_for

POOL = "site-north"
BOXES = ("box-1", "box-2", "box-3")
PASSWORD = "Hunter2-pa55word"


def _declaration(cameras: int = 6, **policy: Any) -> dict[str, Any]:
    return {
        "name": POOL,
        "selector": "site=north",
        "cameras": [pool_camera(f"door-{i}") for i in range(1, cameras + 1)],
        **policy,
    }


def _post(fleet: Fleet, path: str, **kw: Any) -> dict[str, Any]:
    r = fleet.client.post(f"/api/v1/pools/{POOL}/{path}", **kw)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.fixture
def fleet(make_fleet: FleetFactory) -> Fleet:
    """The leader's periodic replan off: each test sees what an operator change stored, and a device
    lost meanwhile as ``pending`` (the periodic replan: tests/unit/controller/fleet/test_pools_replan.py)."""
    return make_fleet(pool_replan_interval_s=0)


@pytest.fixture
def site(fleet: Fleet) -> dict[str, Any]:
    """Three devices of site north and one of site south; the pool over site north, as first planned."""
    for box in BOXES:
        enroll_measured(fleet, box, site="north")
    enroll_measured(fleet, "box-9", site="south")
    return put_pool(fleet, _declaration())


def test_a_declared_pool_spreads_its_cameras_over_the_devices_it_selects(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    assert [d["id"] for d in site["devices"]] == list(BOXES)  # box-9 is not selected
    assert all(d["online"] and d["status"] == "online" for d in site["devices"])
    assert Counter(devices_of(site).values()) == {"box-1": 2, "box-2": 2, "box-3": 2}
    assert all(p["fps"] == 10 for p in site["placements"].values())
    assert site["unplaced"] == {} and site["degraded"] == {} and site["pending"] == []
    assert site["n_plus_one"] is True
    # Costs come from the heartbeats: 2 cameras x 10 FPS x 9 ms on one lane, against 0.8 of 1000 ms/s.
    loads = {d["id"]: d["load"] for d in site["devices"]}
    assert loads["box-1"]["lane_ms_per_s"] == pytest.approx(180.0) and loads["box-1"]["lane_limit"] == 800.0
    # A new pool moved nothing: placing a camera is not a move.
    assert moved_events(fleet) == [] and site["recent_moves"] == []

    (listed,) = fleet.client.get("/api/v1/pools").json()
    assert listed["name"] == POOL and (listed["devices"], listed["cameras"], listed["placed"]) == (3, 6, 6)


def test_a_dry_run_failure_moves_only_that_devices_cameras_and_stores_nothing(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    on_2 = cameras_on(site, "box-2")
    assert len(on_2) == 2
    plan = _post(fleet, "plan", json={"fail": ["box-2"]})
    assert plan["fail"] == ["box-2"]
    assert {m["camera"] for m in plan["moves"]} == on_2
    for m in plan["moves"]:
        assert (m["source"], m["reason"], m["fps"]) == ("box-2", "device_offline", 10)
        assert m["target"] in ("box-1", "box-3")
    # Every other camera stays where it is, and the failed device takes nothing.
    after = {cam: p["device"] for cam, p in plan["placements"].items()}
    assert {cam: dev for cam, dev in after.items() if cam not in on_2} == {
        cam: dev for cam, dev in devices_of(site).items() if cam not in on_2
    }
    assert "box-2" not in plan["loads"] and plan["unplaced"] == {} and plan["degraded"] == {}

    # Nothing was written: the same placements, no event, box-2 as it was.
    now = get_pool(fleet, POOL)
    assert now["placements"] == site["placements"] and now["recent_moves"] == []
    assert moved_events(fleet) == []
    assert {d["id"]: d["cordoned"] for d in now["devices"]} == dict.fromkeys(BOXES, False)


def test_a_device_that_goes_offline_keeps_its_cameras_for_the_grace_then_the_next_replan_moves_them(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    on_3 = cameras_on(site, "box-3")
    fleet.send("box-3", TopicKind.AVAILABILITY, Availability(state="offline"))
    wait_for(lambda: fleet.device("box-3")["status"] == "offline", timeout=10, what="box-3 offline")
    graced = get_pool(fleet, POOL)  # failover_grace_s 10: box-3 keeps its cameras, nothing pending
    box3 = next(d for d in graced["devices"] if d["id"] == "box-3")
    assert (box3["online"], box3["in_grace"]) == (False, True)
    assert graced["pending"] == [] and cameras_on(graced, "box-3") == on_3

    # Declared without a grace, the pool is planned again at once: box-3's cameras move, each an event.
    moved = put_pool(fleet, _declaration(failover_grace_s=0))
    assert cameras_on(moved, "box-3") == set() and moved["pending"] == []
    assert sorted(e["camera"] for e in moved_events(fleet)) == sorted(on_3)

    # A device lost between two changes: the view shows what the next replan will move, and it does.
    on_2 = cameras_on(moved, "box-2")
    fleet.send("box-2", TopicKind.AVAILABILITY, Availability(state="offline"))
    wait_for(lambda: fleet.device("box-2")["status"] == "offline", timeout=10, what="box-2 offline")
    seen = get_pool(fleet, POOL)
    assert cameras_on(seen, "box-2") == on_2  # the stored plan, until the next replan
    assert {(m["camera"], m["source"], m["target"], m["reason"]) for m in seen["pending"]} == {
        (c, "box-2", "box-1", "device_offline") for c in on_2
    }
    replanned = put_pool(fleet, _declaration(failover_grace_s=0))
    assert set(devices_of(replanned).values()) == {"box-1"} and replanned["pending"] == []


def test_a_dry_run_of_every_device_says_why_each_camera_is_unplaced(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    plan = _post(fleet, "plan", json={"fail": list(BOXES)})
    assert plan["placements"] == {} and plan["moves"] == [] and plan["loads"] == {}
    assert set(plan["unplaced"]) == set(site["placements"])
    assert all("no device of the site is online" in why for why in plan["unplaced"].values()), plan


def test_drain_moves_the_devices_cameras_with_reason_cordoned_and_records_each_move(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    on_2 = cameras_on(site, "box-2")
    drained = _post(fleet, "devices/box-2/drain")
    assert cameras_on(drained, "box-2") == set()
    assert {cam: dev for cam, dev in devices_of(drained).items() if cam not in on_2} == {
        cam: dev for cam, dev in devices_of(site).items() if cam not in on_2
    }
    box2 = next(d for d in drained["devices"] if d["id"] == "box-2")
    assert (box2["cordoned"], box2["draining"], box2["cameras"], box2["load"]) == (True, True, 0, None)

    moves = drained["recent_moves"]
    assert {m["camera"] for m in moves} == on_2
    assert {(m["source"], m["reason"]) for m in moves} == {("box-2", "cordoned")}
    events = moved_events(fleet)
    assert sorted(e["camera"] for e in events) == sorted(on_2)
    for e in events:
        assert e["source"] == "controller" and e["data"]["pool"] == POOL
        assert e["device_id"] == e["data"]["target"] == devices_of(drained)[e["camera"]]

    # Uncordoned, box-2 takes cameras again, but nothing moves back by itself.
    back = _post(fleet, "devices/box-2/uncordon")
    assert devices_of(back) == devices_of(drained)
    assert not any(d["cordoned"] or d["draining"] for d in back["devices"])
    assert len(moved_events(fleet)) == len(events)


def test_a_cordoned_device_keeps_its_cameras_and_takes_no_new_one(fleet: Fleet, site: dict[str, Any]) -> None:
    on_1 = cameras_on(site, "box-1")
    cordoned = _post(fleet, "devices/box-1/cordon")
    assert devices_of(cordoned) == devices_of(site) and moved_events(fleet) == []
    box1 = next(d for d in cordoned["devices"] if d["id"] == "box-1")
    assert (box1["cordoned"], box1["draining"]) == (True, False)

    grown = put_pool(fleet, _declaration(cameras=10))
    assert cameras_on(grown, "box-1") == on_1
    assert len(grown["placements"]) == 10 and grown["unplaced"] == {}
    # The cordon outlives the new declaration.
    assert next(d for d in grown["devices"] if d["id"] == "box-1")["cordoned"] is True


def test_move_pins_a_camera_and_unpin_leaves_it_where_it_runs(fleet: Fleet, site: dict[str, Any]) -> None:
    cam = sorted(cameras_on(site, "box-1"))[0]
    moved = _post(fleet, f"cameras/{cam}/move", json={"device": "box-3"})
    assert devices_of(moved)[cam] == "box-3"
    assert next(c for c in moved["cameras"] if c["id"] == cam)["pin"] == "box-3"
    (event,) = moved_events(fleet)
    assert event["data"] == {
        "pool": POOL,
        "camera": cam,
        "source": "box-1",
        "target": "box-3",
        "fps": 10.0,
        "reason": "manual",
    }
    # Declaring the pool again keeps the operator's pin.
    again = put_pool(fleet, _declaration())
    assert devices_of(again)[cam] == "box-3"
    assert next(c for c in again["cameras"] if c["id"] == cam)["pin"] == "box-3"

    r = fleet.client.delete(f"/api/v1/pools/{POOL}/cameras/{cam}/move")
    assert r.status_code == 200, r.text
    assert devices_of(r.json())[cam] == "box-3"
    assert next(c for c in r.json()["cameras"] if c["id"] == cam)["pin"] is None

    # Onto a draining device: refused, the camera stays.
    _post(fleet, "devices/box-2/drain")
    r = fleet.client.post(f"/api/v1/pools/{POOL}/cameras/{cam}/move", json={"device": "box-2"})
    assert r.status_code == 409 and "draining" in r.json()["detail"], r.text
    assert devices_of(get_pool(fleet, POOL))[cam] == "box-3"


def _stored_text(fleet: Fleet) -> str:
    """Every row of every table, as text."""
    engine = fleet.client.app.state.runtime.engine  # type: ignore[attr-defined]
    parts = []
    with engine.connect() as conn:
        for table in SQLModel.metadata.sorted_tables:
            parts += [repr(tuple(row)) for row in conn.execute(sa.select(table))]
    return "\n".join(parts)


@pytest.mark.parametrize(
    "source",
    [
        f"rtsp://admin:{PASSWORD}@10.0.0.9/live",
        f"rtsps://viewer:{PASSWORD}@cam.example:322/live",
        f"http://10.0.0.9/snapshot.cgi?user=admin&password={PASSWORD}",
    ],
)
def test_a_source_with_a_literal_password_is_refused_and_stored_nowhere(
    fleet: Fleet, site: dict[str, Any], source: str
) -> None:
    bad = _declaration()
    bad["cameras"][0]["source"] = source
    r = fleet.client.put(f"/api/v1/pools/{POOL}", json=bad)
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "cameras", 0, "source"]
    assert "{secret:" in err["msg"] and "never stored" in err["msg"]
    assert PASSWORD not in r.text

    fresh = {**bad, "name": "leaky"}
    r = fleet.client.put("/api/v1/pools/leaky", json=fresh)
    assert r.status_code == 422 and PASSWORD not in r.text
    assert fleet.client.get("/api/v1/pools/leaky").status_code == 404
    assert get_pool(fleet, POOL)["cameras"][0]["source"] == site["cameras"][0]["source"]
    assert PASSWORD not in _stored_text(fleet)


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("ftp://10.0.0.9/live", "scheme must be one of"),
        ("rtsp://admin@10.0.0.9/live", "{secret:NAME} reference"),
        ("rtsp://{secret:a}{secret:b}@10.0.0.9/live", "{secret:NAME} reference"),
        ("rtsp:///live", "needs a host"),
        ("rtsp://10.0.0.9:99999/live", "invalid port"),
        ("rtsp://10.0.0.9/li ve", "spaces"),
    ],
)
def test_a_bad_source_is_a_422_naming_it(fleet: Fleet, source: str, says: str) -> None:
    bad = _declaration()
    bad["cameras"][2]["source"] = source
    r = fleet.client.put(f"/api/v1/pools/{POOL}", json=bad)
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "cameras", 2, "source"] and says in err["msg"], err
    assert fleet.client.get(f"/api/v1/pools/{POOL}").status_code == 404


def test_a_secret_reference_and_a_file_are_accepted_as_sources(fleet: Fleet, site: dict[str, Any]) -> None:
    body = _declaration(cameras=2)
    body["cameras"][1]["source"] = "file:///var/lib/edgefleet/clips/door.mp4"
    pool = put_pool(fleet, body)
    assert [c["source"] for c in pool["cameras"]] == [
        "rtsp://{secret:north-cams}@10.0.0.1/stream1",
        "file:///var/lib/edgefleet/clips/door.mp4",
    ]
    assert set(pool["placements"]) == {"door-1", "door-2"}  # the cameras no longer declared are gone


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"selector": "site in (north"}, ["body", "selector"]),
        ({"name": "other-pool"}, ["body", "name"]),
        ({"headroom": 0}, ["body", "headroom"]),
        ({"strategy": "random"}, ["body", "strategy"]),
    ],
)
def test_a_bad_declaration_is_a_422_naming_the_field(
    fleet: Fleet, change: dict[str, Any], field: list[str]
) -> None:
    r = fleet.client.put(f"/api/v1/pools/{POOL}", json={**_declaration(), **change})
    assert r.status_code == 422, r.text
    assert any(err["loc"][: len(field)] == field for err in r.json()["detail"]), r.text


def test_frame_rates_and_camera_ids_are_checked(fleet: Fleet, site: dict[str, Any]) -> None:
    body = _declaration()
    body["cameras"][1]["min_fps"] = 20
    r = fleet.client.put(f"/api/v1/pools/{POOL}", json=body)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "cameras", 1, "min_fps"], r.text
    body = _declaration()
    body["cameras"][3]["id"] = body["cameras"][0]["id"]
    r = fleet.client.put(f"/api/v1/pools/{POOL}", json=body)
    assert r.status_code == 422 and "declared twice" in r.text, r.text
    body = _declaration()
    body["cameras"][0]["version"] = "9"
    r = fleet.client.put(f"/api/v1/pools/{POOL}", json=body)
    assert r.status_code == 404 and "tiny:9" in r.json()["detail"], r.text
    assert get_pool(fleet, POOL)["placements"] == site["placements"]


def test_unknown_pools_cameras_and_devices_are_404s_naming_them(fleet: Fleet, site: dict[str, Any]) -> None:
    api = fleet.client
    cam = next(iter(site["placements"]))
    cases = [
        (api.get("/api/v1/pools/nope"), "nope"),
        (api.delete("/api/v1/pools/nope"), "nope"),
        (api.post("/api/v1/pools/nope/plan", json={}), "nope"),
        (api.post(f"/api/v1/pools/{POOL}/plan", json={"fail": ["box-7"]}), "box-7"),
        (api.post(f"/api/v1/pools/{POOL}/plan", json={"fail": ["box-9"]}), "box-9"),  # not selected
        (api.post(f"/api/v1/pools/{POOL}/devices/box-7/cordon"), "box-7"),
        (api.post(f"/api/v1/pools/{POOL}/devices/box-9/drain"), "box-9"),
        (api.post(f"/api/v1/pools/{POOL}/cameras/nope-cam/move", json={"device": "box-1"}), "nope-cam"),
        (api.post(f"/api/v1/pools/{POOL}/cameras/{cam}/move", json={"device": "box-7"}), "box-7"),
        (api.delete(f"/api/v1/pools/{POOL}/cameras/nope-cam/move"), "nope-cam"),
    ]
    for r, name in cases:
        assert r.status_code == 404, (r.request.url, r.text)
        assert name in r.json()["detail"], r.text
    assert get_pool(fleet, POOL)["placements"] == site["placements"] and moved_events(fleet) == []


def test_delete_removes_the_pool_and_its_name_is_free_again(fleet: Fleet, site: dict[str, Any]) -> None:
    _post(fleet, "devices/box-2/drain")
    assert fleet.client.delete(f"/api/v1/pools/{POOL}").status_code == 204
    assert fleet.client.get(f"/api/v1/pools/{POOL}").status_code == 404
    assert fleet.client.get("/api/v1/pools").json() == []
    # Declared again: a new pool, box-2 no longer cordoned in it.
    again = put_pool(fleet, _declaration())
    assert not any(d["cordoned"] for d in again["devices"]) and len(again["placements"]) == 6


def test_a_viewer_token_reads_pools_and_cannot_change_them(fleet: Fleet, site: dict[str, Any]) -> None:
    r = fleet.client.post("/api/v1/tokens", json={"name": "tech", "role": "viewer"})
    assert r.status_code == 201, r.text
    viewer = bearer(r.json()["token"])
    api = fleet.client
    assert api.get(f"/api/v1/pools/{POOL}", headers=viewer).status_code == 200
    assert api.get("/api/v1/pools", headers=viewer).status_code == 200
    writes = [
        api.put(f"/api/v1/pools/{POOL}", json=_declaration(cameras=1), headers=viewer),
        api.delete(f"/api/v1/pools/{POOL}", headers=viewer),
        api.post(f"/api/v1/pools/{POOL}/devices/box-1/drain", headers=viewer),
        api.post(f"/api/v1/pools/{POOL}/cameras/door-1/move", json={"device": "box-2"}, headers=viewer),
    ]
    for r in writes:
        assert r.status_code == 403 and "operator" in r.json()["detail"], r.text
    assert get_pool(fleet, POOL)["placements"] == site["placements"]


def test_a_camera_id_another_pool_declares_on_a_shared_device_is_a_409_naming_both(
    fleet: Fleet, site: dict[str, Any]
) -> None:
    # Site south's pool may have its own door-1: no device is in both pools.
    south = {"name": "site-south", "selector": "site=south", "cameras": [pool_camera("door-1")]}
    assert fleet.client.put("/api/v1/pools/site-south", json=south).status_code == 200
    # A pool over every device shares box-1..3 with site north: its door-2 would be two cameras there.
    everywhere = {
        "name": "everywhere",
        "selector": "",
        "cameras": [pool_camera("yard"), pool_camera("door-2")],
    }
    r = fleet.client.put("/api/v1/pools/everywhere", json=everywhere)
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    assert "cameras[1] (door-2)" in detail and "site-north" in detail and "box-1" in detail, detail
    assert fleet.client.get("/api/v1/pools/everywhere").status_code == 404  # nothing stored
    everywhere["cameras"] = [pool_camera("yard")]
    assert fleet.client.put("/api/v1/pools/everywhere", json=everywhere).status_code == 200
