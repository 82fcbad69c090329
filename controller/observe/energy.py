"""Energy per device and for the fleet, from the heartbeat history.

Sources, per interval between two consecutive heartbeats of a device:
- GPU: NVML board power of every GPU (``gpus[].power_w``), trapezoid over the interval;
- CPU: the RAPL package energy counter (``cpu_energy_j``, cumulative joules), its delta.

Frames are the delta of the per-camera ``frames`` counters. Joules per frame = measured energy / frames
over the intervals where energy was measured. A device without any sensor reports ``None`` ("not
measured"), never an estimate. Intervals longer than ``max_gap_s`` (device down) or with counters that
went backwards (agent restart) are skipped, not interpolated.

A window is read one device at a time, from a bounded sample: at most ``MAX_SAMPLES`` heartbeats per
device, the first of each equal slice of the window (the cumulative counters make the sum over a
thinned sample the same frames and CPU joules; GPU power is integrated over the longer steps). The cost
of a call is then bounded by the fleet's size, never by how many heartbeats a device sent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from controller.db.tables import HealthSample

MAX_GAP_S = 120.0
MAX_SAMPLES = 720  # heartbeats read per device and window (one per 5 s over an hour)


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


def _slice(engine: Engine, column: Any, step: int) -> Any:
    """The index of ``column``'s ``step``-second slice (an integer)."""
    if engine.dialect.name == "sqlite":
        return sa.cast(sa.func.strftime("%s", column), sa.BigInteger).op("/")(sa.literal(step, sa.BigInteger))
    return sa.cast(sa.func.floor(sa.extract("epoch", column) / step), sa.BigInteger)


def sampled_payloads(
    engine: Engine, *, device: str, since: datetime, until: datetime, max_samples: int = MAX_SAMPLES
) -> tuple[list[dict[str, Any]], int]:
    """One device's heartbeat payloads in ``[since, until)``, oldest first: the first of each of at
    most ``max_samples`` equal slices of the window and the window's last; and the slice length in
    seconds."""
    t = HealthSample.__table__  # type: ignore[attr-defined]
    step = max(1, math.ceil((until - since).total_seconds() / max_samples))
    firsts = (
        sa.select(sa.func.min(t.c.id))
        .where(t.c.device_id == device, t.c.ts >= since, t.c.ts < until)
        .group_by(_slice(engine, t.c.ts, step))
    )
    # And the window's last one: the sample reaches the end of the window, whatever the slice length.
    last = sa.select(sa.func.max(t.c.id)).where(t.c.device_id == device, t.c.ts >= since, t.c.ts < until)
    q = (
        sa.select(t.c.payload)
        .where(sa.or_(t.c.id.in_(firsts), t.c.id == last.scalar_subquery()))
        .order_by(t.c.ts, t.c.id)
        .limit(max_samples + 2)
    )
    with engine.connect() as conn:
        return [p for (p,) in conn.execute(q) if isinstance(p, dict)], step


def window_energy(
    engine: Engine, *, device_ids: Iterable[str], since: datetime, until: datetime, device: str | None = None
) -> list[DeviceEnergy]:
    """Every device's energy in ``[since, until)`` (``device``: that one only), from bounded samples,
    one device in memory at a time; ``device_ids``: the known devices (each listed, measured or not)."""
    t = HealthSample.__table__  # type: ignore[attr-defined]
    q = sa.select(t.c.device_id).where(t.c.ts >= since, t.c.ts < until).distinct()
    if device is not None:
        q = q.where(t.c.device_id == device)
    with engine.connect() as conn:
        sending = {str(d) for (d,) in conn.execute(q)}
    out: list[DeviceEnergy] = []
    for dev in sorted(set(device_ids) | sending):
        if dev not in sending:
            out.append(DeviceEnergy(device=dev))
            continue
        payloads, step = sampled_payloads(engine, device=dev, since=since, until=until)
        out.append(device_energy(dev, payloads, max_gap_s=MAX_GAP_S + step))
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
