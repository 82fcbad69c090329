"""A camera pool on real processes: agents with no camera of their own sharing looping cameras of the
bundled footage (:func:`pool_site` starts one), and what a test watches through the controller's API:
which device analyses each camera (it reports the camera running and inferring), the longest gap
between inferences, the moves, the devices' own events."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE
from tests.support.stack import MODEL, Stack
from tests.support.waiting import wait_for

SITE_LABEL = "e2e"


def footage_pool(
    name: str,
    selector: str,
    cameras: Sequence[str],
    *,
    fps: float,
    grace_s: float,
    failback: str = "never",
    prefer: Mapping[str, str] | None = None,
    **policy: Any,
) -> dict[str, Any]:
    """A pool declaration of ``cameras``, each the looping footage through the real detector at ``fps``
    (``prefer``: camera -> its preferred device; ``policy``: the pool's other settings)."""
    return {
        "name": name,
        "selector": selector,
        "failover_grace_s": grace_s,
        "failback": failback,
        **policy,
        "cameras": [
            {
                "id": cam,
                "source": f"file://{FOOTAGE}",
                "model": MODEL,
                "version": "1",
                "target_fps": fps,
                "min_fps": fps,
                **({"prefer": prefer[cam]} if prefer and cam in prefer else {}),
            }
            for cam in cameras
        ],
    }


@contextmanager
def pool_site(
    workdir: Path,
    broker: MosquittoBroker,
    devices: Sequence[str],
    pool: Mapping[str, Any],
    *,
    replan_s: float,
    mqtt_urls: Mapping[str, str] | None = None,
) -> Iterator[Stack]:
    """A controller process replanning pools every ``replan_s``, an agent process with no camera of its
    own for each of ``devices`` (labelled ``site=e2e``; ``mqtt_urls``: a device's own way to the broker),
    all online, and ``pool`` declared. Everything is stopped on the way out."""
    stack = Stack(
        workdir,
        broker,
        EDGEFLEET_BUILD_VARIANTS_ON_UPLOAD="false",
        EDGEFLEET_POOL_REPLAN_INTERVAL_S=str(replan_s),
    )
    try:
        for dev in devices:
            # A cut link is noticed within seconds on both ends (the broker: 1.5 keepalives of silence).
            stack.agent(
                dev,
                cameras=[],
                mqtt_url=(mqtt_urls or {}).get(dev),
                mqtt_keepalive_s=2,
                mqtt_reconnect_max_s=2,
            )
        stack.start()
        for dev in devices:
            stack.enrol(dev, site=SITE_LABEL)
        for a in stack.agents:
            a.start()
        wait_for(
            lambda: all(stack.device(d)["status"] == "online" for d in devices),
            timeout=60,
            what="agents online",
        )
        stack.call("PUT", f"/api/v1/pools/{pool['name']}", json=dict(pool))
        yield stack
    finally:
        stack.stop()


class Watch:
    """Per camera, the device that last reported inferring it and when (the agents' own clock, this
    machine's), as the controller's device views show it."""

    def __init__(self, api: httpx.Client, devices: Sequence[str], cameras: Sequence[str]) -> None:
        self.api = api
        self.devices = tuple(devices)
        self.cameras = tuple(cameras)
        self.seen: dict[str, tuple[str, float]] = {}
        self.gaps: dict[str, float] = dict.fromkeys(cameras, 0.0)
        # Camera -> every device that ran it at the last poll (two during a handover).
        self.runners: dict[str, set[str]] = {}

    def poll(self) -> dict[str, str]:
        """Camera -> the device running it now (reported ``running`` and inferring since the last poll
        or before). Also keeps each camera's longest gap between inferences seen so far, and
        :attr:`runners`."""
        running: dict[str, str] = {}
        runners: dict[str, set[str]] = {}
        for dev in self.devices:
            try:
                view = self.api.get(f"/api/v1/devices/{dev}").json()
            except httpx.HTTPError:
                continue  # a replica killed under the client: the next poll asks again
            if view.get("status") != "online":
                continue
            models = view.get("models") or {}
            for stats in view.get("cameras") or []:
                cam, at = stats.get("camera"), stats.get("last_inferred_at")
                if cam not in self.cameras or at is None or (models.get(cam) or {}).get("state") != "running":
                    continue
                running[cam] = dev
                runners.setdefault(cam, set()).add(dev)
                before = self.seen.get(cam)
                if before is None or at > before[1]:
                    if before is not None:
                        self.gaps[cam] = max(self.gaps[cam], at - before[1])
                    self.seen[cam] = (dev, at)
        self.runners = runners
        return running

    def taken_over(self, cameras: set[str], gone: str, since: float) -> dict[str, str] | None:
        """Camera -> device once every one of ``cameras`` runs on a device other than ``gone`` and was
        inferred after ``since``; None until then."""
        now = self.poll()
        done = all(now.get(c) not in (None, gone) and self.seen[c][1] > since for c in cameras)
        return now if done else None

    def spread(self, per_device: int, what: str) -> dict[str, str]:
        """Every camera analysed, ``per_device`` on each device: camera -> device."""
        spread = wait_for(
            lambda: r if len(r := self.poll()) == len(self.cameras) else None,
            timeout=180,
            interval=0.5,
            what=f"every pool camera analysed ({what})",
        )
        assert Counter(spread.values()) == dict.fromkeys(self.devices, per_device), spread
        return spread


def camera_moves(api: httpx.Client) -> list[dict[str, Any]]:
    """Every ``camera_moved`` event recorded."""
    r = api.get("/api/v1/events", params={"kind": "camera_moved"})
    assert r.status_code == 200, r.text
    return list(r.json())


def device_events(api: httpx.Client, kind: str, device: str, camera: str) -> list[dict[str, Any]]:
    """The events of ``kind`` that ``device`` sent about ``camera``, oldest first."""
    r = api.get("/api/v1/events", params={"kind": kind, "device": device, "source": "device", "limit": 1000})
    assert r.status_code == 200, r.text
    return sorted((e for e in r.json() if e["camera"] == camera), key=at)


def at(event: dict[str, Any]) -> float:
    """An event's time (the clock of whoever wrote it), in unix seconds."""
    return datetime.fromisoformat(event["ts"]).timestamp()
