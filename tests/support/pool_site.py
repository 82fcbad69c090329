"""A camera pool on real processes: agents with no camera of their own sharing looping cameras of the
bundled footage, and what a test watches through the controller's API: which device analyses each
camera (it reports the camera running and inferring), the longest gap between inferences, the moves."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx

from tests.support.paths import FOOTAGE
from tests.support.stack import MODEL
from tests.support.waiting import wait_for


def footage_pool(
    name: str, selector: str, cameras: Sequence[str], *, fps: float, grace_s: float, failback: str = "never"
) -> dict[str, Any]:
    """A pool declaration of ``cameras``, each the looping footage through the real detector at ``fps``."""
    return {
        "name": name,
        "selector": selector,
        "failover_grace_s": grace_s,
        "failback": failback,
        "cameras": [
            {
                "id": cam,
                "source": f"file://{FOOTAGE}",
                "model": MODEL,
                "version": "1",
                "target_fps": fps,
                "min_fps": fps,
            }
            for cam in cameras
        ],
    }


class Watch:
    """Per camera, the device that last reported inferring it and when (the agents' own clock, this
    machine's), as the controller's device views show it."""

    def __init__(self, api: httpx.Client, devices: Sequence[str], cameras: Sequence[str]) -> None:
        self.api = api
        self.devices = tuple(devices)
        self.cameras = tuple(cameras)
        self.seen: dict[str, tuple[str, float]] = {}
        self.gaps: dict[str, float] = dict.fromkeys(cameras, 0.0)

    def poll(self) -> dict[str, str]:
        """Camera -> the device running it now (reported ``running`` and inferring since the last poll
        or before). Also keeps each camera's longest gap between inferences seen so far."""
        running: dict[str, str] = {}
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
                before = self.seen.get(cam)
                if before is None or at > before[1]:
                    if before is not None:
                        self.gaps[cam] = max(self.gaps[cam], at - before[1])
                    self.seen[cam] = (dev, at)
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
