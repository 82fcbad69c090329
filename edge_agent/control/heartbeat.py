"""The heartbeat: the device's health every ``heartbeat_interval_s``, at QoS 0.

:func:`build_heartbeat` is a plain function of the figures (system, per-camera stats, queue counters),
so what a heartbeat says is tested without a pipeline. :class:`HeartbeatSender` gathers the figures and
publishes on the heartbeat thread. A heartbeat is not kept when the link is down: the next one says
the same more recently, and what must not be lost goes through the outbox instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from edge_agent.device.health import Health
from edge_agent.uplink.outbox import Outbox
from edge_agent.uplink.publisher import PublishFn
from edge_agent.vision.pipeline import Pipeline
from fleet_protocol.codec import encode
from fleet_protocol.messages import CameraStats, Heartbeat
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)


def build_heartbeat(
    sysinfo: Mapping[str, Any],
    cameras: Sequence[CameraStats],
    *,
    outbox_pending: int,
    outbox_dropped: int,
    queue_dropped: int,
) -> Heartbeat:
    """The device-wide inference figures are the slowest camera's, so one slow camera is not averaged
    away."""
    ms = [c.inference_ms for c in cameras if c.inference_ms is not None]
    p99 = [c.inference_p99_ms for c in cameras if c.inference_p99_ms is not None]
    return Heartbeat(
        ts=time.time(),
        uptime_s=sysinfo.get("uptime_s", 0.0),
        cpu_pct=sysinfo.get("cpu_pct"),
        memory_pct=sysinfo.get("memory_pct"),
        memory_used_mb=sysinfo.get("memory_used_mb"),
        disk_free_mb=sysinfo.get("disk_free_mb"),
        disk_pct=sysinfo.get("disk_pct"),
        gpus=sysinfo.get("gpus", []),
        cameras=list(cameras),
        inference_ms=round(max(ms), 2) if ms else None,
        cpu_energy_j=sysinfo.get("cpu_energy_j"),
        outbox_pending=outbox_pending,
        outbox_dropped=outbox_dropped,
        queue_dropped=queue_dropped,
        inference_p99_ms=round(max(p99), 2) if p99 else None,
    )


class HeartbeatSender:
    """Builds a heartbeat from the live parts and publishes one every ``interval_s``."""

    def __init__(
        self,
        *,
        health: Health,
        pipeline: Pipeline,
        outbox: Outbox,
        publish: PublishFn,
        interval_s: float,
        stop: threading.Event,
    ) -> None:
        self.health = health
        self.pipeline = pipeline
        self.outbox = outbox
        self._publish = publish
        self.interval_s = interval_s
        self._stop = stop

    def heartbeat(self) -> Heartbeat:
        return build_heartbeat(
            self.health.system(),
            self.pipeline.stats(),
            outbox_pending=self.outbox.pending(),
            outbox_dropped=self.outbox.dropped,
            queue_dropped=self.pipeline.out.dropped,
        )

    def run(self) -> None:
        """The heartbeat thread, until the stop event is set."""
        while not self._stop.wait(self.interval_s):
            try:
                self._publish(TopicKind.HEARTBEAT, encode(self.heartbeat()))
            except Exception:
                log.exception("heartbeat failed")
