"""Prometheus metrics: one ``CollectorRegistry`` per controller (no process globals).

Controller series are fed by the ingest worker's ``on_stored`` hook (lag, DB write time) or read at
scrape time (message counters, queue depth, devices by status, rollouts by state). Fleet series come
from the last heartbeat of each device, so they are as fresh as the devices' health.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.db.states import DeviceStatus, RolloutState
from controller.db.tables import Device
from controller.link.ingest import StoredBatch
from controller.observe.energy import latest_per_device
from fleet_protocol.messages import DetectionBatch

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from controller.link.bridge import MqttBridge
    from controller.link.ingest import IngestService

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
DB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ROLLOUT_TABLES = ("rollout", "rollouts")
ROLLOUT_STATES = tuple(st.value for st in RolloutState)  # every state gets a series, 0 when none


@dataclass(frozen=True)
class Sources:
    """What the collector reads at scrape time: the link counters, the ingest queue, the database."""

    bridge: MqttBridge
    ingest: IngestService
    engine: Engine
    ingest_queue_max: int


class _SourcesCollector(Collector):
    def __init__(self, sources: Callable[[], Sources | None]) -> None:
        self._rt = sources

    def collect(self) -> Iterator[Metric]:
        rt = self._rt()
        if rt is None:
            return
        msgs = CounterMetricFamily(
            "edgefleet_mqtt_messages",
            "MQTT messages received by topic kind and outcome",
            labels=["kind", "outcome"],
        )
        for kind, outcomes in rt.bridge.counters.snapshot().items():
            for outcome, n in outcomes.items():
                msgs.add_metric([kind, outcome], n)
        yield msgs
        q = GaugeMetricFamily("edgefleet_ingest_queue_depth", "Messages waiting for the ingest writer")
        q.add_metric([], rt.ingest.queue_depth)
        yield q
        qmax = GaugeMetricFamily("edgefleet_ingest_queue_max", "Capacity of the ingest queue")
        qmax.add_metric([], rt.ingest_queue_max)
        yield qmax
        mq = GaugeMetricFamily("edgefleet_mqtt_connected", "1 when the controller is connected to the broker")
        mq.add_metric([], 1.0 if rt.bridge.connected else 0.0)
        yield mq
        try:
            yield from self._from_db(rt)
        except Exception as exc:
            log.warning("metrics from the database failed: %s", exc)

    def _from_db(self, rt: Sources) -> Iterator[Metric]:
        t = Device.__table__  # type: ignore[attr-defined]
        with rt.engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.id, t.c.status, t.c.last_health)).all()
            rollouts = _rollouts(conn)
        devices = GaugeMetricFamily("edgefleet_devices", "Devices by status", labels=["status"])
        counts = {st.value: 0 for st in DeviceStatus}  # online, offline: plain strings as label values
        for _id, st, _h in rows:
            counts[(DeviceStatus.ONLINE if st == DeviceStatus.ONLINE else DeviceStatus.OFFLINE).value] += 1
        for st, n in counts.items():
            devices.add_metric([st], n)
        yield devices
        if rollouts is not None:
            ro = GaugeMetricFamily("edgefleet_rollouts", "Rollouts by state", labels=["state"])
            for st, n in sorted({**dict.fromkeys(ROLLOUT_STATES, 0), **rollouts}.items()):
                ro.add_metric([st], n)
            yield ro

        fps = GaugeMetricFamily(
            "edgefleet_camera_fps", "Frames per second processed", labels=["device", "camera"]
        )
        frames = CounterMetricFamily(
            "edgefleet_camera_frames", "Frames processed since the agent started", labels=["device", "camera"]
        )
        dropped = CounterMetricFamily(
            "edgefleet_camera_dropped_frames",
            "Frames dropped by the latest-frame capture since the agent started",
            labels=["device", "camera"],
        )
        up = GaugeMetricFamily("edgefleet_camera_up", "1 when the camera is up", labels=["device", "camera"])
        infer = GaugeMetricFamily(
            "edgefleet_inference_latency_seconds",
            "Inference latency of the model running now, median of its last 50 inferences",
            labels=["device", "camera"],
        )
        infer_p99 = GaugeMetricFamily(
            "edgefleet_inference_latency_p99_seconds",
            "Inference latency of the model running now, p99 of its last 200 inferences "
            "(absent: the agent does not report it)",
            labels=["device", "camera"],
        )
        gtemp = GaugeMetricFamily(
            "edgefleet_gpu_temperature_celsius", "GPU temperature", labels=["device", "gpu"]
        )
        gpow = GaugeMetricFamily("edgefleet_gpu_power_watts", "GPU board power", labels=["device", "gpu"])
        gutil = GaugeMetricFamily(
            "edgefleet_gpu_utilization_ratio", "GPU utilisation 0..1", labels=["device", "gpu"]
        )
        cpu = GaugeMetricFamily("edgefleet_device_cpu_ratio", "CPU utilisation 0..1", labels=["device"])
        mem = GaugeMetricFamily("edgefleet_device_memory_ratio", "Memory in use 0..1", labels=["device"])
        jpf = GaugeMetricFamily(
            "edgefleet_device_energy_joules_per_frame",
            "Measured energy per processed frame over the last heartbeat interval (absent: not measured)",
            labels=["device"],
        )
        online_ids: list[str] = []
        for dev_id, st, health in rows:
            if st == DeviceStatus.ONLINE:
                online_ids.append(dev_id)
            if not isinstance(health, dict):
                continue
            for c in health.get("cameras") or []:
                if not isinstance(c, dict) or not isinstance(c.get("camera"), str):
                    continue
                lbl = [dev_id, c["camera"]]
                _add(fps, lbl, c.get("fps"))
                _add(frames, lbl, c.get("frames"))
                _add(dropped, lbl, c.get("dropped"))
                up.add_metric(lbl, 1.0 if c.get("state") == "up" else 0.0)
                _add(infer, lbl, _seconds(c.get("inference_ms")))
                _add(infer_p99, lbl, _seconds(c.get("inference_p99_ms")))
            for g in health.get("gpus") or []:
                if not isinstance(g, dict):
                    continue
                lbl = [dev_id, str(g.get("index", "?"))]
                _add(gtemp, lbl, g.get("temperature_c"))
                _add(gpow, lbl, g.get("power_w"))
                u = g.get("utilization_pct")
                _add(gutil, lbl, u / 100.0 if isinstance(u, int | float) else None)
            c_pct, m_pct = health.get("cpu_pct"), health.get("memory_pct")
            _add(cpu, [dev_id], c_pct / 100.0 if isinstance(c_pct, int | float) else None)
            _add(mem, [dev_id], m_pct / 100.0 if isinstance(m_pct, int | float) else None)
        for dev_id, e in latest_per_device(rt.engine, online_ids).items():
            _add(jpf, [dev_id], e.joules_per_frame)
        yield from (fps, frames, dropped, up, infer, infer_p99, gtemp, gpow, gutil, cpu, mem, jpf)


def _add(metric: GaugeMetricFamily | CounterMetricFamily, labels: list[str], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    metric.add_metric(labels, float(value))


def _seconds(ms: Any) -> float | None:
    return ms / 1000.0 if isinstance(ms, int | float) and not isinstance(ms, bool) else None


def _rollouts(conn: sa.Connection) -> dict[str, int] | None:
    """Rollouts by state, when a rollout table exists (None: rollouts not part of this schema)."""
    names = set(sa.inspect(conn).get_table_names())
    for name in ROLLOUT_TABLES:
        if name in names:
            cols = {c["name"] for c in sa.inspect(conn).get_columns(name)}
            col = "state" if "state" in cols else "status" if "status" in cols else None
            if col is None:
                return None
            t = sa.table(name, sa.column(col))
            rows = conn.execute(sa.select(t.c[col], sa.func.count()).group_by(t.c[col])).all()
            return {str(s): int(n) for s, n in rows}
    return None


class ControllerMetrics:
    """The registry of one controller, with the histograms the ingest hook feeds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._sources: Sources | None = None
        self.ingest_lag = Histogram(
            "edgefleet_ingest_lag_seconds",
            "From a frame's capture on the device to its detections being stored",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.db_write = Histogram(
            "edgefleet_db_write_seconds",
            "Time to write one ingest batch to the database",
            buckets=DB_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_SourcesCollector(lambda: self._sources))

    def bind(
        self, *, bridge: MqttBridge, ingest: IngestService, engine: Engine, ingest_queue_max: int
    ) -> None:
        """Start reading these at each scrape (before binding, only the histograms are exposed)."""
        self._sources = Sources(
            bridge=bridge, ingest=ingest, engine=engine, ingest_queue_max=ingest_queue_max
        )

    def on_stored(self, stored: StoredBatch) -> None:
        if not stored.messages:
            return
        self.db_write.observe(stored.write_s)
        now = stored.stored_at.timestamp()
        for _dev, msg in stored.messages:
            if isinstance(msg, DetectionBatch):
                for fr in msg.frames:
                    self.ingest_lag.observe(max(0.0, now - fr.captured_at))

    def render(self) -> bytes:
        return generate_latest(self.registry)
