"""Deployments: which model each camera of a device must run, layered by priority.

The desired state of a device is derived, never edited: for each camera the highest-priority
deployment that applies to the device wins, and the device's direct assignment is the bottom layer.
A deployment applies to a device when its selector matches the device's labels and

- it is ``active``: every matching device, also ones that start to match later;
- it is ``rolling_out``: only devices its rollout admitted (``applying`` or ``active``);
- it is ``cancelled``: only devices on which its rollout had already become ``active``;
- ``failed`` / ``rolled_back`` / ``deleted``: none.

A deployment of kind ``agent`` carries an agent version instead of a model: the same
selector, states and rollout, but it makes the device's agent layer (:func:`agent_layer`), not a
camera's.

A camera of a pool (``controller.fleet.pools``) that a deployment names by id is the deployment's
target wherever its pool places it, whatever the selector (which chooses devices for the devices'
own cameras): the rollout admits the camera itself (``rollout_camera``), so the layer follows the
camera from device to device (:func:`pool_camera_layers`), and the pool's plan admits the new version
on the device only where its cost fits (``pool_placement.canary``). A deployment that names only pool
cameras has no device member.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col, select

from controller.db.states import DeploymentState, DeviceStatus, MemberState
from controller.db.tables import Deployment, Device, PoolCamera, Rollout, RolloutCamera, RolloutDevice
from controller.fleet.selectors import Op, Requirement, Selector, SelectorError, parse_selector

APPLIED_STATES = (DeploymentState.ACTIVE, DeploymentState.ROLLING_OUT, DeploymentState.CANCELLED)
ADMITTED = (MemberState.APPLYING, MemberState.ACTIVE)
ANY_CAMERA = "*"
MODEL_KIND, AGENT_KIND = "model", "agent"  # Deployment.kind
AGENT_HEALTH_TIMEOUT_S = 120.0  # AgentPackageRef.health_timeout_s unless the deployment says otherwise


@dataclass(frozen=True)
class Layer:
    """What one camera must run, and which layer said so."""

    source: str  # "direct", "deployment", or "pool" (the device's desired state adds pool cameras)
    deployment_id: int | None
    deployment: str | None
    model: str
    version: str
    pin: str
    threshold: float | None = None
    max_fps: float | None = None
    labels: list[str] | None = None
    label_thresholds: dict[str, float] | None = None
    min_box_area: float | None = None
    zones: list[dict[str, Any]] | None = None
    lines: list[dict[str, Any]] | None = None
    motion: dict[str, Any] | None = None

    def key(self) -> tuple[Any, ...]:
        return (
            self.model,
            self.version,
            self.pin,
            self.threshold,
            self.max_fps,
            self.labels,
            self.label_thresholds,
            self.min_box_area,
            self.zones,
            self.lines,
            self.motion,
        )


def camera_settings(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A camera's settings as a direct assignment or a deployment's camera entry stores them (the
    keywords of :class:`Layer`; an entry stored before a setting existed lacks it: None)."""
    return {
        "threshold": entry.get("threshold"),
        "max_fps": entry.get("max_fps"),
        "labels": entry.get("labels"),
        "label_thresholds": entry.get("label_thresholds"),
        "min_box_area": entry.get("min_box_area"),
        "zones": entry.get("zones"),
        "lines": entry.get("lines"),
        "motion": entry.get("motion"),
    }


def selector_of(dep: Deployment) -> Selector | None:
    try:
        return parse_selector(dep.selector)
    except SelectorError:
        return None


def matches(dep: Deployment, labels: Mapping[str, str]) -> bool:
    sel = selector_of(dep)
    return sel is not None and sel.matches(labels)


def device_cameras(dev: Device) -> list[str]:
    cams = (dev.capabilities or {}).get("cameras") or []
    return [str(c) for c in cams]


def deployment_cameras(dep: Deployment, known: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per camera of a device with cameras ``known``: this deployment's settings (a named entry
    beats ``*``)."""
    out: dict[str, dict[str, Any]] = {}
    entries = dep.cameras or [{"camera": ANY_CAMERA}]
    for e in entries:
        if e.get("camera", ANY_CAMERA) == ANY_CAMERA:
            for cam in known:
                out.setdefault(cam, e)
    for e in entries:
        cam = e.get("camera", ANY_CAMERA)
        if cam != ANY_CAMERA:
            out[str(cam)] = e
    return out


def applies(dep: Deployment, dev: Device, admitted: Mapping[int, str]) -> bool:
    """``admitted``: deployment id → this device's rollout state for that deployment."""
    if dep.state not in APPLIED_STATES or not matches(dep, dev.labels or {}):
        return False
    if dep.state == DeploymentState.ACTIVE:
        return True
    state = admitted.get(dep.id or -1)
    if dep.state == DeploymentState.ROLLING_OUT:
        return state in ADMITTED
    return state == MemberState.ACTIVE  # cancelled: devices it had reached keep it


def layers(dev: Device, deployments: Iterable[Deployment], admitted: Mapping[int, str]) -> dict[str, Layer]:
    """The winning layer per camera of ``dev``."""
    out: dict[str, Layer] = {}
    for cam, d in sorted((dev.direct or {}).items()):
        if d.get("model") and d.get("version"):
            out[cam] = Layer(
                source="direct",
                deployment_id=None,
                deployment=None,
                model=str(d["model"]),
                version=str(d["version"]),
                pin=str(d.get("pin") or "auto"),
                **camera_settings(d),
            )
    known = device_cameras(dev)
    # Lowest first, so that higher priority (then the newer deployment) overwrites.
    ordered = sorted(deployments, key=lambda x: (x.priority, x.id or 0))
    for dep in ordered:
        if dep.kind == AGENT_KIND or not applies(dep, dev, admitted):
            continue
        for cam, e in deployment_cameras(dep, known).items():
            out[cam] = Layer(
                source="deployment",
                deployment_id=dep.id,
                deployment=dep.name,
                model=dep.model,
                version=dep.version,
                pin=dep.variant,
                **camera_settings(e),
            )
    return out


@dataclass(frozen=True)
class AgentLayer:
    """The agent version a device must run, and which layer said so."""

    version: str
    source: str  # "direct" or "deployment"
    deployment: str | None = None
    health_timeout_s: float = AGENT_HEALTH_TIMEOUT_S


def agent_layer(
    dev: Device, deployments: Iterable[Deployment], admitted: Mapping[int, str]
) -> AgentLayer | None:
    """The winning agent layer of ``dev``: the highest-priority agent deployment that applies to it
    (then the newer one), else the operator's direct version; None: no layer says anything."""
    ordered = sorted(deployments, key=lambda x: (x.priority, x.id or 0), reverse=True)
    for dep in ordered:
        if dep.kind == AGENT_KIND and dep.agent_version and applies(dep, dev, admitted):
            return AgentLayer(
                version=dep.agent_version,
                source="deployment",
                deployment=dep.name,
                health_timeout_s=dep.agent_health_timeout_s or AGENT_HEALTH_TIMEOUT_S,
            )
    direct = (dev.agent_desired or {}).get("direct")
    if isinstance(direct, str) and direct:
        timeout = (dev.agent_desired or {}).get("direct_health_timeout_s")
        return AgentLayer(
            version=direct,
            source="direct",
            health_timeout_s=float(timeout) if isinstance(timeout, int | float) else AGENT_HEALTH_TIMEOUT_S,
        )
    return None


# --------------------------------------------------------------------------- database


def applied_deployments(s: Session) -> list[Deployment]:
    return list(s.exec(select(Deployment).where(col(Deployment.state).in_(APPLIED_STATES))).all())


def admitted_for(s: Session, device_id: str) -> dict[int, str]:
    q = (
        select(Rollout.deployment_id, RolloutDevice.state)
        .join(RolloutDevice, col(RolloutDevice.rollout_id) == col(Rollout.id))
        .where(col(RolloutDevice.device_id) == device_id)
    )
    return {int(dep_id): str(state) for dep_id, state in s.exec(q).all()}


def get_deployment(s: Session, ref: str | int) -> Deployment | None:
    """By id or by name."""
    # The id column is a 32-bit INTEGER: a longer number is a name (or nothing), never a query error.
    if (isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit())) and 0 < int(ref) < 2**31:
        dep = s.get(Deployment, int(ref))
        if dep is not None:
            return dep
    return s.exec(select(Deployment).where(col(Deployment.name) == str(ref))).first()


def list_deployments(s: Session, *, include_deleted: bool = False) -> list[Deployment]:
    q = select(Deployment)
    if not include_deleted:
        q = q.where(col(Deployment.state) != DeploymentState.DELETED)
    return list(s.exec(q.order_by(col(Deployment.id))).all())


def rollout_of(s: Session, deployment_id: int) -> Rollout | None:
    return s.exec(select(Rollout).where(col(Rollout.deployment_id) == deployment_id)).first()


def rollout_devices(s: Session, rollout_id: int) -> list[RolloutDevice]:
    return list(
        s.exec(
            select(RolloutDevice)
            .where(col(RolloutDevice.rollout_id) == rollout_id)
            .order_by(col(RolloutDevice.wave), col(RolloutDevice.device_id))
        ).all()
    )


def _requirement_sql(r: Requirement) -> sa.ColumnElement[bool]:
    # Label values are strings (controller.types.check_labels), so a missing key reads as NULL.
    value = col(Device.labels)[r.key].as_string()
    match r.op:
        case Op.EQ | Op.IN:
            return value.in_(sorted(r.values))
        case Op.NE | Op.NOTIN:
            return sa.or_(value.is_(None), value.not_in(sorted(r.values)))
        case Op.EXISTS:
            return value.is_not(None)
        case Op.NOT_EXISTS:
            return value.is_(None)
    raise AssertionError(r.op)  # pragma: no cover - exhaustive above


def selector_sql(sel: Selector) -> sa.ColumnElement[bool]:
    """``sel`` as a SQL predicate on ``device.labels`` (SQLite and PostgreSQL JSON), so that only the
    matching devices leave the database; ``Selector.matches`` stays the rule and is applied again."""
    return sa.and_(sa.true(), *(_requirement_sql(r) for r in sel.requirements))


def matching_devices(s: Session, dep: Deployment, *, exclude: Iterable[str] = ()) -> list[Device]:
    """The devices the deployment's selector matches, by id, less ``exclude``: selected in SQL."""
    sel = selector_of(dep)
    if sel is None:
        return []
    skip = set(exclude)
    # A decommissioned device is in no deployment's waves.
    q = (
        select(Device)
        .where(selector_sql(sel), col(Device.status) != DeviceStatus.DECOMMISSIONED)
        .order_by(col(Device.id))
    )
    return [d for d in s.exec(q).all() if d.id not in skip and sel.matches(d.labels or {})]


# --------------------------------------------------------------------------- pool cameras


def named_cameras(dep: Deployment) -> set[str]:
    """The camera ids a deployment names one by one (not ``*``)."""
    return {str(e["camera"]) for e in dep.cameras or [] if e.get("camera", ANY_CAMERA) != ANY_CAMERA}


def pool_targets(s: Session, dep: Deployment) -> list[PoolCamera]:
    """The pool cameras a model deployment names, by pool and camera."""
    named = named_cameras(dep)
    if dep.kind == AGENT_KIND or not named:
        return []
    q = select(PoolCamera).where(col(PoolCamera.camera).in_(sorted(named)))
    return list(s.exec(q.order_by(col(PoolCamera.pool), col(PoolCamera.camera))).all())


def covers_device_cameras(dep: Deployment, pool_cameras: Iterable[PoolCamera]) -> bool:
    """Whether the deployment reaches the devices' own cameras too: a ``*`` entry, or a named camera
    that is no pool's. Without, its rollout has no device member."""
    if dep.kind == AGENT_KIND:
        return True
    entries = dep.cameras or [{"camera": ANY_CAMERA}]
    if any(e.get("camera", ANY_CAMERA) == ANY_CAMERA for e in entries):
        return True
    return bool(named_cameras(dep) - {c.camera for c in pool_cameras})


def device_targets(s: Session, dep: Deployment, *, exclude: Iterable[str] = ()) -> list[Device]:
    """The devices a deployment's rollout may admit: those its selector matches, when it reaches the
    devices' own cameras at all."""
    if not covers_device_cameras(dep, pool_targets(s, dep)):
        return []
    return matching_devices(s, dep, exclude=exclude)


def pool_camera_ids(s: Session, deployments: Iterable[Deployment]) -> set[str]:
    """Of the cameras these deployments name one by one, those some pool declares."""
    named = set().union(*(named_cameras(d) for d in deployments if d.kind != AGENT_KIND))
    if not named:
        return set()
    return set(s.exec(select(PoolCamera.camera).where(col(PoolCamera.camera).in_(sorted(named)))).all())


def pool_camera_layers(
    s: Session, deployments: Iterable[Deployment], cameras: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], Layer]:
    """Per (pool, camera): the layer of the deployment that wants the camera, if any. A deployment
    that names it applies to it when ``active``, while ``rolling_out`` once its rollout admitted the
    camera (applying or active), when ``cancelled`` if the camera had become active; the highest
    priority, then the newer, wins."""
    wanted = set(cameras)
    deps = [d for d in deployments if d.kind != AGENT_KIND and d.state in APPLIED_STATES and named_cameras(d)]
    if not wanted or not deps:
        return {}
    admitted: dict[tuple[int, str, str], str] = {}
    if any(d.state != DeploymentState.ACTIVE for d in deps):
        q = (
            select(Rollout.deployment_id, RolloutCamera.pool, RolloutCamera.camera, RolloutCamera.state)
            .join(RolloutCamera, col(RolloutCamera.rollout_id) == col(Rollout.id))
            .where(col(RolloutCamera.camera).in_(sorted({c for _, c in wanted})))
        )
        admitted = {(int(i), p, c): str(st) for i, p, c, st in s.exec(q).all()}
    out: dict[tuple[str, str], Layer] = {}
    for dep in sorted(deps, key=lambda x: (x.priority, x.id or 0)):
        entries = {str(e.get("camera")): e for e in dep.cameras or []}
        for pool, cam in sorted(wanted):
            e = entries.get(cam)
            if e is None:
                continue
            state = admitted.get((dep.id or -1, pool, cam))
            if dep.state == DeploymentState.ROLLING_OUT and state not in ADMITTED:
                continue
            if dep.state == DeploymentState.CANCELLED and state != MemberState.ACTIVE:
                continue
            out[(pool, cam)] = Layer(
                source="deployment",
                deployment_id=dep.id,
                deployment=dep.name,
                model=dep.model,
                version=dep.version,
                pin=dep.variant,
                threshold=e.get("threshold"),
                max_fps=e.get("max_fps"),
                labels=e.get("labels"),
            )
    return out


def rollout_cameras(s: Session, rollout_id: int) -> list[RolloutCamera]:
    return list(
        s.exec(
            select(RolloutCamera)
            .where(col(RolloutCamera.rollout_id) == rollout_id)
            .order_by(col(RolloutCamera.wave), col(RolloutCamera.pool), col(RolloutCamera.camera))
        ).all()
    )
