"""The rollout gate: waves, health figures and the pure decision function ``step``.

``step(view, devices, now) -> actions`` looks at a snapshot (the rollout, its members, the devices)
and the time, and says what to do; it touches no database and no clock, so it is tested apart.
``controller.fleet.rollouts`` loads the snapshot and applies the actions.

A member is a device, or a pool camera the deployment names. Cameras of a pool move between
devices (failover, drain, an operator's move), so for them the unit of a wave is the camera: a wave
admits cameras, and a camera's figures are those of whichever device analyses it now. A camera that
moves while it is judged (applying, or active in the wave being soaked) starts again on its new device
(``Moved`` with ``restart``): the move is the pool's doing, not the new version's, so it is no failure;
but a camera moved more than ``max_soak_restarts`` times during its judgement fails (a version that
takes down every device it lands on must not soak for ever), and a camera that fails on its new
device fails like any member. A device that goes offline under a camera is left to the pool, which
moves the camera; only a camera whose device stays offline for ``step_timeout_s`` without a move fails.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel, Field

from controller.db.states import LIVE_ROLLOUT_STATES, MemberState, RolloutState

DEFAULT_WAVES: list[int | str] = [1, "10%", "50%", "100%"]
CRASH_LOOP_RESTARTS = 3  # more restarts than this since admission is a crash loop
# The agent's watchdog actions (edge_agent/core/restart_policy.py WatchdogAction) the gate counts; "retry",
# "recovered" and "command" (an operator's restart) are not signs of a bad model.
WATCHDOG_RESTARTED, WATCHDOG_FAILED = "restarted", "failed"


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
    # From admission to every camera running the model: the download, the verify, the load.
    step_timeout_s: float = Field(default=300.0, gt=0)
    # A first TensorRT engine build on a device (minutes on a Jetson, longer with INT8 calibration)
    # may run past step_timeout_s while it makes progress: the member fails only when the build has
    # been silent for build_stall_s, or when build_timeout_s has passed since admission.
    build_timeout_s: float = Field(default=3600.0, gt=0)
    build_stall_s: float = Field(default=180.0, gt=0)
    offline_timeout_s: float = Field(default=60.0, ge=0)
    # A pool camera moved to another device while it is judged starts again there; more moves than
    # this during one judgement fail it.
    max_soak_restarts: int = Field(default=3, ge=0)


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
    # When the device last said its engine build for the rollout's model moved (a model_build
    # started/progress event since admission, controller clock); None: no build seen.
    build_active_at: float | None = None
    # The agent software as the device reports it (fleet_protocol AgentReported: version, state,
    # target, error); None from an agent that does not report it.
    agent: Mapping[str, Any] | None = None


def camera_key(pool: str, camera: str) -> str:
    """A camera member's key among a rollout's members: ids never hold a "/", so no device id is one."""
    return f"{pool}/{camera}"


@dataclass(frozen=True)
class MemberView:
    # A device member's device; a camera member's device now ("" while no device analyses it).
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
    pool: str | None = None  # a camera member: its pool and camera (``cameras`` is that camera alone)
    camera: str | None = None
    soak_restarts: int = 0  # a camera member: how often a move started its judgement again

    @property
    def key(self) -> str:
        return (
            self.device_id if self.pool is None or self.camera is None else camera_key(self.pool, self.camera)
        )


@dataclass(frozen=True)
class CameraTarget:
    """A pool camera the deployment names, as its pool has it now."""

    pool: str
    camera: str
    device: str | None  # where the stored plan places it; None: unplaced
    # The plan admitted the deployment's version for it there (the canary fits); held: why not.
    admitted: bool = False
    held: str | None = None
    moved: str | None = None  # the reason of its last move (a placement.MoveReason value), if known

    @property
    def key(self) -> str:
        return camera_key(self.pool, self.camera)


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
    # An agent rollout: the agent version each member must come to run, and how long the
    # agent has to report healthy after its switch (on top of step_timeout_s for fetch and install).
    agent_version: str | None = None
    agent_health_timeout_s: float = 120.0
    # The pool cameras the deployment names, by key; and whether it also covers the devices' own
    # cameras (a "*" entry, or a named camera of no pool): without, no device is a member.
    targets: Mapping[str, CameraTarget] = field(default_factory=dict)
    devices_targeted: bool = True


@dataclass(frozen=True)
class Admit:
    device_id: str
    wave: int


@dataclass(frozen=True)
class AdmitCamera:
    key: str  # camera_key(pool, camera) of a target
    wave: int


@dataclass(frozen=True)
class Settle:
    key: str  # a member's key: a device id, or camera_key(pool, camera)
    state: MemberState  # active | failed
    reason: str | None = None


@dataclass(frozen=True)
class Moved:
    """A camera member runs on another device now; ``restart``: its judgement starts again there."""

    key: str
    device: str
    restart: bool
    reason: str


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
    state: RolloutState  # succeeded | failed
    reason: str


Action = Admit | AdmitCamera | Settle | Moved | GateResult | Advance | Finish


def _offline_for(dev: DeviceView, since: float, now: float) -> float:
    if dev.online:
        return 0.0
    return now - max(dev.offline_since or since, since)


def _crash_loop(m: MemberView, dev: DeviceView) -> Settle | None:
    n = sum(t >= m.admitted_at for t in dev.restarts)
    if n > CRASH_LOOP_RESTARTS:
        return Settle(m.key, MemberState.FAILED, f"crash loop: the agent restarted {n} times since admission")
    return None


# Agent update states (fleet_protocol AgentUpdateState) that end an attempt without the new version.
AGENT_FAILED_STATES = ("failed", "rolled_back")
AGENT_SETTLED_STATE = "idle"
# The state of a version on trial: it runs, but the supervisor has not confirmed it healthy yet.
AGENT_TRIAL_STATE = "restarting"


@dataclass(frozen=True)
class AgentAttempt:
    """An update the device's agent says failed: the version it tried, how it ended, and why."""

    version: str
    state: str  # "failed" (refused or could not install) or "rolled_back"
    error: str | None


def failed_attempt(agent: Mapping[str, Any] | None) -> AgentAttempt | None:
    """The failed update a reported agent (AgentReported as stored, the agent's JSON) tells of, or None.

    The version tried is the one it names as its target or, once rolled back, as ``previous``; the
    version it runs is never the one that failed."""
    a = agent or {}
    state = a.get("state")
    if state not in AGENT_FAILED_STATES:
        return None
    tried = a.get("target") or (a.get("previous") if state == "rolled_back" else None)
    if not isinstance(tried, str) or not tried or tried == a.get("version"):
        return None
    error = a.get("error")
    return AgentAttempt(version=tried, state=str(state), error=error if isinstance(error, str) else None)


def _agent_failure(dev: DeviceView, target: str) -> str | None:
    """Why the device's agent says the update to ``target`` failed, or None."""
    a = dev.agent or {}
    # The attempt at this version: the agent names it as its target, or (rolled back) as previous.
    if a.get("state") in AGENT_FAILED_STATES and (
        a.get("target") in (target, None) or a.get("previous") == target
    ):
        what = "rolled back" if a.get("state") == "rolled_back" else "refused or could not install"
        runs = f"; runs {a.get('version')}" if a.get("version") else ""
        return f"agent {target} {what}: {a.get('error') or 'no reason'}{runs}"
    return None


def _settle_agent_applying(m: MemberView, dev: DeviceView, r: RolloutView, now: float) -> Settle | None:
    """A member of an agent rollout: active once it runs the version and is idle (healthy under the
    supervisor); failed when it says the update failed or rolled back, when it stays offline, or
    when it has not come to run the version within step_timeout_s + the health timeout."""
    target = r.agent_version
    assert target is not None
    a = dev.agent or {}
    if a.get("version") == target and a.get("state", AGENT_SETTLED_STATE) == AGENT_SETTLED_STATE:
        return Settle(m.key, MemberState.ACTIVE)
    if (why := _agent_failure(dev, target)) is not None:
        return Settle(m.key, MemberState.FAILED, why)
    off = _offline_for(dev, m.admitted_at, now)
    if not dev.online and off > r.gate.offline_timeout_s:
        return Settle(
            m.key, MemberState.FAILED, f"offline for {off:.0f}s (limit {r.gate.offline_timeout_s:g}s)"
        )
    bound = r.gate.step_timeout_s + r.agent_health_timeout_s
    if now - m.admitted_at > bound:
        seen = f"{a.get('version')} ({a.get('state') or 'idle'})" if a else "no agent state"
        return Settle(
            m.key,
            MemberState.FAILED,
            f"not running agent {target} after {bound:g}s (step_timeout_s + health timeout); reports {seen}",
        )
    return None


def _settle_applying(m: MemberView, dev: DeviceView | None, r: RolloutView, now: float) -> Settle | None:
    if dev is None:
        return Settle(m.key, MemberState.FAILED, "device is no longer known")
    if r.agent_version is not None:
        if not dev.matches:
            return Settle(m.key, MemberState.FAILED, "device no longer matches the selector")
        # No crash-loop count from heartbeat uptimes here: the update itself restarts the agent.
        return _settle_agent_applying(m, dev, r, now)
    if (crash := _crash_loop(m, dev)) is not None:
        return crash
    if not dev.matches:
        return Settle(m.key, MemberState.FAILED, "device no longer matches the selector")
    if m.target_version is not None and not m.cameras:
        return Settle(m.key, MemberState.ACTIVE, "every camera is held by a higher-priority layer")
    if (done := _activation(m, dev, r)) is not None:
        return done
    off = _offline_for(dev, m.admitted_at, now)
    if not dev.online and off > r.gate.offline_timeout_s:
        return Settle(
            m.key, MemberState.FAILED, f"offline for {off:.0f}s (limit {r.gate.offline_timeout_s:g}s)"
        )
    return _step_timeout(m, dev, r, now)


def _camera_failure(m: MemberView, dev: DeviceView, *, since: int | None) -> Settle | None:
    """A member's camera the device reports failed (from desired version ``since`` on, if given)."""
    where = f" on {dev.id}" if m.camera is not None else ""
    for cam in m.cameras:
        rep = dev.reported.get(cam) or {}
        if rep.get("state") == "failed" and (since is None or (dev.reported_version or 0) >= since):
            return Settle(
                m.key, MemberState.FAILED, f"camera {cam} failed{where}: {rep.get('error') or 'no reason'}"
            )
    return None


def _activation(m: MemberView, dev: DeviceView, r: RolloutView) -> Settle | None:
    """Active once the device applied the member's desired version and runs the model on every camera
    of the member; failed when it reports one of them failed since that version."""
    if m.target_version is None:
        return None
    if (failed := _camera_failure(m, dev, since=m.target_version)) is not None:
        return failed
    if (dev.reported_version or 0) >= m.target_version and all(
        (dev.reported.get(c) or {}).get("state") == "running"
        and (dev.reported.get(c) or {}).get("model") == r.model
        for c in m.cameras
    ):
        return Settle(m.key, MemberState.ACTIVE)
    return None


def _step_timeout(
    m: MemberView, dev: DeviceView, r: RolloutView, now: float, held: str | None = None
) -> Settle | None:
    """Failed when not active ``step_timeout_s`` after admission, unless an engine build moves."""
    if now - m.admitted_at <= r.gate.step_timeout_s:
        return None
    building = dev.build_active_at is not None and any(
        (dev.reported.get(c) or {}).get("state") == "loading" for c in m.cameras
    )
    if building and dev.build_active_at is not None:
        if now - m.admitted_at > r.gate.build_timeout_s:
            return Settle(
                m.key,
                MemberState.FAILED,
                f"engine build not done after {r.gate.build_timeout_s:g}s (build_timeout_s)",
            )
        silent = now - dev.build_active_at
        if silent > r.gate.build_stall_s:
            return Settle(
                m.key,
                MemberState.FAILED,
                f"engine build made no progress for {silent:.1f}s (limit {r.gate.build_stall_s:g}s)",
            )
        return None  # a build that moves is waited for, up to build_timeout_s
    if held is not None:
        return Settle(
            m.key,
            MemberState.FAILED,
            f"not active after {r.gate.step_timeout_s:g}s: its pool does not admit {r.model} on {dev.id} ({held})",
        )
    states = {c: (dev.reported.get(c) or {}).get("state", "unknown") for c in m.cameras}
    where = f" on {dev.id}" if m.camera is not None else ""
    return Settle(
        m.key,
        MemberState.FAILED,
        f"not active after {r.gate.step_timeout_s:g}s{where} (reported v{dev.reported_version}, {states})",
    )


def _camera_offline(m: MemberView, dev: DeviceView, r: RolloutView, now: float) -> Settle | None:
    """A camera whose device is offline is the pool's to move; failed only when it stays there."""
    off = _offline_for(dev, m.settled_at or m.admitted_at, now)
    if not dev.online and off > r.gate.step_timeout_s:
        return Settle(
            m.key,
            MemberState.FAILED,
            f"its device {dev.id} has been offline for {off:.0f}s and its pool has not moved it "
            f"(limit step_timeout_s {r.gate.step_timeout_s:g}s)",
        )
    return None


def _settle_camera(
    m: MemberView, t: CameraTarget | None, dev: DeviceView | None, r: RolloutView, now: float
) -> Settle | None:
    """A camera member being judged (applying, or active in the wave being soaked)."""
    if t is None:
        return Settle(m.key, MemberState.FAILED, f"camera {m.camera} is no longer declared in pool {m.pool}")
    if not m.device_id:
        if m.state == MemberState.APPLYING and now - m.admitted_at > r.gate.step_timeout_s:
            return Settle(
                m.key,
                MemberState.FAILED,
                f"not placed on any device for {now - m.admitted_at:.0f}s (limit step_timeout_s)",
            )
        return None
    if dev is None:
        return Settle(m.key, MemberState.FAILED, f"device {m.device_id} is no longer known")
    if (crash := _crash_loop(m, dev)) is not None:
        return crash
    if m.state == MemberState.APPLYING:
        if (done := _activation(m, dev, r)) is not None:
            return done
        if not dev.online:
            return _camera_offline(m, dev, r, now)
        return _step_timeout(m, dev, r, now, held=None if t.admitted else t.held)
    if (failed := _camera_failure(m, dev, since=None)) is not None:
        return failed
    return _camera_offline(m, dev, r, now)


def _settle_active(m: MemberView, dev: DeviceView | None, r: RolloutView, now: float) -> Settle | None:
    """A device of the wave being soaked that went bad after activation."""
    if dev is None:
        return Settle(m.key, MemberState.FAILED, "device is no longer known")
    if r.agent_version is not None:
        # After activation: the supervisor fell back (a crash after the health check), or the agent runs
        # another version.
        if (why := _agent_failure(dev, r.agent_version)) is not None:
            return Settle(m.key, MemberState.FAILED, why)
        running = (dev.agent or {}).get("version")
        if running is not None and running != r.agent_version:
            return Settle(m.key, MemberState.FAILED, f"agent runs {running}, not {r.agent_version}")
    elif (crash := _crash_loop(m, dev)) is not None:
        return crash
    if (failed := _camera_failure(m, dev, since=None)) is not None:
        return failed
    off = _offline_for(dev, m.settled_at or m.admitted_at, now)
    if not dev.online and off > r.gate.offline_timeout_s:
        return Settle(
            m.key, MemberState.FAILED, f"offline for {off:.0f}s (limit {r.gate.offline_timeout_s:g}s)"
        )
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
    failed = [m.key for m in wave if m.state == MemberState.FAILED]
    ratios: dict[str, float] = {}
    latencies: dict[str, float] = {}
    latency_stats: dict[str, str] = {}
    latency_ratios: dict[str, float] = {}
    watchdog: dict[str, dict[str, Any]] = {}
    for m in wave:
        dev = devices.get(m.device_id)
        if m.state != MemberState.ACTIVE or dev is None or not m.cameras:
            continue
        if (wd := _watchdog_figures(m, dev, r.model)) is not None:
            watchdog[m.key] = wd
        fps = [dev.fps[c] for c in m.cameras if c in dev.fps]
        if fps and m.baseline_fps:
            ratios[m.key] = round(min(fps) / m.baseline_fps, 3)
        lat = [dev.latency_ms[c] for c in m.cameras if c in dev.latency_ms]
        if lat:
            latencies[m.key] = round(max(lat), 2)
            latency_stats[m.key] = dev.latency_stat
            if m.baseline_latency_ms:
                latency_ratios[m.key] = round(max(lat) / m.baseline_latency_ms, 3)
    return {
        "devices": [m.device_id for m in wave if m.camera is None],
        # pool/camera of each camera member, and the device that analyses it now ("" none)
        "cameras": {m.key: m.device_id for m in wave if m.camera is not None},
        "size": len(wave),
        "active": sum(m.state == MemberState.ACTIVE for m in wave),
        "failed": failed,
        "failures": {m.key: m.reason for m in wave if m.state == MemberState.FAILED},
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
        unit = "cameras" if fig.get("cameras") and not fig["devices"] else "devices"
        if fig.get("cameras") and fig["devices"]:
            unit = "members"
        return f"{len(fig['failed'])} of {fig['size']} {unit} failed ({why})"
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
    if r.state not in LIVE_ROLLOUT_STATES:
        return []
    actions: list[Action] = []
    members = dict(r.members)
    judged_wave = r.current_wave if r.current_wave not in r.gated_waves else None
    # 0. pool cameras that run on another device now: those being judged start again there
    for m in r.members.values():
        if m.pool is None or m.state not in (MemberState.APPLYING, MemberState.ACTIVE):
            continue
        t = r.targets.get(m.key)
        now_on = (t.device or "") if t is not None else m.device_id
        if now_on == m.device_id:
            continue
        judged = m.state == MemberState.APPLYING or m.wave == judged_wave
        cause = "unplaced" if not now_on else (t.moved if t is not None and t.moved else "moved")
        restarts = m.soak_restarts + (1 if judged and now_on else 0)
        if restarts > r.gate.max_soak_restarts:
            gone = Settle(
                m.key,
                MemberState.FAILED,
                f"moved {restarts} times while judged (limit max_soak_restarts {r.gate.max_soak_restarts}); "
                f"the last from {m.device_id or 'no device'} to {now_on} ({cause})",
            )
            actions.append(gone)
            members[m.key] = replace(m, state=gone.state, settled_at=now, reason=gone.reason)
            continue
        actions.append(Moved(m.key, now_on, judged, cause))
        if judged:
            members[m.key] = replace(
                m,
                device_id=now_on,
                state=MemberState.APPLYING,
                admitted_at=now,
                settled_at=None,
                target_version=None,
                soak_restarts=restarts,
            )
        else:
            members[m.key] = replace(m, device_id=now_on)
    # 1. per member: activation, failure, timeouts, offline
    for key, m in list(members.items()):
        dev = devices.get(m.device_id)
        s: Settle | None = None
        judged = m.state == MemberState.APPLYING or (m.state == MemberState.ACTIVE and m.wave == judged_wave)
        if m.pool is not None:
            if judged:
                s = _settle_camera(m, r.targets.get(key), dev, r, now)
        elif m.state == MemberState.APPLYING:
            s = _settle_applying(m, dev, r, now)
        elif judged:
            s = _settle_active(m, dev, r, now)
        if s is not None:
            actions.append(s)
            members[key] = replace(m, state=s.state, settled_at=now, reason=s.reason)
    w = r.current_wave
    if w >= len(r.plan):
        return [*actions, Finish(RolloutState.SUCCEEDED, "every wave passed its gate")]
    wave = [m for m in members.values() if m.wave == w]
    # 2. admission of the current wave
    if not wave:
        if r.state != RolloutState.RUNNING:
            return actions
        last = w == len(r.plan) - 1
        want = r.plan[w] - len(members)
        devs = (
            sorted(d.id for d in devices.values() if d.matches and d.id not in members)
            if r.devices_targeted
            else []
        )
        # A camera no device analyses now has nothing to judge: it waits for a later wave, and takes
        # the deployment once the rollout is done wherever it is placed.
        cams = sorted(k for k, t in r.targets.items() if k not in members and t.device is not None)
        candidates: list[Action] = [*(Admit(d, w) for d in devs), *(AdmitCamera(k, w) for k in cams)]
        if last and r.admit_all_in_last:
            want = len(candidates)
        admit = candidates[: max(0, want)]
        if not admit:
            if last:
                return [*actions, Finish(RolloutState.SUCCEEDED, "no devices left to admit")]
            return [*actions, Advance(w + 1)]
        return [*actions, *admit]
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
            Finish(RolloutState.FAILED, f"wave {w + 1} gate failed: {bad}"),
        ]
    if any(m.state == MemberState.APPLYING for m in wave):
        return actions
    # A camera whose device is offline (until its pool moves it) is not judged on figures it cannot send.
    if any(
        m.pool is not None
        and m.state == MemberState.ACTIVE
        and ((d := devices.get(m.device_id)) is None or not d.online)
        for m in wave
    ):
        return actions
    settled = max((m.settled_at or m.admitted_at) for m in wave)
    if now - settled < r.gate.soak_s:
        return actions
    why = _verdict(fig, r)
    if why is not None:
        return [
            *actions,
            GateResult(w, False, fig, why),
            Finish(RolloutState.FAILED, f"wave {w + 1} gate failed: {why}"),
        ]
    actions.append(GateResult(w, True, fig, "passed"))
    if w == len(r.plan) - 1:
        actions.append(Finish(RolloutState.SUCCEEDED, "every wave passed its gate"))
    else:
        actions.append(Advance(w + 1))
    return actions
