"""Rollouts: waves of devices and pool cameras, each wave's health gate, automatic rollback;
restart-safe.

A pool camera the deployment names is a member of its own (``rollout_camera``), whichever device runs
it: admitted, it is the pool's canary, which the pool's plan admits where its cost fits (the service
replans the pools it touched at once, and the leader's replan keeps at it); a move while it is judged
starts its judgement again on the new device, with a ``rollout_soak_restarted`` event that says from
where, to where and why.

``controller.fleet.gate.step`` is the pure decision function over a snapshot (the rollout, its
members, the devices) and the time; ``RolloutService`` here loads the snapshot from the database, applies the actions in one
transaction and has the twin recompute the desired state of every device they touch. Everything
lives in the database, so a controller killed mid-rollout continues where it was after a restart.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller.db import crud
from controller.db.leader import ALWAYS_LEADER, FencedOut, LeaderLoop, Leadership
from controller.db.states import LIVE_ROLLOUT_STATES, DeploymentState, DeviceStatus, MemberState, RolloutState
from controller.db.tables import (
    SOURCE_CONTROLLER,
    Deployment,
    Device,
    Event,
    HealthSample,
    PoolPlacement,
    Rollout,
    RolloutCamera,
    RolloutDevice,
    utcnow,
)
from controller.errors import ConflictError, ControllerError, InvalidError, NotFoundError
from controller.fleet.deployments import (
    AGENT_HEALTH_TIMEOUT_S,
    AGENT_KIND,
    covers_device_cameras,
    device_targets,
    get_deployment,
    matches,
    pool_targets,
    rollout_cameras,
    rollout_devices,
)
from controller.fleet.gate import (
    DEFAULT_WAVES,
    Admit,
    AdmitCamera,
    Advance,
    CameraTarget,
    DeviceView,
    Finish,
    GateConfig,
    GateResult,
    MemberView,
    Moved,
    RolloutView,
    Settle,
    WatchdogStep,
    parse_wave,
    plan_waves,
    step,
)
from controller.fleet.placement import variant_key
from controller.fleet.pools import EVENT_MOVED, PoolService
from controller.fleet.selectors import SelectorError, parse_selector
from controller.fleet.twin import TwinService
from controller.registry.agent_packages import get_package
from controller.registry.choice import AUTO, choose
from fleet_protocol.messages import EventKind

log = logging.getLogger(__name__)

EVENT_SOAK_RESTARTED = "rollout_soak_restarted"
TICK_S = 1.0
_IN_CHUNK = 500  # device ids per IN (...) list: far below every driver's parameter limit
# In the sets of devices an operator's action touches: a pool to replan (a device id holds no "/").
POOL_MARK = "pool/"
# Members a cancel or a delete reverts: the ones not active yet.
_NOT_ACTIVE_YET = (MemberState.PENDING, MemberState.APPLYING)


# --------------------------------------------------------------------------- the service


class DeploymentError(ControllerError, ValueError):
    """A deployment that cannot be created: the subclass says which kind, the message says why."""


class DeploymentInvalidError(DeploymentError, InvalidError):
    """The deployment asked for is wrong in itself: its selector or its waves."""


class DeploymentModelNotFoundError(DeploymentError, NotFoundError):
    """The model version to deploy is not registered."""


class DeploymentConflictError(DeploymentError, ConflictError):
    """The deployment's name is taken, or its pinned variant is not fit."""


class DeploymentAgentNotFoundError(DeploymentError, NotFoundError):
    """The agent version to deploy was not uploaded."""


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


def build_activity_since(s: Session, since: Mapping[str, datetime], model: str) -> dict[str, float]:
    """Per device, when it last reported its engine build for ``model`` moving (started or progress)."""
    out: dict[str, float] = {}
    ids = sorted(since)
    for i in range(0, len(ids), _IN_CHUNK):
        chunk = ids[i : i + _IN_CHUNK]
        rows = s.exec(
            select(Event.device_id, Event.stored_at, Event.data).where(
                col(Event.kind) == EventKind.MODEL_BUILD.value,
                col(Event.device_id).in_(chunk),
                col(Event.stored_at) >= min(since[d] for d in chunk),
            )
        ).all()
        for device_id, stored_at, data in rows:
            d = data if isinstance(data, dict) else {}
            if stored_at < since[device_id] or d.get("model") != model:
                continue
            if d.get("phase") in ("started", "progress"):
                out[device_id] = max(out.get(device_id, 0.0), stored_at.timestamp())
    return out


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
    build_active_at: float | None = None,
) -> DeviceView:
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
        online=dev.status == DeviceStatus.ONLINE,
        offline_since=_ts(dev.offline_since),
        reported_version=dev.reported_version,
        reported=dict((dev.reported or {}).get("cameras") or {}),
        fps=fps,
        latency_ms=lat,
        latency_stat="p99" if stats == {"p99"} else "median",
        restarts=restarts,
        watchdog=watchdog,
        build_active_at=build_active_at,
        agent=_agent_reported(dev),
    )


def _agent_reported(dev: Device) -> dict[str, Any] | None:
    """The device's reported agent (AgentReported as stored), read loosely: the agent's JSON."""
    a = (dev.reported or {}).get("agent")
    return dict(a) if isinstance(a, dict) else None


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


def camera_member_view(m: RolloutCamera) -> MemberView:
    return MemberView(
        device_id=m.device_id,
        wave=m.wave,
        state=m.state,
        admitted_at=_ts(m.admitted_at) or 0.0,
        cameras=(m.camera,),
        target_version=m.target_version,
        baseline_fps=m.baseline_fps,
        settled_at=_ts(m.settled_at),
        reason=m.reason,
        baseline_latency_ms=m.baseline_latency_ms,
        pool=m.pool,
        camera=m.camera,
        soak_restarts=m.soak_restarts,
    )


def camera_targets(
    s: Session, dep: Deployment, moved_of: Sequence[tuple[str, str]] = ()
) -> dict[str, CameraTarget]:
    """Every pool camera the deployment names, as the stored plans place it; for ``moved_of`` (pool,
    camera) also the reason of its last move."""
    cams = pool_targets(s, dep)
    if not cams:
        return {}
    rows = {
        (p.pool, p.camera): p
        for p in s.exec(
            select(PoolPlacement).where(col(PoolPlacement.camera).in_(sorted({c.camera for c in cams})))
        )
    }
    want = variant_key(dep.model, dep.version)
    out: dict[str, CameraTarget] = {}
    for c in cams:
        row = rows.get((c.pool, c.camera))
        moved = _last_move(s, c.pool, c.camera) if (c.pool, c.camera) in moved_of else None
        t = CameraTarget(
            pool=c.pool,
            camera=c.camera,
            device=row.device_id if row is not None else None,
            admitted=row is not None and want in (row.canary, variant_key(c.model, c.version)),
            held=row.canary_held if row is not None else None,
            moved=moved,
        )
        out[t.key] = t
    return out


def _last_move(s: Session, pool: str, camera: str) -> str | None:
    """The reason of the camera's newest ``camera_moved`` event."""
    q = (
        select(Event.data)
        .where(
            col(Event.kind) == EVENT_MOVED,
            col(Event.camera) == camera,
            col(Event.data)["pool"].as_string() == pool,
        )
        .order_by(col(Event.ts).desc(), col(Event.id).desc())
        .limit(1)
    )
    data = s.exec(q).first()
    reason = (data or {}).get("reason") if isinstance(data, dict) else None
    return reason if isinstance(reason, str) else None


def rollout_view(
    ro: Rollout,
    dep: Deployment,
    members: Sequence[RolloutDevice],
    cameras: Sequence[RolloutCamera] = (),
    targets: Mapping[str, CameraTarget] | None = None,
    devices_targeted: bool = True,
) -> RolloutView:
    waves = list(ro.waves or [])
    views = [*(member_view(m) for m in members), *(camera_member_view(m) for m in cameras)]
    return RolloutView(
        state=ro.state,
        model=f"{dep.model}:{dep.version}",
        plan=tuple(ro.plan or ()),
        current_wave=ro.current_wave,
        gate=GateConfig.model_validate(ro.gate or {}),
        members={v.key: v for v in views},
        gated_waves=frozenset(int(g["wave"]) for g in ro.gates or [] if g.get("passed")),
        admit_all_in_last=bool(waves) and str(waves[-1]).strip() == "100%",
        agent_version=dep.agent_version if dep.kind == AGENT_KIND else None,
        agent_health_timeout_s=dep.agent_health_timeout_s or AGENT_HEALTH_TIMEOUT_S,
        targets=dict(targets or {}),
        devices_targeted=devices_targeted,
    )


def _locked_rollout(
    s: Session, *, rollout_id: int | None = None, deployment_id: int | None = None
) -> Rollout | None:
    """The rollout's row, locked until the transaction ends (``SELECT … FOR UPDATE``; SQLite, one
    process, ignores the clause) and read as the previous holder left it."""
    q = select(Rollout)
    q = q.where(col(Rollout.id) == rollout_id) if rollout_id is not None else q
    q = q.where(col(Rollout.deployment_id) == deployment_id) if deployment_id is not None else q
    return s.exec(q.with_for_update().execution_options(populate_existing=True)).first()


class RolloutService:
    """Creates deployments with their rollouts, drives them from a runner thread, and carries out
    the operator's pause/resume/cancel/rollback.

    Ticks and operator actions are ordered by the rollout's row lock, so an action served by one
    replica and a tick on the leader take turns on a rollout (and by one in-process lock as well).
    Ticks are leader work: skipped unless ``leadership.is_leader()``, every commit fenced.
    """

    def __init__(
        self,
        engine: Engine,
        twin: TwinService,
        *,
        stop: threading.Event,
        tick_s: float = TICK_S,
        leadership: Leadership = ALWAYS_LEADER,
        pools: PoolService | None = None,
    ):
        """``pools``: replans the pools whose cameras a tick admitted or sent back, so that their plans
        admit or drop the canaries at once (without, the leader's periodic replan does, later)."""
        self._engine = engine
        self._twin = twin
        self._pools = pools
        self._leadership = leadership
        self._lock = threading.Lock()
        self._loop = LeaderLoop(
            "controller-rollouts",
            self._tick_live,
            interval_s=tick_s,
            first_after_s=0.0,
            leadership=leadership,
            stop=stop,
            what="rollout tick",
            logger=log,
        )
        self.clock: Callable[[], float] = time.time

    # ------------------------------------------------------------------ runner

    def start(self) -> None:
        self._loop.start()

    def join(self, timeout: float = 10.0) -> None:
        self._loop.join(timeout)

    def tick(self) -> None:
        """One round over the live rollouts; nothing unless this replica leads. A round fenced out
        ends where it is: another replica leads, and this one's next rounds are skipped."""
        self._loop.lead(self._tick_live, otherwise=None)

    def _tick_live(self) -> None:
        with Session(self._engine) as s:
            ids = [
                int(i)
                for i in s.exec(select(Rollout.id).where(col(Rollout.state).in_(LIVE_ROLLOUT_STATES))).all()
                if i is not None
            ]
        for rid in ids:
            with self._lock:
                self._tick_one(rid)

    def _tick_one(self, rollout_id: int) -> None:
        self._fill_targets(rollout_id)
        touched: set[str] = set()
        pools: set[str] = set()
        now = self.clock()
        with Session(self._engine) as s:
            ro = _locked_rollout(s, rollout_id=rollout_id)
            if ro is None or ro.state not in LIVE_ROLLOUT_STATES:
                return
            dep = s.get(Deployment, ro.deployment_id)
            assert dep is not None
            members = {m.device_id: m for m in rollout_devices(s, rollout_id)}
            cams = {f"{c.pool}/{c.camera}": c for c in rollout_cameras(s, rollout_id)}
            # The reason of a move is read only for the cameras that moved since the last tick.
            placed = {
                (p.pool, p.camera): p.device_id
                for p in s.exec(
                    select(PoolPlacement).where(
                        col(PoolPlacement.camera).in_(sorted({c.camera for c in cams.values()}))
                    )
                )
            }
            moved_of = [
                (c.pool, c.camera) for c in cams.values() if placed.get((c.pool, c.camera), "") != c.device_id
            ]
            targets = camera_targets(s, dep, moved_of)
            covered = covers_device_cameras(dep, pool_targets(s, dep))
            # Only the devices the step can look at: the members, the devices that run their cameras,
            # and the devices that match while the current wave is still to be admitted (never the
            # whole fleet).
            every: list[RolloutDevice | RolloutCamera] = [*members.values(), *cams.values()]
            admitting = (
                ro.state == RolloutState.RUNNING
                and ro.current_wave < len(ro.plan or [])
                and not any(m.wave == ro.current_wave for m in every)
            )
            ids = set(members) | {c.device_id for c in cams.values() if c.device_id}
            ids |= {t.device for t in targets.values() if t.device}
            loaded = crud.devices_by_ids(s, device_ids=ids)
            if admitting and covered:
                loaded += device_targets(s, dep, exclude=ids)
            watched: dict[str, datetime] = {}
            for m in every:
                if m.admitted_at is None or not m.device_id:
                    continue
                if m.state == MemberState.APPLYING or (
                    m.state == MemberState.ACTIVE and m.wave == ro.current_wave
                ):
                    watched[m.device_id] = min(m.admitted_at, watched.get(m.device_id, m.admitted_at))
            steps = watchdog_steps_since(s, watched)
            builds = build_activity_since(s, watched, f"{dep.model}:{dep.version}")
            devices = {
                d.id: device_view(
                    d,
                    dep,
                    restarts_since(s, d.id, watched[d.id]) if d.id in watched else (),
                    steps.get(d.id, ()),
                    builds.get(d.id),
                )
                for d in loaded
            }
            view = rollout_view(ro, dep, list(members.values()), list(cams.values()), targets, covered)
            actions = step(view, devices, now)
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
                elif isinstance(a, AdmitCamera):
                    t = targets[a.key]
                    s.add(
                        RolloutCamera(
                            rollout_id=rollout_id,
                            pool=t.pool,
                            camera=t.camera,
                            device_id=t.device or "",
                            wave=a.wave,
                            admitted_at=at,
                        )
                    )
                    pools.add(t.pool)
                    touched.add(t.device or "")
                    log.info(
                        "rollout %d: wave %d admits camera %s on %s", rollout_id, a.wave + 1, a.key, t.device
                    )
                elif isinstance(a, Settle):
                    m = members.get(a.key) or cams[a.key]
                    m.state, m.reason, m.settled_at = a.state, a.reason, at
                    s.add(m)
                    if a.state == MemberState.FAILED:
                        touched.add(m.device_id)
                        log.warning("rollout %d: %s failed: %s", rollout_id, a.key, a.reason)
                elif isinstance(a, Moved):
                    self._moved(s, dep, cams[a.key], a, at)
                    touched.add(a.device)
                elif isinstance(a, GateResult):
                    gate = {"wave": a.wave, "passed": a.passed, "reason": a.reason, "at": now, **a.figures}
                    ro.gates = [*(ro.gates or []), gate]
                    log.info("rollout %d: wave %d gate %s", rollout_id, a.wave + 1, a.reason)
                elif isinstance(a, Advance):
                    ro.current_wave = a.wave
                elif isinstance(a, Finish):
                    ro.state, ro.reason, ro.finished_at = a.state, a.reason, at
                    pools |= {c.pool for c in cams.values()}
                    if a.state == RolloutState.SUCCEEDED:
                        dep.state = DeploymentState.ACTIVE
                        touched.update(d.id for d in device_targets(s, dep))
                        touched.update(t.device for t in targets.values() if t.device)
                    else:
                        dep.state = DeploymentState.FAILED
                        touched.update(self._revert(s, rollout_id, a.reason))
                    log.info("rollout %d %s: %s", rollout_id, a.state, a.reason)
            ro.updated_at = at
            s.add(ro)
            s.add(dep)
            self._leadership.fence(s)
            s.commit()
        self._pools_changed(pools, now, fence=self._leadership.fence)
        self._twin.recompute_many(touched - {""})
        self._fill_targets(rollout_id)

    @staticmethod
    def _moved(s: Session, dep: Deployment, m: RolloutCamera, a: Moved, at: datetime) -> None:
        """A camera member that runs on another device now; judged, it starts again there."""
        old = m.device_id
        m.device_id = a.device
        if a.restart:
            m.state, m.admitted_at, m.settled_at = MemberState.APPLYING, at, None
            m.target_version, m.baseline_fps, m.baseline_latency_ms = None, None, None
            if a.device:
                m.soak_restarts += 1
            where = f"on {a.device}" if a.device else "once a device analyses it"
            m.reason = f"judged again {where}: moved from {old or 'no device'} ({a.reason})"
            s.add(
                Event(
                    device_id=a.device or old,
                    ts=at,
                    kind=EVENT_SOAK_RESTARTED,
                    severity="warning",
                    camera=m.camera,
                    message=f"deployment {dep.name}: camera {m.camera} of pool {m.pool} {m.reason}; "
                    f"restart {m.soak_restarts}",
                    data={
                        "deployment": dep.name,
                        "pool": m.pool,
                        "camera": m.camera,
                        "source": old,
                        "target": a.device,
                        "reason": a.reason,
                        "restarts": m.soak_restarts,
                    },
                    source=SOURCE_CONTROLLER,
                )
            )
            log.info("rollout %d: camera %s/%s %s", m.rollout_id, m.pool, m.camera, m.reason)
        s.add(m)

    def _pools_changed(self, names: set[str], now: float, fence: Callable[[Session], None]) -> None:
        """Replan the pools whose cameras' wanted variants changed, so the canaries are admitted or
        dropped now; a failure is the leader's periodic replan's to make good."""
        if self._pools is None:
            return
        for name in sorted(names):
            try:
                self._pools.replan_if_changed(name, now=now, fence=fence)
            except FencedOut:
                raise
            except Exception:
                log.exception("replanning pool %s after a rollout step failed", name)

    @staticmethod
    def _revert(s: Session, rollout_id: int, reason: str, *, states: Sequence[str] | None = None) -> set[str]:
        """Members rolled back; the devices that run them (those that hand a camera over too)."""
        out: set[str] = set()
        every: list[RolloutDevice | RolloutCamera] = [
            *rollout_devices(s, rollout_id),
            *rollout_cameras(s, rollout_id),
        ]
        for m in every:
            if m.state == MemberState.ROLLED_BACK or (states is not None and m.state not in states):
                continue
            m.state = MemberState.ROLLED_BACK
            m.reason = reason if m.reason is None else f"{m.reason}; {reason}"
            m.settled_at = utcnow()
            s.add(m)
            out.add(m.device_id)
        return out - {""}

    @staticmethod
    def _camera_holders(s: Session, rollout_id: int) -> tuple[set[str], set[str]]:
        """The pools of the rollout's cameras, and every device that runs one of them (a handover's
        old device too)."""
        cams = rollout_cameras(s, rollout_id)
        if not cams:
            return set(), set()
        keys = {(c.pool, c.camera) for c in cams}
        rows = [
            p
            for p in s.exec(
                select(PoolPlacement).where(col(PoolPlacement.camera).in_(sorted({k[1] for k in keys})))
            )
            if (p.pool, p.camera) in keys
        ]
        devices = {p.device_id for p in rows} | {p.handover_from for p in rows if p.handover_from}
        return {c.pool for c in cams}, devices

    def _fill_targets(self, rollout_id: int) -> None:
        """Admitted devices whose new desired state is not recorded yet: publish and record it."""
        with Session(self._engine) as s:
            ro = s.get(Rollout, rollout_id)
            if ro is None:
                return
            dep = s.get(Deployment, ro.deployment_id)
            assert dep is not None
            pending = [m.device_id for m in rollout_devices(s, rollout_id) if m.target_version is None]
            cams = [
                (c.pool, c.camera)
                for c in rollout_cameras(s, rollout_id)
                if c.target_version is None and c.device_id and c.state == MemberState.APPLYING
            ]
        for pool, camera in cams:
            self._fill_camera(rollout_id, dep, pool, camera)
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
                self._leadership.fence(s)
                s.commit()

    def _fill_camera(self, rollout_id: int, dep: Deployment, pool: str, camera: str) -> None:
        """A camera member's desired version: the first of its device's desired states that gives it
        the deployment's version (none while its pool holds that version back), with the figures it
        is judged against: its FPS before (else the rate its plan gives it) and its latency there."""
        with Session(self._engine) as s:
            m = s.get(RolloutCamera, (rollout_id, pool, camera))
            device_id = m.device_id if m is not None else ""
        if not device_id:
            return
        self._twin.recompute(device_id)
        with Session(self._engine) as s:
            m = s.get(RolloutCamera, (rollout_id, pool, camera))
            dev = crud.get_device(s, device_id=device_id)
            row = s.get(PoolPlacement, (pool, camera))
            if m is None or dev is None or m.device_id != device_id or m.target_version is not None:
                return
            a = (dev.assignments or {}).get(camera) or {}
            if a.get("deployment") != dep.name or a.get("pool") != pool:
                return
            m.target_version = dev.desired_version
            health = {str(c.get("camera")): c for c in (dev.last_health or {}).get("cameras") or []}
            here = health.get(camera) or {}
            fps = here.get("fps")
            m.baseline_fps = float(fps) if fps else (row.fps if row is not None else None)
            found = camera_latency(here)
            m.baseline_latency_ms = found[0] if found is not None else None
            s.add(m)
            self._leadership.fence(s)
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
        plan_in = _checked_plan(selector, waves)
        with self._lock, Session(self._engine) as s:
            mv = crud.get_model_version(s, name=model, version=version)
            if mv is None:
                raise DeploymentModelNotFoundError(f"model {model!r} version {version!r} is not registered")
            try:
                choose(s, mv=mv, capabilities=None, pin=variant)
            except ConflictError as exc:
                raise DeploymentConflictError(str(exc)) from None
            if get_deployment(s, name) is not None:
                raise DeploymentConflictError(f"a deployment named {name!r} exists")
            dep = Deployment(
                name=name,
                model=model,
                version=version,
                variant=variant,
                selector=selector,
                cameras=list(cameras or [{"camera": "*"}]),
                priority=priority,
                state=DeploymentState.ROLLING_OUT,
            )
            return _add_with_rollout(s, dep, plan_in, gate)

    def create_agent(
        self,
        *,
        name: str,
        version: str,
        selector: str,
        priority: int = 0,
        waves: Sequence[int | str] | None = None,
        gate: GateConfig | None = None,
        health_timeout_s: float = AGENT_HEALTH_TIMEOUT_S,
    ) -> int:
        """A new agent deployment (kind ``agent``: the agent software ``version`` for the devices the
        selector matches) in state rolling_out with its rollout; returns the deployment id.

        The same waves, gates, operator actions and leader ticks as a model deployment; a member is
        active once it reports running ``version`` idle, failed when its agent reports the update
        failed or rolled back, and a failed gate sends the devices it reached back to the agent version
        each ran before, never one it refused or rolled back (controller.fleet.twin ``TwinService._agent``).
        """
        plan_in = _checked_plan(selector, waves)
        with self._lock, Session(self._engine) as s:
            if get_package(s, version) is None:
                raise DeploymentAgentNotFoundError(
                    f"agent version {version!r} is not uploaded (edgefleet agent-packages upload FILE)"
                )
            if get_deployment(s, name) is not None:
                raise DeploymentConflictError(f"a deployment named {name!r} exists")
            dep = Deployment(
                name=name,
                model="",
                version="",
                selector=selector,
                cameras=[],
                priority=priority,
                state=DeploymentState.ROLLING_OUT,
                kind=AGENT_KIND,
                agent_version=version,
                agent_health_timeout_s=health_timeout_s,
            )
            return _add_with_rollout(s, dep, plan_in, gate)

    # ------------------------------------------------------------------ operator actions

    def _operate(self, ref: str | int, fn: Callable[[Session, Deployment, Rollout], set[str]]) -> int:
        with self._lock:
            with Session(self._engine) as s:
                dep = get_deployment(s, ref)
                if dep is None or dep.id is None:
                    raise NotFoundError(f"deployment {ref!r} is not known")
                # The rollout's row first (a tick on another replica finishes its turn), then the
                # deployment as that tick left it.
                ro = _locked_rollout(s, deployment_id=dep.id)
                assert ro is not None
                s.refresh(dep)
                touched = fn(s, dep, ro)
                ro.updated_at = utcnow()
                s.add(ro)
                s.add(dep)
                s.commit()
                dep_id = dep.id
            self._follow(touched)
            return dep_id

    def _follow(self, touched: set[str]) -> None:
        """After an operator's action: replan the pools marked in ``touched`` (their cameras' wanted
        variants changed), then recompute the devices in it."""
        pools = {t[len(POOL_MARK) :] for t in touched if t.startswith(POOL_MARK)}
        # Any replica serves an operator, as it serves a pool's cordon: not leader work, not fenced.
        self._pools_changed(pools, self.clock(), fence=lambda s: None)
        self._twin.recompute_many({t for t in touched if t and not t.startswith(POOL_MARK)})

    def pause(self, ref: str | int) -> int:
        def fn(s: Session, dep: Deployment, ro: Rollout) -> set[str]:
            if ro.state == RolloutState.RUNNING:
                ro.state = RolloutState.PAUSED
            return set()

        return self._operate(ref, fn)

    def resume(self, ref: str | int) -> int:
        def fn(s: Session, dep: Deployment, ro: Rollout) -> set[str]:
            if ro.state == RolloutState.PAUSED:
                ro.state = RolloutState.RUNNING
            return set()

        return self._operate(ref, fn)

    def cancel(self, ref: str | int) -> int:
        """Stop: devices already active keep the deployment, devices still applying are reverted."""

        def fn(s: Session, dep: Deployment, ro: Rollout) -> set[str]:
            if ro.state not in LIVE_ROLLOUT_STATES:
                return set()
            assert ro.id is not None
            ro.state, ro.reason, ro.finished_at = (
                RolloutState.CANCELLED,
                "cancelled by the operator",
                utcnow(),
            )
            dep.state = DeploymentState.CANCELLED
            pools, held = self._camera_holders(s, ro.id)
            touched = self._revert(s, ro.id, "cancelled before it was active", states=_NOT_ACTIVE_YET)
            return touched | held | {f"{POOL_MARK}{p}" for p in pools}

        return self._operate(ref, fn)

    def rollback(self, ref: str | int) -> int:
        """Every device the deployment reached goes back to its previous layer, whatever the state."""

        def fn(s: Session, dep: Deployment, ro: Rollout) -> set[str]:
            assert ro.id is not None
            touched = {d.id for d in device_targets(s, dep)}
            pools, held = self._camera_holders(s, ro.id)
            touched |= held | {f"{POOL_MARK}{p}" for p in pools}
            touched |= self._revert(s, ro.id, "rolled back by the operator")
            touched |= {m.device_id for m in rollout_devices(s, ro.id)}
            # A failed rollout stays failed (its devices were sent back already); the rest is the
            # operator's roll back, once.
            if ro.state not in (RolloutState.FAILED, RolloutState.ROLLED_BACK):
                ro.state = RolloutState.ROLLED_BACK
                ro.reason = "rolled back by the operator"
            ro.finished_at = ro.finished_at or utcnow()
            if dep.state not in (DeploymentState.FAILED, DeploymentState.ROLLED_BACK):
                dep.state = DeploymentState.ROLLED_BACK
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
                if dep is None or dep.id is None or dep.state == DeploymentState.DELETED:
                    raise NotFoundError(f"deployment {ref!r} is not known")
                touched = {d.id for d in device_targets(s, dep)}
                # Also devices that no longer match but still carry its layer (belt and braces).
                touched |= {
                    d.id
                    for d in crud.devices_with_desired(s)
                    if any(a.get("deployment") == dep.name for a in (d.assignments or {}).values())
                }
                ro = _locked_rollout(s, deployment_id=dep.id)
                if ro is not None:
                    s.refresh(dep)
                    assert ro.id is not None
                    if ro.state in LIVE_ROLLOUT_STATES:
                        ro.state, ro.reason, ro.finished_at = RolloutState.CANCELLED, reason, utcnow()
                    pools, held = self._camera_holders(s, ro.id)
                    touched |= held | {f"{POOL_MARK}{p}" for p in pools}
                    touched |= self._revert(s, ro.id, reason, states=_NOT_ACTIVE_YET)
                    touched |= {m.device_id for m in rollout_devices(s, ro.id)}
                    ro.updated_at = utcnow()
                    s.add(ro)
                log.info("deployment %s (#%d) deleted; %d devices follow", dep.name, dep.id, len(touched))
                dep.state = DeploymentState.DELETED
                dep.name = f"~{dep.id}~{dep.name}"[:64]
                s.add(dep)
                s.commit()
            self._follow(touched)
        return {t for t in touched if t and not t.startswith(POOL_MARK)}


def _add_with_rollout(
    s: Session, dep: Deployment, plan_in: Sequence[int | str], gate: GateConfig | None
) -> int:
    """Store ``dep`` with its rollout (the wave plan over the devices it matches now); its id."""
    s.add(dep)
    s.flush()
    assert dep.id is not None
    # Waves count members: the devices it reaches (for their own cameras) and the pool cameras it names.
    n = len(device_targets(s, dep)) + len(pool_targets(s, dep))
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


def _checked_plan(selector: str, waves: Sequence[int | str] | None) -> list[int | str]:
    """The wave plan as asked, once the selector and the waves are known to be valid."""
    try:
        parse_selector(selector)
    except SelectorError as exc:
        raise DeploymentInvalidError(f"selector: {exc}") from None
    try:
        plan_in = [parse_wave(w) for w in (waves if waves is not None else DEFAULT_WAVES)]
    except ValueError as exc:
        raise DeploymentInvalidError(f"waves: {exc}") from None
    if not plan_in:
        raise DeploymentInvalidError("waves: at least one wave")
    return plan_in
