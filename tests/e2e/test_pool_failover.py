"""A site's camera pool on real processes: a real Mosquitto, a controller process and three agent
processes with no camera of their own, sharing six looping cameras of real footage that the pool places
2/2/2. A ``kill -9`` of one agent: its two cameras are analysed on the others within 15 s of the kill,
no camera goes unanalysed for more than 20 s, no other camera moves, and each move is an event with its
reason. The killed agent restarted: under failback ``never`` nothing moves back to it."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE
from tests.support.stack import MODEL, Stack
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

POOL = "site-e2e"
DEVICES = ("pf-1", "pf-2", "pf-3")
CAMERAS = tuple(f"gate-{i}" for i in range(1, 7))
FPS = 1.0  # six cameras of the real detector on two cores, beside the controller
GRACE_S = 2.0
# The controller's: its replan round, and how soon it takes a silent device for offline (a kill -9 is
# seen at once through the broker's will; the heartbeat timeout is only the fallback).
ENV = {"EDGEFLEET_POOL_REPLAN_INTERVAL_S": "0.5"}


def _declaration() -> dict[str, Any]:
    return {
        "name": POOL,
        "selector": "site=e2e",
        "failover_grace_s": GRACE_S,
        "failback": "never",
        "cameras": [
            {
                "id": cam,
                "source": f"file://{FOOTAGE}",
                "model": MODEL,
                "version": "1",
                "target_fps": FPS,
                "min_fps": FPS,
            }
            for cam in CAMERAS
        ],
    }


class Watch:
    """Per camera, the device that last reported inferring it and when (the agents' own clock, this
    machine's), as the controller's device views show it."""

    def __init__(self, api: httpx.Client) -> None:
        self.api = api
        self.seen: dict[str, tuple[str, float]] = {}
        self.gaps: dict[str, float] = dict.fromkeys(CAMERAS, 0.0)

    def poll(self) -> dict[str, str]:
        """Camera -> the device running it now (reported ``running`` and inferring since the last poll
        or before). Also keeps each camera's longest gap between inferences seen so far."""
        running: dict[str, str] = {}
        for dev in DEVICES:
            view = self.api.get(f"/api/v1/devices/{dev}").json()
            if view.get("status") != "online":
                continue
            models = view.get("models") or {}
            for stats in view.get("cameras") or []:
                cam, at = stats.get("camera"), stats.get("last_inferred_at")
                if cam not in CAMERAS or at is None or (models.get(cam) or {}).get("state") != "running":
                    continue
                running[cam] = dev
                before = self.seen.get(cam)
                if before is None or at > before[1]:
                    if before is not None:
                        self.gaps[cam] = max(self.gaps[cam], at - before[1])
                    self.seen[cam] = (dev, at)
        return running


@pytest.fixture
def site(tmp_path: Path, broker: MosquittoBroker) -> Iterator[Stack]:
    stack = Stack(tmp_path, broker, EDGEFLEET_BUILD_VARIANTS_ON_UPLOAD="false", **ENV)
    try:
        for dev in DEVICES:
            stack.agent(dev, cameras=[])
        stack.start()
        for dev in DEVICES:
            stack.enrol(dev, site="e2e")
        for a in stack.agents:
            a.start()
        wait_for(
            lambda: all(stack.device(d)["status"] == "online" for d in DEVICES),
            timeout=60,
            what="agents online",
        )
        stack.call("PUT", f"/api/v1/pools/{POOL}", json=_declaration())
        yield stack
    finally:
        stack.stop()


def _moves(api: httpx.Client) -> list[dict[str, Any]]:
    r = api.get("/api/v1/events", params={"kind": "camera_moved"})
    assert r.status_code == 200, r.text
    return list(r.json())


def test_a_killed_agents_cameras_are_analysed_elsewhere_within_seconds(site: Stack) -> None:
    with site.api() as api:
        watch = Watch(api)
        spread = wait_for(
            lambda: r if len(r := watch.poll()) == len(CAMERAS) else None,
            timeout=180,
            interval=0.5,
            what="every pool camera analysed (agent logs: "
            + ", ".join(str(a.log) for a in site.agents)
            + ")",
        )
        assert Counter(spread.values()) == dict.fromkeys(DEVICES, 2), spread
        assert _moves(api) == []  # placing a new pool's cameras is not a move
        victim = site.agents[0]
        orphans = {cam for cam, dev in spread.items() if dev == victim.device_id}
        watch.gaps = dict.fromkeys(CAMERAS, 0.0)  # the gaps of the failover, not of the start

        killed_at = time.time()
        victim.kill9()

        def taken_over() -> dict[str, str] | None:
            now = watch.poll()
            moved = all(
                now.get(cam) not in (None, victim.device_id) and watch.seen[cam][1] > killed_at
                for cam in orphans
            )
            return now if moved else None

        after = wait_for(taken_over, timeout=30, interval=0.25, what=f"{sorted(orphans)} analysed elsewhere")
        took_s = max(watch.seen[cam][1] for cam in orphans) - killed_at
        assert took_s < 15.0, f"the orphans were analysed again {took_s:.1f} s after the kill"
        # Watch a little longer than the worst gap allowed, so a camera that stalled shows it.
        deadline = time.time() + 6.0
        while time.time() < deadline:
            watch.poll()
            time.sleep(0.5)
        assert max(watch.gaps.values()) < 20.0, watch.gaps
        print(  # the figures of this run, for -s
            f"orphans analysed again {took_s:.1f} s after the kill; longest gap between inferences of "
            f"any camera {max(watch.gaps.values()):.1f} s"
        )
        assert {cam: dev for cam, dev in after.items() if cam not in orphans} == {
            cam: dev for cam, dev in spread.items() if cam not in orphans
        }
        moves = _moves(api)
        assert sorted(m["camera"] for m in moves) == sorted(orphans)
        assert {(m["data"]["source"], m["data"]["reason"]) for m in moves} == {
            (victim.device_id, "device_offline")
        }

        # Back: under failback never, nothing moves back to it.
        victim.start()
        wait_for(lambda: site.device(victim.device_id)["status"] == "online", timeout=60, what="victim back")

        def victim_in_pool() -> dict[str, Any] | None:
            v: dict[str, Any] = api.get(f"/api/v1/pools/{POOL}").json()
            return v if any(d["id"] == victim.device_id and d["online"] for d in v["devices"]) else None

        view = wait_for(victim_in_pool, timeout=30, what="the pool sees the victim online")
        assert view["pending"] == [], view["pending"]  # the plan as of now moves nothing
        assert len(_moves(api)) == len(moves)
        site.alive()
