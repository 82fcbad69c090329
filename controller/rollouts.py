"""Rollouts: waves of devices, each wave's health gate, automatic rollback; restart-safe.

``step`` is a pure decision function over a snapshot (the rollout, its members, the devices) and
the time; ``RolloutService`` loads the snapshot from the database, applies the actions in one
transaction and has the twin recompute the desired state of every device they touch. Everything
lives in the database, so a controller killed mid-rollout continues where it was after a restart.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller import crud
from controller.deployments import get_deployment, matching_devices, rollout_devices, rollout_of
from controller.models import Deployment, Device, Event, HealthSample, Rollout, RolloutDevice, utcnow
from controller.selectors import SelectorError, parse_selector
from controller.twin import AUTO, ConflictError, NotFoundError, TwinService, choose
from fleet_protocol.messages import EventKind

log = logging.getLogger(__name__)

DEFAULT_WAVES: list[int | str] = [1, "10%", "50%", "100%"]
TICK_S = 1.0
RUNNING, PAUSED = "running", "paused"
CRASH_LOOP_RESTARTS = 3  # more restarts than this since admission is a crash loop
FINISHED = ("succeeded", "failed", "cancelled", "rolled_back")
# The agent's watchdog actions (edge_agent/watchdog.py WatchdogAction) the gate counts; "retry",
# "recovered" and "command" (an operator's restart) are not signs of a bad model.
WATCHDOG_RESTARTED, WATCHDOG_FAILED = "restarted", "failed"
_IN_CHUNK = 500  # device ids per IN (...) list: far below every driver's parameter limit


class GateConfig(BaseModel):
    soak_s: float = Field(default=30.0, ge=0)
    max_failure_ratio: float = Field(default=0.0, ge=0, le=1)
    min_fps_ratio: float = Field(default=0.5, ge=0)
    max_latency_ms: float | None = Field(default=None, gt=0)
    # Inference latency after / before on the same device, at most: "far slower than its predecessor"
    # holds on any hardware, where an absolute bound needs to know the device.
    max_latency_ratio: float | None = Field(default=None, gt=0)
    # Inference watchdog restarts (a hung run abandoned, the model reloaded) of the new model on one
    # device, at most, counted from its admission. 0 by default: a brand-new model whose inference
    # hangs even once during its soak is not promoted, since a hang on the canary is a bad sign
    # whatever the FPS and latency figures say (a hung run reports neither). A watchdog "failed"
    # step (the agent ran out of restarts) fails the gate whatever this says.
    max_watchdog_restarts: int = Field(default=0, ge=0)
    step_timeout_s: float = Field(default=300.0, gt=0)
    offline_timeout_s: float = Field(default=60.0, ge=0)


# --------------------------------------------------------------------------- waves


def parse_wave(spec: int | str) -> int | str:
    """A wave as asked: a device count (cumulative, >= 1) or a percentage of the matching devices."""
    if isinstance(spec, bool):
        raise ValueError(f"wave {spec!r} is not a count or a percentage")
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"wave {spec} must be at least 1 device")
        return spec
    text = str(spec).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ValueError(f"wave {spec!r} is not a percentage") from None
        if not 0 < pct <= 100:
            raise ValueError(f"wave {spec!r} must be above 0% and at most 100%")
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"wave {spec!r} is not a device count (>= 1) or a percentage like 10%")


def plan_waves(waves: Sequence[int | str], n: int) -> list[int]:
    """Cumulative device counts per wave for ``n`` matching devices; each wave at least one device,
    empty waves dropped."""
    out: list[int] = []
    prev = 0
    for spec in waves:
        if prev >= n:
            break
        if isinstance(spec, str) and spec.endswith("%"):
            target = math.ceil(float(spec[:-1]) / 100.0 * n)
        else:
            target = int(spec)
        cum = min(n, max(prev + 1, target))
        out.append(cum)
        prev = cum
    return out


# --------------------------------------------------------------------------- the decision function


@dataclass(frozen=True)
class WatchdogStep:
    """One ``watchdog_restart`` event of a device, as the gate judges it."""

    # When the controller stored it: its own clock, like admission and activation (an agent's
    # clock may be off by any amount).
    at: float
    action: str  # restarted | failed | retry | recovered | command
    reason: str = ""
    model: str | None = None  # "name:version" of the model whose run hung; None: not known


@dataclass(frozen=True)
class DeviceView:
    id: str
    matches: bool = True
    online: bool = True
    offline_since: float | None = None
    reported_version: int | None = None
    reported: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # camera → CameraReported
    fps: Mapping[str, float] = field(default_factory=dict)  # camera → fps, latest heartbeat
    # camera → the inference latency the gate judges: p99 where the agent reports it, else the median
    latency_ms: Mapping[str, float] = field(default_factory=dict)
    latency_stat: str = "median"  # "p99" when every latency above is a p99
    restarts: tuple[float, ...] = ()  # when the agent came back up with a fresh uptime
    watchdog: tuple[WatchdogStep, ...] = ()  # the inference watchdog's steps, oldest first


@dataclass(frozen=True)
class MemberView:
    device_id: str
    wave: int
    state: str
    admitted_at: float
    cameras: tuple[str, ...] = ()
    target_version: int | None = None
    baseline_fps: float | None = None
    settled_at: float | None = None
    reason: str | None = None
    baseline_latency_ms: float | None = None


@dataclass(frozen=True)
class RolloutView:
    state: str
    model: str  # "name:version", as the agent reports it
    plan: tuple[int, ...]
    current_wave: int
    gate: GateConfig
    members: Mapping[str, MemberView]
    gated_waves: frozenset[int] = frozenset()
    admit_all_in_last: bool = True


@dataclass(frozen=True)
class Admit:
    device_id: str
    wave: int


@dataclass(frozen=True)
class Settle:
    device_id: str
    state: str  # active | failed
    reason: str | None = None


@dataclass(frozen=True)
class GateResult:
    wave: int
    passed: bool
    figures: dict[str, Any]
    reason: str


@dataclass(frozen=True)
class Advance:
    wave: int


@dataclass(frozen=True)
class Finish:
    state: str  # succeeded | failed
    reason: str


Action = Admit | Settle | GateResult | Advance | Finish


def _offline_for(dev: DeviceView, since: float, now: float) -> float:
    if dev.online:
        return 0.0
    return now - max(dev.offline_since or since, since)


def _crash_loop(m: MemberView, dev: DeviceView) -> Settle | None:
    n = sum(t >= m.admitted_at for t in dev.restarts)
    if n > CRASH_LOOP_RESTARTS:
        return Settle(m.device_id, "failed", f"crash loop: the agent restarted {n} times since admission")
    return None


def _settle_applying(m: MemberView, dev: DeviceView | None, r: RolloutView, now: float) -> Settle | None:
    if dev is None:
        return Settle(m.device_id, "failed", "device is no longer known")
    if (crash := _crash_loop(m, dev)) is not None:
        return crash
    if not dev.matches:
        return Settle(m.device_id, "failed", "device no longer matches the selector")
    if m.target_version is not None:
        if not m.cameras:
            return Settle(m.device_id, "active", "every camera is held by a higher-priority layer")
        for cam in m.cameras:
            rep = dev.reported.get(cam) or {}
            if rep.get("state") == "failed" and (dev.reported_version or 0) >= m.target_version:
                return Settle(
                    m.device_id, "failed", f"camera {cam} failed: {rep.get('error') or 'no reason'}"
                )
        if (dev.reported_version or 0) >= m.target_version and all(
            (dev.reported.get(c) or {}).get("state") == "running"
            and (dev.reported.get(c) or {}).get("model") == r.model
            for c in m.cameras
        ):
            return Settle(m.device_id, "active")
    off = _offline_for(dev, m.admitted_at, now)
    if not dev.online and off > r.gate.offline_timeout_s:
        return Settle(m.device_id, "failed", f"offline for {off:.0f}s (limit {r.gate.offline_timeout_s:g}s)")
    if now - m.admitted_at > r.gate.step_timeout_s:
        states = {c: (dev.reported.get(c) or {}).get("state", "unknown") for c in m.cameras}
        return Settle(
            m.device_id,
            "failed",
            f"not active after {r.gate.step_timeout_s:g}s (reported v{dev.reported_version}, {states})",
        )
    return None


def _settle_active(m: MemberView, dev: DeviceView | None, r: RolloutView, now: float) -> Settle | None:
    """A device of the wave being soaked that went bad after activation."""
    if dev is None:
        return Settle(m.device_id, "failed", "device is no longer known")
    if (crash := _crash_loop(m, dev)) is not None:
        return crash
    for cam in m.cameras:
        rep = dev.reported.get(cam) or {}
        if rep.get("state") == "failed":
            return Settle(m.device_id, "failed", f"camera {cam} failed: {rep.get('error') or 'no reason'}")
    off = _offline_for(dev, m.settled_at or m.admitted_at, now)
    if not dev.online and off > r.gate.offline_timeout_s:
        return Settle(m.device_id, "failed", f"offline for {off:.0f}s (limit {r.gate.offline_timeout_s:g}s)")
    return None


def _watchdog_steps(m: MemberView, dev: DeviceView, model: str) -> list[WatchdogStep]:
    """The watchdog steps that are the new model's doing on this device.

    A step naming the rollout's model counts from admission: this rollout put it there (steps of an
    earlier rollout of the same version are older), and a hang between the agent's activation and
    the tick that notices it is still its hang. A step naming no model counts from activation only (before it, the old model was running).
    Steps of other models (other deployments on other cameras) are not this rollout's.
    """
    since_activation = m.settled_at if m.settled_at is not None else m.admitted_at
    return [
        s
        for s in dev.watchdog
        if (s.model == model and s.at >= m.admitted_at) or (s.model is None and s.at >= since_activation)
    ]


def _watchdog_figures(m: MemberView, dev: DeviceView, model: str) -> dict[str, Any] | None:
    steps = _watchdog_steps(m, dev, model)
    restarts = [s for s in steps if s.action == WATCHDOG_RESTARTED]
    failures = [s for s in steps if s.action == WATCHDOG_FAILED]
    if not restarts and not failures:
        return None
    # The latest failure says most (it includes the restarts that led to it), else the latest restart.
    last = (failures or restarts)[-1]
    return {"restarts": len(restarts), "failures": len(failures), "reason": last.reason}


def _watchdog_verdict(fig: dict[str, Any], r: RolloutView) -> str | None:
    """Why the watchdog figures fail the gate, or None. Conclusive as soon as it is true: counts since
    admission only grow, so the gate need not wait for the soak to end."""
    limit = r.gate.max_watchdog_restarts
    bad: list[str] = []
    for d, wd in sorted((fig.get("watchdog") or {}).items()):
        reason = str(wd.get("reason") or "no reason")[:300]
        n = wd["restarts"]
        restarts = f"{n} restart" + ("" if n == 1 else "s")
        if wd["failures"]:
            bad.append(f"{d} failed after {restarts}: {reason}")
        elif n > limit:
            bad.append(f"{d} {restarts}: {reason}")
    if not bad:
        return None
    return f"inference watchdog (at most {limit} restarts, no failure): " + "; ".join(bad)


def _figures(wave: list[MemberView], devices: Mapping[str, DeviceView], r: RolloutView) -> dict[str, Any]:
    failed = [m.device_id for m in wave if m.state == "failed"]
    ratios: dict[str, float] = {}
    latencies: dict[str, float] = {}
    latency_stats: dict[str, str] = {}
    latency_ratios: dict[str, float] = {}
    watchdog: dict[str, dict[str, Any]] = {}
    for m in wave:
        dev = devices.get(m.device_id)
        if m.state != "active" or dev is None or not m.cameras:
            continue
        if (wd := _watchdog_figures(m, dev, r.model)) is not None:
            watchdog[m.device_id] = wd
        fps = [dev.fps[c] for c in m.cameras if c in dev.fps]
        if fps and m.baseline_fps:
            ratios[m.device_id] = round(min(fps) / m.baseline_fps, 3)
        lat = [dev.latency_ms[c] for c in m.cameras if c in dev.latency_ms]
        if lat:
            latencies[m.device_id] = round(max(lat), 2)
            latency_stats[m.device_id] = dev.latency_stat
            if m.baseline_latency_ms:
                latency_ratios[m.device_id] = round(max(lat) / m.baseline_latency_ms, 3)
    return {
        "devices": [m.device_id for m in wave],
        "size": len(wave),
        "active": sum(m.state == "active" for m in wave),
        "failed": failed,
        "failures": {m.device_id: m.reason for m in wave if m.state == "failed"},
        "failure_ratio": round(len(failed) / len(wave), 3) if wave else 0.0,
        "max_failure_ratio": r.gate.max_failure_ratio,
        "fps_ratio": ratios,
        "fps_ratio_min": min(ratios.values()) if ratios else None,
        "min_fps_ratio": r.gate.min_fps_ratio,
        "latency_ms": latencies,
        "latency_ms_max": max(latencies.values()) if latencies else None,
        "latency_stat": latency_stats,  # device → "p99" or "median" (an agent that reports no p99)
        "max_latency_ms": r.gate.max_latency_ms,
        "latency_ratio": latency_ratios,
        "latency_ratio_max": max(latency_ratios.values()) if latency_ratios else None,
        "max_latency_ratio": r.gate.max_latency_ratio,
        # device → {"restarts", "failures", "reason"}: only devices whose new model the watchdog touched
        "watchdog": watchdog,
        "max_watchdog_restarts": r.gate.max_watchdog_restarts,
    }


def _verdict(fig: dict[str, Any], r: RolloutView) -> str | None:
    """Why the gate fails, or None when it passes."""
    if fig["failure_ratio"] > r.gate.max_failure_ratio:
        why = "; ".join(f"{d}: {reason or 'failed'}" for d, reason in sorted(fig["failures"].items()))
        return f"{len(fig['failed'])} of {fig['size']} devices failed ({why})"
    if (hung := _watchdog_verdict(fig, r)) is not None:
        return hung
    low = {d: v for d, v in fig["fps_ratio"].items() if v < r.gate.min_fps_ratio}
    if low:
        return "FPS fell below {:g} of the FPS before: {}".format(
            r.gate.min_fps_ratio, ", ".join(f"{d} {v:.2f}" for d, v in sorted(low.items()))
        )
    # Each figure names its statistic ("p99" unless the agent reports only a median) so the reason
    # says what was judged.
    stat: dict[str, str] = fig.get("latency_stat") or {}

    def ms(d: str) -> str:
        return f"{fig['latency_ms'][d]:.1f} ms" + (" p99" if stat.get(d) == "p99" else "")

    if r.gate.max_latency_ms is not None:
        slow = {d: v for d, v in fig["latency_ms"].items() if v > r.gate.max_latency_ms}
        if slow:
            return "inference latency over {:g} ms: {}".format(
                r.gate.max_latency_ms, ", ".join(f"{d} {ms(d)}" for d in sorted(slow))
            )
    if r.gate.max_latency_ratio is not None:
        slower = {d: v for d, v in fig["latency_ratio"].items() if v > r.gate.max_latency_ratio}
        if slower:
            return "inference latency rose above {:g}x the latency before: {}".format(
                r.gate.max_latency_ratio,
                ", ".join(f"{d} {v:.1f}x ({ms(d)})" for d, v in sorted(slower.items())),
            )
    return None


def step(r: RolloutView, devices: Mapping[str, DeviceView], now: float) -> list[Action]:
    """What to do next. Pure: the same snapshot and time give the same actions."""
    if r.state not in (RUNNING, PAUSED):
        return []
    actions: list[Action] = []
    members = dict(r.members)
    # 1. per device: activation, failure, timeouts, offline
    for m in r.members.values():
        dev = devices.get(m.device_id)
        s: Settle | None = None
        if m.state == "applying":
            s = _settle_applying(m, dev, r, now)
        elif m.state == "active" and m.wave == r.current_wave and r.current_wave not in r.gated_waves:
            s = _settle_active(m, dev, r, now)
        if s is not None:
            actions.append(s)
            members[m.device_id] = replace(m, state=s.state, settled_at=now, reason=s.reason)
    w = r.current_wave
    if w >= len(r.plan):
        return [*actions, Finish("succeeded", "every wave passed its gate")]
    wave = [m for m in members.values() if m.wave == w]
    # 2. admission of the current wave
    if not wave:
        if r.state != RUNNING:
            return actions
        last = w == len(r.plan) - 1
        want = r.plan[w] - len(members)
        candidates = sorted(d.id for d in devices.values() if d.matches and d.id not in members)
        if last and r.admit_all_in_last:
            want = len(candidates)
        admit = candidates[: max(0, want)]
        if not admit:
            if last:
                return [*actions, Finish("succeeded", "no devices left to admit")]
            return [*actions, Advance(w + 1)]
        return [*actions, *(Admit(d, w) for d in admit)]
    # 3. the gate of the current wave
    if w in r.gated_waves:
        return actions
    fig = _figures(wave, devices, r)
    # Both are final once true (failures and watchdog counts only grow): fail now, not after the soak.
    if fig["failure_ratio"] > r.gate.max_failure_ratio or _watchdog_verdict(fig, r) is not None:
        bad = _verdict(fig, r) or "too many failures"
        return [
            *actions,
            GateResult(w, False, fig, bad),
            Finish("failed", f"wave {w + 1} gate failed: {bad}"),
        ]
    if any(m.state == "applying" for m in wave):
        return actions
    settled = max((m.settled_at or m.admitted_at) for m in wave)
    if now - settled < r.gate.soak_s:
        return actions
    why = _verdict(fig, r)
    if why is not None:
        return [
            *actions,
            GateResult(w, False, fig, why),
            Finish("failed", f"wave {w + 1} gate failed: {why}"),
        ]
    actions.append(GateResult(w, True, fig, "passed"))
    if w == len(r.plan) - 1:
        actions.append(Finish("succeeded", "every wave passed its gate"))
    else:
        actions.append(Advance(w + 1))
    return actions


# --------------------------------------------------------------------------- the service


class DeploymentError(ValueError):
    """A deployment that cannot be created; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _ts(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


def restarts_since(s: Session, device_id: str, since: datetime) -> tuple[float, ...]:
    """Times at which the device's heartbeats show a fresh uptime (the agent started again)."""
    rows = s.exec(
        select(HealthSample.ts, HealthSample.payload)
        .where(col(HealthSample.device_id) == device_id, col(HealthSample.ts) >= since)
        .order_by(col(HealthSample.ts), col(HealthSample.id))
    ).all()
    out: list[float] = []
    prev: float | None = None
    for ts, payload in rows:
        up = (payload or {}).get("uptime_s")
        if up is None:
            continue
        if prev is not None and float(up) < prev:
            out.append(ts.timestamp())
        prev = float(up)
    return tuple(out)


def watchdog_steps_since(s: Session, since: Mapping[str, datetime]) -> dict[str, tuple[WatchdogStep, ...]]:
    """Per device, the inference watchdog's steps stored since the given time, oldest first."""
    out: dict[str, list[WatchdogStep]] = {d: [] for d in since}
    ids = sorted(since)
    for i in range(0, len(ids), _IN_CHUNK):
        chunk = ids[i : i + _IN_CHUNK]
        rows = s.exec(
            select(Event.device_id, Event.stored_at, Event.data)
            .where(
                col(Event.kind) == EventKind.WATCHDOG_RESTART.value,
                col(Event.device_id).in_(chunk),
                col(Event.stored_at) >= min(since[d] for d in chunk),
            )
            .order_by(col(Event.stored_at), col(Event.id))
        ).all()
        for device_id, stored_at, data in rows:
            if stored_at < since[device_id]:
                continue
            # The data is the agent's: take only well-typed values.
            d = data if isinstance(data, dict) else {}
            action, reason, model = d.get("action"), d.get("reason"), d.get("model")
            out[device_id].append(
                WatchdogStep(
                    at=stored_at.timestamp(),
                    action=action if isinstance(action, str) else "",
                    reason=reason if isinstance(reason, str) else "",
                    model=model if isinstance(model, str) and model else None,
                )
            )
    return {d: tuple(v) for d, v in out.items()}


def camera_latency(cam: Mapping[str, Any]) -> tuple[float, str] | None:
    """The latency a gate judges for one camera of a heartbeat, and which statistic it is: the p99
    where the agent reports it, else the median (agents before p99). None: nothing usable."""
    for key, stat in (("inference_p99_ms", "p99"), ("inference_ms", "median")):
        v = cam.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return float(v), stat
    return None


def device_view(
    dev: Device,
    dep: Deployment,
    restarts: tuple[float, ...] = (),
    watchdog: tuple[WatchdogStep, ...] = (),
) -> DeviceView:
    from controller.deployments import matches

    health = dev.last_health or {}
    fps: dict[str, float] = {}
    lat: dict[str, float] = {}
    stats: set[str] = set()
    for c in health.get("cameras") or []:
        cam = str(c.get("camera"))
        if c.get("fps") is not None:
            fps[cam] = float(c["fps"])
        if (found := camera_latency(c)) is not None:
            lat[cam], stat = found
            stats.add(stat)
    return DeviceView(
        id=dev.id,
        matches=matches(dep, dev.labels or {}),
        online=dev.status == "online",
        offline_since=_ts(dev.offline_since),
        reported_version=dev.reported_version,
        reported=dict((dev.reported or {}).get("cameras") or {}),
        fps=fps,
        latency_ms=lat,
        latency_stat="p99" if stats == {"p99"} else "median",
        restarts=restarts,
        watchdog=watchdog,
    )


def member_view(m: RolloutDevice) -> MemberView:
    return MemberView(
        device_id=m.device_id,
        wave=m.wave,
        state=m.state,
        admitted_at=_ts(m.admitted_at) or 0.0,
        cameras=tuple(m.cameras or ()),
        target_version=m.target_version,
        baseline_fps=m.baseline_fps,
        settled_at=_ts(m.settled_at),
        reason=m.reason,
        baseline_latency_ms=m.baseline_latency_ms,
    )


def rollout_view(ro: Rollout, dep: Deployment, members: Sequence[RolloutDevice]) -> RolloutView:
    waves = list(ro.waves or [])
    return RolloutView(
        state=ro.state,
        model=f"{dep.model}:{dep.version}",
        plan=tuple(ro.plan or ()),
        current_wave=ro.current_wave,
        gate=GateConfig.model_validate(ro.gate or {}),
        members={m.device_id: member_view(m) for m in members},
        gated_waves=frozenset(int(g["wave"]) for g in ro.gates or [] if g.get("passed")),
        admit_all_in_last=bool(waves) and str(waves[-1]).strip() == "100%",
    )


class RolloutService:
    """Creates deployments with their rollouts, drives them from a runner thread, and carries out
    the operator's pause/resume/cancel/rollback. One lock orders ticks and operator actions."""

    def __init__(self, engine: Engine, twin: TwinService, *, stop: threading.Event, tick_s: float = TICK_S):
        self._engine = engine
        self._twin = twin
        self._stop = stop
        self._tick_s = tick_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.clock: Callable[[], float] = time.time

    # ------------------------------------------------------------------ runner

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="edgefleet-rollouts", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("rollout tick failed")
            self._stop.wait(self._tick_s)

    def tick(self) -> None:
        with Session(self._engine) as s:
            ids = [
                int(i)
                for i in s.exec(select(Rollout.id).where(col(Rollout.state).in_((RUNNING, PAUSED)))).all()
                if i is not None
            ]
        for rid in ids:
            with self._lock:
                self._tick_one(rid)

    def _tick_one(self, rollout_id: int) -> None:
        self._fill_targets(rollout_id)
        touched: set[str] = set()
        now = self.clock()
        with Session(self._engine) as s:
            ro = s.get(Rollout, rollout_id)
            if ro is None or ro.state not in (RUNNING, PAUSED):
                return
            dep = s.get(Deployment, ro.deployment_id)
            assert dep is not None
            members = {m.device_id: m for m in rollout_devices(s, rollout_id)}
            watched = {
                m.device_id: m.admitted_at
                for m in members.values()
                if m.admitted_at is not None
                and (m.state == "applying" or (m.state == "active" and m.wave == ro.current_wave))
            }
            steps = watchdog_steps_since(s, watched)
            devices = {
                d.id: device_view(
                    d,
                    dep,
                    restarts_since(s, d.id, watched[d.id]) if d.id in watched else (),
                    steps.get(d.id, ()),
                )
                for d in crud.list_devices(s)
            }
            actions = step(rollout_view(ro, dep, list(members.values())), devices, now)
            if not actions:
                return
            at = datetime.fromtimestamp(now, UTC)
            for a in actions:
                if isinstance(a, Admit):
                    s.add(
                        RolloutDevice(
                            rollout_id=rollout_id, device_id=a.device_id, wave=a.wave, admitted_at=at
                        )
                    )
                    touched.add(a.device_id)
                    log.info("rollout %d: wave %d admits %s", rollout_id, a.wave + 1, a.device_id)
                elif isinstance(a, Settle):
                    m = members[a.device_id]
                    m.state, m.reason, m.settled_at = a.state, a.reason, at
                    s.add(m)
                    if a.state == "failed":
                        touched.add(a.device_id)
                        log.warning("rollout %d: %s failed: %s", rollout_id, a.device_id, a.reason)
                elif isinstance(a, GateResult):
                    gate = {"wave": a.wave, "passed": a.passed, "reason": a.reason, "at": now, **a.figures}
                    ro.gates = [*(ro.gates or []), gate]
                    log.info("rollout %d: wave %d gate %s", rollout_id, a.wave + 1, a.reason)
                elif isinstance(a, Advance):
                    ro.current_wave = a.wave
                elif isinstance(a, Finish):
                    ro.state, ro.reason, ro.finished_at = a.state, a.reason, at
                    if a.state == "succeeded":
                        dep.state = "active"
                        touched.update(d.id for d in matching_devices(s, dep))
                    else:
                        dep.state = "rolled_back"
                        touched.update(self._revert(s, rollout_id, a.reason))
                    log.info("rollout %d %s: %s", rollout_id, a.state, a.reason)
            ro.updated_at = at
            s.add(ro)
            s.add(dep)
            s.commit()
        self._twin.recompute_many(touched)
        self._fill_targets(rollout_id)

    @staticmethod
    def _revert(s: Session, rollout_id: int, reason: str, *, states: Sequence[str] | None = None) -> set[str]:
        out: set[str] = set()
        for m in rollout_devices(s, rollout_id):
            if m.state == "rolled_back" or (states is not None and m.state not in states):
                continue
            m.state, m.reason = "rolled_back", reason if m.reason is None else f"{m.reason}; {reason}"
            m.settled_at = utcnow()
            s.add(m)
            out.add(m.device_id)
        return out

    def _fill_targets(self, rollout_id: int) -> None:
        """Admitted devices whose new desired state is not recorded yet: publish and record it."""
        with Session(self._engine) as s:
            ro = s.get(Rollout, rollout_id)
            if ro is None:
                return
            dep = s.get(Deployment, ro.deployment_id)
            assert dep is not None
            pending = [m.device_id for m in rollout_devices(s, rollout_id) if m.target_version is None]
        for device_id in pending:
            self._twin.recompute(device_id)
            with Session(self._engine) as s:
                m = s.get(RolloutDevice, (rollout_id, device_id))
                dev = crud.get_device(s, device_id=device_id)
                if m is None or dev is None:
                    continue
                m.target_version = dev.desired_version
                m.cameras = sorted(
                    cam for cam, a in (dev.assignments or {}).items() if a.get("deployment") == dep.name
                )
                health = {str(c.get("camera")): c for c in (dev.last_health or {}).get("cameras") or []}
                fps = [float(health[c]["fps"]) for c in m.cameras if c in health and health[c].get("fps")]
                # The same statistic as the gate will judge after the swap (p99, else median), so the
                # ratio compares like with like.
                lat = [found[0] for c in m.cameras if c in health and (found := camera_latency(health[c]))]
                m.baseline_fps = min(fps) if fps else None
                m.baseline_latency_ms = max(lat) if lat else None
                s.add(m)
                s.commit()

    # ------------------------------------------------------------------ create

    def create(
        self,
        *,
        name: str,
        model: str,
        version: str,
        selector: str,
        variant: str = AUTO,
        cameras: list[dict[str, Any]] | None = None,
        priority: int = 0,
        waves: Sequence[int | str] | None = None,
        gate: GateConfig | None = None,
    ) -> int:
        """A new deployment in state rolling_out with its rollout; returns the deployment id."""
        try:
            parse_selector(selector)
        except SelectorError as exc:
            raise DeploymentError(422, f"selector: {exc}") from None
        try:
            plan_in = [parse_wave(w) for w in (waves if waves is not None else DEFAULT_WAVES)]
        except ValueError as exc:
            raise DeploymentError(422, f"waves: {exc}") from None
        if not plan_in:
            raise DeploymentError(422, "waves: at least one wave")
        with self._lock, Session(self._engine) as s:
            mv = crud.get_model_version(s, name=model, version=version)
            if mv is None:
                raise DeploymentError(404, f"model {model!r} version {version!r} is not registered")
            try:
                choose(s, mv=mv, capabilities=None, pin=variant)
            except ConflictError as exc:
                raise DeploymentError(409, str(exc)) from None
            if get_deployment(s, name) is not None:
                raise DeploymentError(409, f"a deployment named {name!r} exists")
            dep = Deployment(
                name=name,
                model=model,
                version=version,
                variant=variant,
                selector=selector,
                cameras=list(cameras or [{"camera": "*"}]),
                priority=priority,
                state="rolling_out",
            )
            s.add(dep)
            s.flush()
            assert dep.id is not None
            n = len(matching_devices(s, dep))
            s.add(
                Rollout(
                    deployment_id=dep.id,
                    waves=list(plan_in),
                    plan=plan_waves(plan_in, n),
                    gate=(gate or GateConfig()).model_dump(),
                )
            )
            s.commit()
            return dep.id

    # ------------------------------------------------------------------ operator actions

    def _operate(self, ref: str | int, fn: Callable[[Session, Deployment, Rollout], set[str]]) -> int:
        with self._lock:
            with Session(self._engine) as s:
                dep = get_deployment(s, ref)
                if dep is None or dep.id is None:
                    raise NotFoundError(f"deployment {ref!r} is not known")
                ro = rollout_of(s, dep.id)
                assert ro is not None
                touched = fn(s, dep, ro)
                ro.updated_at = utcnow()
                s.add(ro)
                s.add(dep)
                s.commit()
                dep_id = dep.id
            self._twin.recompute_many(touched)
            return dep_id

    def pause(self, ref: str | int) -> int:
        def fn(s: Session, dep: Deployment, ro: Rollout) -> set[str]:
            if ro.state == RUNNING:
                ro.state = PAUSED
            return set()

        return self._operate(ref, fn)

    def resume(self, ref: str | int) -> int:
        def fn(s: Session, dep: Deployment, ro: Rollout) -> set[str]:
            if ro.state == PAUSED:
                ro.state = RUNNING
            return set()

        return self._operate(ref, fn)

    def cancel(self, ref: str | int) -> int:
        """Stop: devices already active keep the deployment, devices still applying are reverted."""

        def fn(s: Session, dep: Deployment, ro: Rollout) -> set[str]:
            if ro.state not in (RUNNING, PAUSED):
                return set()
            assert ro.id is not None
            ro.state, ro.reason, ro.finished_at = "cancelled", "cancelled by the operator", utcnow()
            dep.state = "cancelled"
            return self._revert(s, ro.id, "cancelled before it was active", states=("pending", "applying"))

        return self._operate(ref, fn)

    def rollback(self, ref: str | int) -> int:
        """Every device the deployment reached goes back to its previous layer, whatever the state."""

        def fn(s: Session, dep: Deployment, ro: Rollout) -> set[str]:
            assert ro.id is not None
            touched = {d.id for d in matching_devices(s, dep)}
            touched |= self._revert(s, ro.id, "rolled back by the operator")
            touched |= {m.device_id for m in rollout_devices(s, ro.id)}
            if dep.state != "rolled_back" or ro.state not in ("failed", "rolled_back"):
                if ro.state != "failed":
                    ro.state = "rolled_back"
                    ro.reason = "rolled back by the operator"
                ro.finished_at = ro.finished_at or utcnow()
                dep.state = "rolled_back"
            return touched

        return self._operate(ref, fn)

    # ------------------------------------------------------------------ delete

    def delete(self, ref: str | int) -> set[str]:
        """Remove the deployment's layer; returns the devices whose desired state was derived again.

        Every device it applied to falls back to its next layer (a lower-priority deployment, else
        its direct assignment, else nothing on that camera) and is sent the new desired state. A
        rollout still running or paused is stopped first, as a cancel would (one call, never a 409:
        deleting means none of its devices keep it, which needs no cancel beforehand). The row stays
        as history under a tombstone name that no request can spell (``~ID~name``), so the name is
        free for a new deployment; the deleted one is gone from the API, and a second delete, by name
        or id, is a NotFoundError.
        """
        reason = "the deployment was deleted"
        with self._lock:
            with Session(self._engine) as s:
                dep = get_deployment(s, ref)
                if dep is None or dep.id is None or dep.state == "deleted":
                    raise NotFoundError(f"deployment {ref!r} is not known")
                touched = {d.id for d in matching_devices(s, dep)}
                # Also devices that no longer match but still carry its layer (belt and braces).
                touched |= {
                    d.id
                    for d in crud.devices_with_desired(s)
                    if any(a.get("deployment") == dep.name for a in (d.assignments or {}).values())
                }
                ro = rollout_of(s, dep.id)
                if ro is not None:
                    assert ro.id is not None
                    if ro.state in (RUNNING, PAUSED):
                        ro.state, ro.reason, ro.finished_at = "cancelled", reason, utcnow()
                    touched |= self._revert(s, ro.id, reason, states=("pending", "applying"))
                    touched |= {m.device_id for m in rollout_devices(s, ro.id)}
                    ro.updated_at = utcnow()
                    s.add(ro)
                log.info("deployment %s (#%d) deleted; %d devices follow", dep.name, dep.id, len(touched))
                dep.state = "deleted"
                dep.name = f"~{dep.id}~{dep.name}"[:64]
                s.add(dep)
                s.commit()
            self._twin.recompute_many(touched)
        return touched
