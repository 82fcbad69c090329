"""Energy per device and for the fleet, from the heartbeat history.

Sources, per interval between two consecutive heartbeats of a device:
- GPU: NVML board power of every GPU (``gpus[].power_w``), trapezoid over the interval;
- CPU: the RAPL package energy counter (``cpu_energy_j``, cumulative joules), its delta.

Frames are the delta of the per-camera ``frames`` counters. Joules per frame = measured energy / frames
over the intervals where energy was measured. A device without any sensor reports ``None`` ("not
measured"), never an estimate. Intervals longer than ``max_gap_s`` (device down) or with counters that
went backwards (agent restart) are skipped, not interpolated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from controller.db.tables import HealthSample

MAX_GAP_S = 120.0
MAX_ROWS = 500_000


@dataclass
class IntervalEnergy:
    end_ts: float
    seconds: float
    frames: int
    gpu_j: float | None
    cpu_j: float | None

    @property
    def energy_j(self) -> float | None:
        parts = [p for p in (self.gpu_j, self.cpu_j) if p is not None]
        return sum(parts) if parts else None


@dataclass
class DeviceEnergy:
    device: str
    frames: int = 0
    seconds: float = 0.0
    gpu_j: float | None = None
    cpu_j: float | None = None
    measured_frames: int = 0
    measured_seconds: float = 0.0
    intervals: list[IntervalEnergy] = field(default_factory=list)

    @property
    def sources(self) -> list[str]:
        return [n for n, v in (("gpu_nvml", self.gpu_j), ("cpu_rapl", self.cpu_j)) if v is not None]

    @property
    def energy_j(self) -> float | None:
        parts = [p for p in (self.gpu_j, self.cpu_j) if p is not None]
        return sum(parts) if parts else None

    @property
    def joules_per_frame(self) -> float | None:
        e = self.energy_j
        if e is None or self.measured_frames <= 0:
            return None
        return e / self.measured_frames

    @property
    def avg_power_w(self) -> float | None:
        e = self.energy_j
        if e is None or self.measured_seconds <= 0:
            return None
        return e / self.measured_seconds

    def public(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "measured": bool(self.sources),
            "sources": self.sources,
            "energy_j": _r(self.energy_j),
            "gpu_j": _r(self.gpu_j),
            "cpu_j": _r(self.cpu_j),
            "frames": self.frames,
            "measured_frames": self.measured_frames,
            "seconds": round(self.seconds, 3),
            "joules_per_frame": _r(self.joules_per_frame, 6),
            "avg_power_w": _r(self.avg_power_w),
        }


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _frames(payload: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in payload.get("cameras") or []:
        if isinstance(c, dict) and isinstance(c.get("camera"), str) and isinstance(c.get("frames"), int):
            out[c["camera"]] = c["frames"]
    return out


def _gpu_power(payload: dict[str, Any]) -> dict[int, float] | None:
    """Power per GPU index, or None when there is no GPU or any GPU lacks a power reading."""
    gpus = payload.get("gpus") or []
    if not gpus:
        return None
    out: dict[int, float] = {}
    for g in gpus:
        p = _num(g.get("power_w")) if isinstance(g, dict) else None
        if p is None or not isinstance(g.get("index"), int):
            return None
        out[g["index"]] = p
    return out


def interval(a: dict[str, Any], b: dict[str, Any], *, max_gap_s: float = MAX_GAP_S) -> IntervalEnergy | None:
    """The energy and frames between two consecutive heartbeat payloads, or None if not comparable."""
    ta, tb = _num(a.get("ts")), _num(b.get("ts"))
    if ta is None or tb is None:
        return None
    dt = tb - ta
    if dt <= 0 or dt > max_gap_s:
        return None
    fa, fb = _frames(a), _frames(b)
    frames = 0
    for cam, n in fb.items():
        if cam in fa:
            d = n - fa[cam]
            if d < 0:  # counters restarted: the interval is not comparable
                return None
            frames += d
    gpu_j: float | None = None
    pa, pb = _gpu_power(a), _gpu_power(b)
    if pa is not None and pb is not None and pa.keys() == pb.keys():
        gpu_j = sum((pa[i] + pb[i]) / 2.0 * dt for i in pb)
    cpu_j: float | None = None
    ea, eb = _num(a.get("cpu_energy_j")), _num(b.get("cpu_energy_j"))
    if ea is not None and eb is not None and eb >= ea:
        cpu_j = eb - ea
    return IntervalEnergy(end_ts=tb, seconds=dt, frames=frames, gpu_j=gpu_j, cpu_j=cpu_j)


def device_energy(
    device: str, payloads: Iterable[dict[str, Any]], *, max_gap_s: float = MAX_GAP_S
) -> DeviceEnergy:
    """Sum over consecutive heartbeats (oldest first) of one device."""
    out = DeviceEnergy(device=device)
    prev: dict[str, Any] | None = None
    for p in payloads:
        if prev is not None:
            iv = interval(prev, p, max_gap_s=max_gap_s)
            if iv is not None:
                out.intervals.append(iv)
                out.frames += iv.frames
                out.seconds += iv.seconds
                if iv.gpu_j is not None:
                    out.gpu_j = (out.gpu_j or 0.0) + iv.gpu_j
                if iv.cpu_j is not None:
                    out.cpu_j = (out.cpu_j or 0.0) + iv.cpu_j
                if iv.energy_j is not None:
                    out.measured_frames += iv.frames
                    out.measured_seconds += iv.seconds
        prev = p
    return out


def fleet_summary(devices: Sequence[DeviceEnergy], *, bucket_s: int) -> dict[str, Any]:
    measured = [d for d in devices if d.energy_j is not None]
    energy = sum(d.energy_j or 0.0 for d in measured) if measured else None
    mframes = sum(d.measured_frames for d in measured)
    buckets: dict[int, dict[str, float]] = {}
    for d in devices:
        for iv in d.intervals:
            start = int(iv.end_ts // bucket_s * bucket_s)
            b = buckets.setdefault(start, {"energy_j": 0.0, "frames": 0.0, "measured": 0.0})
            b["frames"] += iv.frames
            if iv.energy_j is not None:
                b["energy_j"] += iv.energy_j
                b["measured"] = 1.0
    series = [
        {
            "start": datetime.fromtimestamp(start, UTC).isoformat(),
            "energy_j": round(v["energy_j"], 3) if v["measured"] else None,
            "frames": int(v["frames"]),
        }
        for start, v in sorted(buckets.items())
    ]
    return {
        "energy_j": _r(energy),
        "frames": sum(d.frames for d in devices),
        "measured_frames": mframes,
        "joules_per_frame": _r(energy / mframes, 6) if energy is not None and mframes > 0 else None,
        "devices_measured": len(measured),
        "devices_not_measured": len(devices) - len(measured),
        "series": series,
    }


def load_payloads(
    engine: Engine, *, since: datetime, until: datetime, device: str | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Heartbeat payloads per device in ``[since, until)``, oldest first (at most ``MAX_ROWS``)."""
    t = HealthSample.__table__  # type: ignore[attr-defined]
    q = sa.select(t.c.device_id, t.c.payload).where(t.c.ts >= since, t.c.ts < until)
    if device is not None:
        q = q.where(t.c.device_id == device)
    q = q.order_by(t.c.device_id, t.c.ts).limit(MAX_ROWS)
    out: dict[str, list[dict[str, Any]]] = {}
    with engine.connect() as conn:
        for dev, payload in conn.execute(q):
            if isinstance(payload, dict):
                out.setdefault(dev, []).append(payload)
    return out


def latest_per_device(engine: Engine, device_ids: Iterable[str]) -> dict[str, DeviceEnergy]:
    """Energy over each device's last two heartbeats (the current joules per frame)."""
    t = HealthSample.__table__  # type: ignore[attr-defined]
    out: dict[str, DeviceEnergy] = {}
    with engine.connect() as conn:
        for dev in device_ids:
            rows = conn.execute(
                sa.select(t.c.payload).where(t.c.device_id == dev).order_by(t.c.ts.desc()).limit(2)
            ).all()
            payloads = [r[0] for r in reversed(rows) if isinstance(r[0], dict)]
            out[dev] = device_energy(dev, payloads)
    return out
