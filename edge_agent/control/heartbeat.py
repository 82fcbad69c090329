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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from edge_agent.device.health import Health
from edge_agent.uplink.outbox import Outbox
from edge_agent.uplink.publisher import PublishFn
from edge_agent.vision.pipeline import Pipeline, VariantFigures
from fleet_protocol.codec import encode
from fleet_protocol.messages import CameraStats, Heartbeat, VariantCost
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)


def build_heartbeat(
    sysinfo: Mapping[str, Any],
    cameras: Sequence[CameraStats],
    *,
    outbox_pending: int,
    outbox_dropped: int,
    queue_dropped: int,
    costs: Sequence[VariantCost] = (),
    reach: Mapping[str, bool] | None = None,
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
        costs=list(costs),
        reach=dict(reach or {}),
    )


class LaneShares:
    """Each variant's share of its inference lanes between two calls, from the cumulative lane time
    the pipeline keeps per variant (so that another reader of the figures cannot shorten the
    heartbeat's interval)."""

    def __init__(self) -> None:
        self._at: float | None = None
        self._lane_ms: dict[str, float] = {}

    def shares(self, figures: Sequence[VariantFigures], now: float) -> dict[str, float]:
        """Busy share (0..1) of each variant's lanes since the last call (``figures``: every variant
        that runs, measured or not; ``now``: time.monotonic()); nothing on the first call. A variant
        that did not run at the last call counts from 0 (``Pipeline.variant_costs`` starts it there);
        one whose count went back (read elsewhere meanwhile, while it did not run) has none."""
        before, at = self._lane_ms, self._at
        self._lane_ms = {f.variant: f.lane_ms for f in figures}
        self._at = now
        if at is None or now <= at:
            return {}
        out = {}
        for f in figures:
            prev = before.get(f.variant, 0.0)
            if f.lane_ms >= prev:
                capacity_ms = (now - at) * 1000.0 * max(1, f.lanes)
                # A run is counted when it ends, so one begun before the interval can push it over 1.
                out[f.variant] = round(min(1.0, (f.lane_ms - prev) / capacity_ms), 4)
        return out


def variant_costs(figures: Sequence[VariantFigures], busy: Mapping[str, float]) -> list[VariantCost]:
    """The heartbeat's costs: the variants that have run a frame (a figure of none would read as free)."""
    return [
        VariantCost(
            variant=f.variant,
            infer_ms=round(f.infer_ms, 3),
            cpu_ms=round(f.cpu_ms, 3),
            busy=busy.get(f.variant),
            frames=f.frames,
        )
        for f in figures
        if f.frames
    ]


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
        reach: Callable[[], Mapping[str, bool]] | None = None,
    ) -> None:
        """``reach``: the outcome of the probes of pool camera sources
        (:meth:`~edge_agent.control.reach.ReachProbes.reach`); None: nothing is probed."""
        self.health = health
        self.pipeline = pipeline
        self.outbox = outbox
        self._publish = publish
        self.interval_s = interval_s
        self._stop = stop
        self._lanes = LaneShares()
        self._reach = reach

    def heartbeat(self) -> Heartbeat:
        figures = self.pipeline.variant_costs()
        busy = self._lanes.shares(figures, time.monotonic())
        return build_heartbeat(
            self.health.system(),
            self.pipeline.stats(),
            outbox_pending=self.outbox.pending(),
            outbox_dropped=self.outbox.dropped,
            queue_dropped=self.pipeline.out.dropped,
            costs=variant_costs(figures, busy),
            reach=self._reach() if self._reach is not None else None,
        )

    def run(self) -> None:
        """The heartbeat thread, until the stop event is set."""
        while not self._stop.wait(self.interval_s):
            try:
                self._publish(TopicKind.HEARTBEAT, encode(self.heartbeat()))
            except Exception:
                log.exception("heartbeat failed")
