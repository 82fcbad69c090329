"""A site's camera pool on real processes, its policies at work: a real Mosquitto, a controller process
and three agent processes with no camera of their own, sharing six looping cameras of real footage
placed 2/2/2 on the devices they prefer, under failback ``preferred``.

- Failback: a ``kill -9`` of one agent moves its two cameras away; restarted, it gets them back once it
  has been up ``min_dwell_s``, make-before-break (it runs each before the interim device stops it, no
  gap longer than the failover bound), each return a ``camera_moved`` event with reason ``failback``,
  and no other camera moves.
- Overload: one camera's model becomes a really slower one (the detector with a heavy branch, the
  same detections); its device measures it over the pool's headroom and sheds exactly that camera,
  and nothing moves it again, back or on, within the dwell time (after it, only another overload
  may: a machine shared with other work measures more on every device).
- A rollout naming the pool's cameras: waves counted in cameras; a ``kill -9`` of the canary camera's
  device during its soak moves the camera, its soak starts again on its new device (a
  ``rollout_soak_restarted`` event), and the rollout completes with every camera on the new version.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.fleet.pools import MIN_COST_FRAMES
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.onnx_models import retagged, tf_od_slow
from tests.support.paths import MODELS
from tests.support.pool_site import (
    SITE_LABEL,
    Watch,
    at,
    camera_moves,
    device_events,
    footage_pool,
    pool_site,
)
from tests.support.stack import MODEL, Stack
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

POOL = "site-policies"
DEVICES = ("pp-1", "pp-2", "pp-3")
CAMERAS = tuple(f"gate-{i}" for i in range(1, 7))
PREFER = {cam: DEVICES[i // 2] for i, cam in enumerate(CAMERAS)}  # gate-1 and gate-2 on pp-1...
FPS = 1.0  # six cameras of the real detector on two cores, beside the controller
GRACE_S = 2.0
DWELL_S = 8.0
REPLAN_S = 0.5
# The pool's promise for a camera whose device died (test_pool_failover.py): analysed again within it.
FAILOVER_S = 15.0
# The overload test's share of a device's inference lane: a camera of the heavy model at 2 FPS is well
# over it, two cameras of the detector are well under it, and no device has to fill the shared cores.
HEADROOM = 0.5
# The rollout test's soak: long enough for a kill -9 to land inside the canary's.
SOAK_S = 8.0
BASE = MODELS / MODEL / "model.onnx"


@pytest.fixture
def site(tmp_path: Path, broker: MosquittoBroker) -> Iterator[Stack]:
    pool = _declaration()
    with pool_site(tmp_path, broker, DEVICES, pool, replan_s=REPLAN_S) as s:
        yield s


def _declaration(**policy: Any) -> dict[str, Any]:
    return footage_pool(
        POOL,
        f"site={SITE_LABEL}",
        CAMERAS,
        fps=FPS,
        grace_s=GRACE_S,
        failback="preferred",
        prefer=PREFER,
        min_dwell_s=DWELL_S,
        **policy,
    )


def _logs(site: Stack) -> str:
    return "agent logs: " + ", ".join(str(a.log) for a in site.agents)


def _moves(api: httpx.Client) -> list[tuple[str, str, str, str]]:
    """Every move as (camera, from, to, reason), in the order made."""
    return [
        (m["camera"], m["data"]["source"], m["data"]["target"], m["data"]["reason"])
        for m in sorted(camera_moves(api), key=lambda m: (at(m), m["id"]))
    ]


def test_a_restarted_device_gets_its_preferred_cameras_back_make_before_break(site: Stack) -> None:
    with site.api() as api:
        watch = Watch(api, DEVICES, CAMERAS)
        assert watch.spread(2, _logs(site)) == PREFER
        victim = site.agents[0]
        home = victim.device_id
        orphans = sorted(cam for cam, dev in PREFER.items() if dev == home)

        killed_at = time.time()
        victim.kill9()
        interim = wait_for(
            lambda: watch.taken_over(set(orphans), home, killed_at),
            timeout=30,
            interval=0.25,
            what=f"{orphans} analysed elsewhere",
        )
        away = {cam: interim[cam] for cam in orphans}
        assert _moves(api) == [(cam, home, away[cam], "device_offline") for cam in orphans]

        victim.start()
        restarted_at = time.time()
        watch.gaps = dict.fromkeys(CAMERAS, 0.0)  # the gaps of the return, not of the failover

        def back() -> list[tuple[str, str, str, str]] | None:
            watch.poll()
            moves = _moves(api)
            home_only = all(watch.runners.get(cam) == {home} for cam in orphans)
            return moves if home_only and len(moves) >= 2 * len(orphans) else None

        moves = wait_for(back, timeout=120, interval=0.25, what=f"{orphans} back on {home} alone")
        assert moves[len(orphans) :] == [(cam, away[cam], home, "failback") for cam in orphans], moves
        events = {m["camera"]: m for m in camera_moves(api) if m["data"]["reason"] == "failback"}
        up_at = datetime.fromisoformat(site.device(home)["online_since"]).timestamp()
        overlap: dict[str, float] = {}
        for cam in orphans:
            # Not before its device had been up for the dwell time.
            assert at(events[cam]) - up_at >= DWELL_S - 0.5, (events[cam], up_at)
            moved_at = at(events[cam])
            # Make-before-break, by the devices' own clocks: the returning device activated the camera's
            # model before the interim one closed the camera.
            started = [e for e in device_events(api, "model_activate", home, cam) if at(e) >= moved_at]
            stopped = [e for e in device_events(api, "camera_down", away[cam], cam) if at(e) >= moved_at]
            assert started and stopped, (started, stopped)
            assert at(started[0]) < at(stopped[0]), (started[0], stopped[0])
            overlap[cam] = at(stopped[0]) - at(started[0])
            (handover,) = [
                e
                for e in api.get("/api/v1/events", params={"kind": "camera_handover", "limit": 1000}).json()
                if e["camera"] == cam and at(e) >= moved_at
            ]
            # Ended once the returning device's heartbeat said it inferred the camera's frames.
            assert (handover["data"]["source"], handover["data"]["target"], handover["data"]["end"]) == (
                away[cam],
                home,
                "running",
            )
        # A few seconds more, so that a camera stalled by the return shows it.
        deadline = time.time() + 4.0
        while time.time() < deadline:
            watch.poll()
            time.sleep(0.5)
        assert max(watch.gaps.values()) < FAILOVER_S, watch.gaps
        print(  # the figures of this run, for -s
            f"back {max(at(e) for e in events.values()) - restarted_at:.1f} s after the restart; both devices "
            f"ran each {min(overlap.values()):.1f}-{max(overlap.values()):.1f} s; longest gap between "
            f"inferences of any camera since the restart {max(watch.gaps.values()):.1f} s"
        )
        placed = api.get(f"/api/v1/pools/{POOL}").json()["placements"]
        assert {cam: p["device"] for cam, p in placed.items()} == PREFER
        site.alive()


def _cost_ms(api: httpx.Client, device: str, model: str) -> float | None:
    """What a frame of ``model`` (name/version) costs on ``device``'s inference lane by its last heartbeat,
    once the figure is made of enough frames for the controller to plan with it."""
    health = api.get(f"/api/v1/devices/{device}").json().get("last_health") or {}
    return next(
        (
            c["infer_ms"]
            for c in health.get("costs") or []
            if c["variant"] == model and c["frames"] >= MIN_COST_FRAMES
        ),
        None,
    )


def test_a_device_overloaded_by_a_slower_model_sheds_one_camera_and_none_comes_back(site: Stack) -> None:
    heavy, busy = CAMERAS[0], PREFER[CAMERAS[0]]
    # The detector with a heavy branch: the same detections, several times its inference time.
    site.upload("ped_heavy", "1", tf_od_slow(BASE.read_bytes(), steps=128))
    with site.api() as api:
        watch = Watch(api, DEVICES, CAMERAS)
        assert watch.spread(2, _logs(site)) == PREFER
        # Its camera at 2 FPS first, on the detector (so that its figures count soon); it may run down
        # to 0.1 FPS and goes first (the lowest priority). Then the heavy model.
        pool = _declaration(headroom=HEADROOM)
        (entry,) = [c for c in pool["cameras"] if c["id"] == heavy]
        entry.update(priority=-1, target_fps=2.0, min_fps=0.1)
        site.call("PUT", f"/api/v1/pools/{POOL}", json=pool)
        wait_for(
            lambda: api.get(f"/api/v1/pools/{POOL}").json()["placements"][heavy]["fps"] == 2.0,
            timeout=30,
            what=f"{heavy} at 2 FPS",
        )
        entry["model"] = "ped_heavy"
        site.call("PUT", f"/api/v1/pools/{POOL}", json=pool)
        assert _moves(api) == []  # nothing measured yet: the plan keeps every camera where it runs
        measured: dict[str, float] = {}

        def shed() -> list[tuple[str, str, str, str]] | None:
            if (ms := _cost_ms(api, busy, "ped_heavy/1")) is not None:
                measured[busy] = ms
            return _moves(api) or None

        moves = wait_for(shed, timeout=120, interval=0.5, what=f"{busy} overloaded by {heavy}")
        assert len(moves) == 1, moves
        cam, source, target, reason = moves[0]
        assert (cam, source, reason) == (heavy, busy, "overload")
        assert busy in measured, "the move came before the device measured the heavy model"
        moved_at = max(at(m) for m in camera_moves(api))
        wait_for(
            lambda: watch.poll().get(heavy) == target and watch.runners.get(heavy) == {target},
            timeout=60,
            interval=0.5,
            what=f"{heavy} analysed on {target} alone",
        )
        # The device it went to measures it as slow as the one it left did: the load was real.
        there = wait_for(
            lambda: _cost_ms(api, target, "ped_heavy/1"), timeout=90, what=f"{target} measures ped_heavy"
        )
        light = _cost_ms(api, target, f"{MODEL}/1")
        assert light is not None and there > 3 * light, (there, light)

        # Nothing comes back, nor moves on, within the dwell time: judged by the moves' own times, as
        # the waits above may outlast it. Past the dwell a device that measures the camera over its
        # headroom may shed it again (on a machine shared with other work every device measures more):
        # that is an overload move too, never a failback or any other.
        settle = max(moved_at + DWELL_S, time.time()) + 4 * REPLAN_S
        while time.time() < settle:
            watch.poll()
            time.sleep(0.5)
        events = sorted(camera_moves(api), key=lambda m: (at(m), m["id"]))
        assert all(at(m) >= moved_at + DWELL_S for m in events[1:]), _moves(api)
        assert {(m["camera"], m["data"]["reason"]) for m in events} == {(heavy, "overload")}, _moves(api)
        view = api.get(f"/api/v1/pools/{POOL}").json()
        runs_on = {c: p["device"] for c, p in view["placements"].items()}
        others = {c: d for c, d in PREFER.items() if c != heavy}
        assert {c: d for c, d in runs_on.items() if c != heavy} == others, runs_on
        assert view["pending"] == [] and view["held"] == [], (view["pending"], view["held"])
        assert all(d["load"]["util"] <= 1.0 for d in view["devices"]), view["devices"]
        if len(events) > 1:
            print(f"{heavy} shed again after the dwell time: {_moves(api)}")
        print(  # the figures of this run, for -s
            f"{heavy}: {measured[busy]:.0f} ms a frame on {busy}, {there:.0f} on {target} (the detector "
            f"alone {light:.0f}); runs on {runs_on[heavy]} at {view['placements'][heavy]['fps']:g} FPS"
        )
        site.alive()


def _rollout(api: httpx.Client, name: str) -> dict[str, Any]:
    r = api.get(f"/api/v1/deployments/{name}")
    assert r.status_code == 200, r.text
    ro: dict[str, Any] = r.json()["rollout"]
    return ro


def test_a_rollout_over_the_pools_cameras_completes_through_a_kill9_during_a_soak(site: Stack) -> None:
    # A new version of the detector: the same graph, another artifact that each device fetches and loads.
    site.upload(MODEL, "2", retagged(BASE.read_bytes(), "version 2"))
    with site.api() as api:
        watch = Watch(api, DEVICES, CAMERAS)
        assert watch.spread(2, _logs(site)) == PREFER
        r = api.post(
            "/api/v1/deployments",
            json={
                "name": "gates-v2",
                "model": MODEL,
                "version": "2",
                "selector": f"site={SITE_LABEL}",
                "cameras": [{"camera": cam} for cam in CAMERAS],
                "waves": [1, "100%"],
                "gate": {
                    "soak_s": SOAK_S,
                    "min_fps_ratio": 0.25,
                    "step_timeout_s": 120,
                    "offline_timeout_s": 60,
                },
            },
        )
        assert r.status_code == 201, r.text
        assert r.json()["rollout"]["plan"] == [1, len(CAMERAS)]  # counted in cameras, not devices

        def soaking() -> dict[str, Any] | None:
            ro = _rollout(api, "gates-v2")
            active = [c for c in ro["cameras"] if c["state"] == "active"]
            return active[0] if active and not ro["gates"] else None

        canary = wait_for(soaking, timeout=120, interval=0.25, what="the canary camera soaking")
        victim = next(a for a in site.agents if a.device_id == canary["device_id"])
        killed_at = time.time()
        victim.kill9()

        def restarted() -> list[dict[str, Any]] | None:
            events = api.get("/api/v1/events", params={"kind": "rollout_soak_restarted"}).json()
            return list(events) or None

        (event,) = wait_for(restarted, timeout=60, what=f"{canary['camera']}'s soak restarted")
        assert (event["camera"], event["data"]["source"], event["data"]["reason"]) == (
            canary["camera"],
            victim.device_id,
            "device_offline",
        )
        moved_to = event["data"]["target"]
        assert moved_to != victim.device_id
        assert _rollout(api, "gates-v2")["gates"] == []  # the move failed nothing

        ro = wait_for(
            lambda: ro if (ro := _rollout(api, "gates-v2"))["state"] not in ("running", "paused") else None,
            timeout=240,
            what="the rollout finished",
        )
        assert ro["state"] == "succeeded", (ro["state"], ro["reason"])
        assert [(g["wave"], g["size"], g["passed"]) for g in ro["gates"]] == [
            (1, 1, True),
            (2, len(CAMERAS) - 1, True),
        ], ro["gates"]
        members = {c["camera"]: c for c in ro["cameras"]}
        assert set(members) == set(CAMERAS)
        assert (members[canary["camera"]]["device_id"], members[canary["camera"]]["soak_restarts"]) == (
            moved_to,
            1,
        )
        assert all(m["state"] == "active" and m["device_id"] != victim.device_id for m in members.values())

        # Every camera runs the new version where its pool placed it, by its device's own report.
        def on_v2() -> dict[str, str] | None:
            placed = {
                c: p["device"] for c, p in api.get(f"/api/v1/pools/{POOL}").json()["placements"].items()
            }
            for cam, dev in placed.items():
                got = (api.get(f"/api/v1/devices/{dev}").json()["models"] or {}).get(cam) or {}
                if (got.get("model"), got.get("state")) != (f"{MODEL}:2", "running"):
                    return None
            return placed

        placed = wait_for(on_v2, timeout=60, what=f"every camera on {MODEL}:2")
        assert victim.device_id not in placed.values()
        print(  # the figures of this run, for -s
            f"{canary['camera']}'s soak restarted on {moved_to} {at(event) - killed_at:.1f} s after the kill; "
            f"the rollout done {time.time() - killed_at:.1f} s after it"
        )
        assert all(a.alive() for a in site.agents if a is not victim)
