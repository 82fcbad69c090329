"""Camera pools as desired state: a site's cameras, declared once, placed on the devices a selector
matches by the pure planner (``controller.fleet.placement``).

A pool is a declaration (selector, policy, cameras) and the operator's actions on it: cordon a
device (it takes no new camera, those it runs stay), drain one (cordoned, and its cameras are planned
elsewhere with the reason ``cordoned``), uncordon, and move a camera (a pin: only that device; the
planner moves it there when it fits, under the pool's rate limit). Every one of those changes, and
every declaration, is followed by a replan in the same transaction: the snapshot is loaded from the
database (:func:`load_snapshot`), planned, and the placements stored in ``pool_placement``, with one
``camera_moved`` event per move. A dry run plans the same snapshot with some devices taken as offline
and writes nothing.

The snapshot, device by device: the enrolled devices the selector matches; online from their
presence (an offline device still inside ``failover_grace_s`` keeps its cameras but takes no new
one); hardware class, inference lanes and CPU from their capabilities; costs measured from their last
heartbeat (:func:`heartbeat_costs`), else the registry's figure for the model version, else a
conservative default.

Besides the operator's changes, the leader replans every pool on its own (:class:`PoolReplanner`, every
``pool_replan_interval_s``): a device offline past the grace, gone from the selector or overloaded
loses cameras, and failback happens after its dwell, without waiting for the next change. A round
that would change nothing writes nothing, so a quiet fleet costs one read per pool a round.

Rollouts act on pool cameras one camera at a time (``controller.fleet.deployments``): the variant a
deployment wants for a camera is the camera's canary, which the plan admits where the camera runs only
if its cost fits (``pool_placement.canary``), and otherwise holds with the reason
(``pool_placement.canary_held``, and the live plan's ``canary_held``); the twin gives a camera the
deployment's version only once its placement admitted it.

The placements reach the devices through their desired state (``controller.fleet.twin``): each
device's pool cameras, with source, model and FPS, so that an agent starts the cameras it gains and
stops those it loses at its next apply; a planned move keeps the camera on its old device until the
new one reports it running (make-before-break).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, delete, select
from sqlmodel.sql.expression import SelectOfScalar

from controller.db import crud
from controller.db.leader import ALWAYS_LEADER, FencedOut, LeaderLoop, Leadership
from controller.db.states import DeviceStatus
from controller.db.tables import (
    SOURCE_CONTROLLER,
    Device,
    Event,
    Pool,
    PoolCamera,
    PoolDevice,
    PoolPlacement,
    SupersededAnalysis,
    utcnow,
)
from controller.errors import ConflictError, InvalidError, NotFoundError
from controller.fleet import placement
from controller.fleet.deployments import applied_deployments, pool_camera_layers
from controller.fleet.selectors import Selector, SelectorError, parse_selector
from controller.observe.clock import device_clock_offset
from controller.types import NO_NUL_PATTERN, CameraId, DeviceId, Name, valid_id
from fleet_protocol.sources import MAX_SOURCE_LEN, SECRET_REF, SOURCE_SCHEMES

log = logging.getLogger(__name__)

EVENT_MOVED = "camera_moved"
EVENT_HANDOVER = "camera_handover"
# Moves whose old device cannot keep the camera while the new one starts it: it is gone, or cannot
# reach the source. Every other move is make-before-break (a handover).
BREAK_FIRST = frozenset(
    {placement.MoveReason.DEVICE_OFFLINE, placement.MoveReason.DEVICE_GONE, placement.MoveReason.UNREACHABLE}
)
# A handover whose new device has not reported the camera running by then ends all the same: the old
# device stops, and the new one's failure (reported, in its desired state's sync) is the operator's to see.
HANDOVER_TIMEOUT_S = 120.0
SOURCE_MAX = MAX_SOURCE_LEN
MAX_FPS = 240.0
MAX_CAMERAS = 1000
MAX_FAIL = 1000
RECENT_EVENTS = 20
# A model version with no latency figure of the controller's and nothing measured on any device:
# assume a slow one (40 ms a frame on the lane and on the CPU), so a first plan never overfills a device.
DEFAULT_PRIOR = placement.Cost(infer_ms=40.0, cpu_ms=40.0)
# Longer than any inference a heartbeat can sensibly report: a larger figure is a broken sample.
_MS_MAX = 60_000.0
# A variant's figure made of fewer production frames is the plain mean of a few runs (the agent's
# smoothing starts so, PROTOCOL.md "Heartbeat"), and one run early on, a model just loaded beside
# others, can be far off: a camera evicted or placed on it is moved by noise, and moved again once
# the figure settles. Until then the variant counts as not measured on that device.
MIN_COST_FRAMES = 10
# Query parameters that carry a credential in camera URLs (snapshot CGIs, some RTSP servers).
_CREDENTIAL_PARAMS = frozenset(
    {"password", "passwd", "pwd", "pass", "secret", "token", "access_token", "api_key", "apikey", "auth"}
)
_REFERENCE_FORM = "rtsp://{secret:NAME}@host/path (NAME is resolved on the device)"


class PoolInvalidError(InvalidError):
    """A declaration that cannot be stored: its selector, a camera's source, frame rates or ids.
    ``loc`` is where in the declaration, as a validation error's location."""

    def __init__(self, message: str, *loc: str | int) -> None:
        super().__init__(message)
        self.loc = loc


# --------------------------------------------------------------------------- the declaration


class PoolCameraSpec(BaseModel):
    """One camera of a pool's declaration."""

    model_config = ConfigDict(extra="forbid")

    id: CameraId = Field(description="camera id, unique in the pool")
    source: str = Field(
        min_length=1,
        max_length=SOURCE_MAX,
        description="rtsp, rtsps, http, https or file URL. Credentials are never stored: the userinfo is "
        "absent or exactly one {secret:NAME} reference, resolved on the device "
        "(rtsp://{secret:NAME}@host/path); a literal password is refused",
    )
    model: Name = Field(description="registered model name")
    version: Name = Field(description="registered model version")
    target_fps: float = Field(gt=0.0, le=MAX_FPS, allow_inf_nan=False)
    min_fps: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_FPS,
        allow_inf_nan=False,
        description="the lowest FPS it may be degraded to (at most target_fps); default target_fps",
    )
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000, description="higher runs first")
    spread_group: Name | None = Field(
        default=None, description="cameras of one group go to different devices where they can"
    )
    prefer: DeviceId | None = Field(default=None, description="the device it runs on when it can")


class PoolPolicy(BaseModel):
    """How a pool places its cameras (``controller.fleet.placement``)."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["spread", "pack", "energy"] = Field(
        default="spread", description="spread: even load; pack: fewest devices; energy: fewest joules"
    )
    headroom: float = Field(
        default=0.8, gt=0.0, le=1.0, allow_inf_nan=False, description="share of a device's capacity to use"
    )
    reserve_n1: bool = Field(
        default=False, description="keep room to take any one device's cameras (new cameras wait otherwise)"
    )
    failover_grace_s: float = Field(
        default=10.0,
        ge=0.0,
        le=86_400.0,
        allow_inf_nan=False,
        description="how long an offline device keeps its cameras before a plan moves them",
    )
    failback: Literal["never", "preferred"] = Field(
        default="never", description="preferred: a camera goes back to its preferred device once it is back"
    )
    max_moves_per_min: int = Field(
        default=5, ge=0, le=10_000, description="cap on moves that are not failures (failback, manual)"
    )
    min_dwell_s: float = Field(
        default=600.0,
        ge=0.0,
        le=7 * 86_400.0,
        allow_inf_nan=False,
        description="how long a camera stays, and a device stays up, before failback",
    )


class PoolDeclaration(PoolPolicy):
    """A pool as declared: the devices (a selector), the policy and the cameras; it replaces the one of
    that name. The operator's cordons and pins are kept across declarations."""

    name: Name | None = Field(default=None, description="the pool's name; when given, the one in the path")
    selector: str = Field(
        default="",
        max_length=2000,
        pattern=NO_NUL_PATTERN,
        description="label selector of the pool's devices (as deployments'); empty matches every device",
    )
    cameras: list[PoolCameraSpec] = Field(default_factory=list, max_length=MAX_CAMERAS)


def source_problem(url: str) -> str | None:
    """What is wrong with a camera source URL, or None. The answer never repeats the URL: it may
    carry a password."""
    if any(ord(ch) <= 0x20 or ord(ch) == 0x7F for ch in url):
        return "must not contain spaces or control characters"
    try:
        url.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no database column can hold it
        return "must be valid Unicode text"
    try:
        parts = urlsplit(url)
    except ValueError:
        return "is not a valid URL"
    scheme = parts.scheme.lower()
    if scheme not in SOURCE_SCHEMES:
        return f"scheme must be one of {', '.join(SOURCE_SCHEMES)}"
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at and not SECRET_REF.fullmatch(userinfo):
        if ":" in userinfo and "{secret:" not in userinfo:
            return (
                "has a password in it, and credentials are never stored: keep the password in a secret on "
                f"the device and use a reference, {_REFERENCE_FORM}"
            )
        return f"userinfo must be exactly one {{secret:NAME}} reference, or none: {_REFERENCE_FORM}"
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key.lower() in _CREDENTIAL_PARAMS and value and not SECRET_REF.fullmatch(value):
            return (
                f"has a credential in its query ({key}), and credentials are never stored: "
                f"use a reference as its value, {key}={{secret:NAME}}"
            )
    try:
        port = parts.port
    except ValueError:
        return "has an invalid port"
    if port == 0:
        return "has an invalid port"
    if scheme == "file":
        if not parts.path:
            return "a file source needs a path (file:///path/to/video.mp4)"
    elif not parts.hostname:
        return "needs a host"
    return None


def _check_declaration(s: Session, name: str, decl: PoolDeclaration) -> None:
    """Everything a declaration must satisfy beyond its fields' own rules."""
    if decl.name is not None and decl.name != name:
        raise PoolInvalidError(f"name: the declaration names pool {decl.name!r}, the path {name!r}", "name")
    try:
        parse_selector(decl.selector)
    except SelectorError as exc:
        raise PoolInvalidError(f"selector: {exc}", "selector") from None
    seen: set[str] = set()
    for i, cam in enumerate(decl.cameras):
        where = f"cameras[{i}] ({cam.id})"
        if cam.id in seen:
            raise PoolInvalidError(f"{where}: camera id {cam.id!r} is declared twice", "cameras", i, "id")
        seen.add(cam.id)
        if (why := source_problem(cam.source)) is not None:
            raise PoolInvalidError(f"{where}.source {why}", "cameras", i, "source")
        if cam.min_fps is not None and cam.min_fps > cam.target_fps:
            raise PoolInvalidError(
                f"{where}.min_fps: {cam.min_fps:g} is above target_fps {cam.target_fps:g}",
                "cameras",
                i,
                "min_fps",
            )
    for model, version in sorted({(c.model, c.version) for c in decl.cameras}):
        if crud.get_model_version(s, name=model, version=version) is None:
            users = [c.id for c in decl.cameras if (c.model, c.version) == (model, version)]
            raise NotFoundError(f"model version {model}:{version} (camera {users[0]}) is not registered")
    _check_shared_ids(s, name, decl)


def _check_shared_ids(s: Session, name: str, decl: PoolDeclaration) -> None:
    """Refuse a camera id that another pool declares on a device both pools' selectors match now: a
    device runs one camera per id, so one of the two would go unwatched there. Pools over devices
    that share none (two sites each with its "door-1") are fine; a device relabelled later into both
    keeps the first pool's camera by name, and the other is logged (:func:`placed_on`)."""
    ids = [c.id for c in decl.cameras]
    if not ids:
        return
    shared = s.exec(
        select(PoolCamera.pool, PoolCamera.camera)
        .where(col(PoolCamera.pool) != name)
        .where(col(PoolCamera.camera).in_(ids))
        .order_by(col(PoolCamera.pool), col(PoolCamera.camera))
    ).all()
    if not shared:
        return
    devices = crud.list_devices(s)
    ours = {d.id for d in matching(devices, parse_selector(decl.selector))}
    selectors = {
        p.name: p.selector for p in s.exec(select(Pool).where(col(Pool.name).in_({p for p, _ in shared})))
    }
    for other, cam in shared:
        try:
            theirs = {d.id for d in matching(devices, parse_selector(selectors.get(other, "")))}
        except SelectorError:
            continue  # a stored selector this controller cannot read matches nothing of ours
        both = sorted(ours & theirs)
        if both:
            i = ids.index(cam)
            raise ConflictError(
                f"cameras[{i}] ({cam}): pool {other!r} declares camera {cam!r} too, and device {both[0]!r} "
                "is in both pools: give the camera another id in one of them"
            )


@dataclass(frozen=True)
class PlacedCamera:
    """A pool camera as the device it is placed on must run it (its desired state's entry)."""

    pool: str
    camera: str
    source: str
    model: str
    version: str
    fps: float
    canary: str | None = None  # the canary variant its placement admitted ("model/version")


def placed_on(s: Session, device_id: str) -> dict[str, PlacedCamera]:
    """The pool cameras the stored plans give ``device_id``, by camera id, with those it hands over (it
    runs them until their new device does). Two pools that place the same camera id on one device: the
    first pool by name keeps it (one desired entry per camera id), and the other is logged."""
    rows = s.exec(
        select(PoolCamera, PoolPlacement)
        .join(
            PoolPlacement,
            sa.and_(
                col(PoolPlacement.pool) == col(PoolCamera.pool),
                col(PoolPlacement.camera) == col(PoolCamera.camera),
            ),
        )
        .where(
            sa.or_(col(PoolPlacement.device_id) == device_id, col(PoolPlacement.handover_from) == device_id)
        )
        .order_by(col(PoolCamera.pool), col(PoolCamera.camera))
    ).all()
    out: dict[str, PlacedCamera] = {}
    for cam, where in rows:
        kept = out.get(cam.camera)
        if kept is not None:
            log.warning(
                "pools %s and %s both place camera %s on %s: %s keeps it",
                kept.pool,
                cam.pool,
                cam.camera,
                device_id,
                kept.pool,
            )
            continue
        out[cam.camera] = PlacedCamera(
            cam.pool, cam.camera, cam.source, cam.model, cam.version, where.fps, where.canary
        )
    return out


def probe_for(s: Session, dev: Device, *, limit: int) -> dict[str, str]:
    """The pool cameras ``dev`` could be given (those of the pools whose selector matches it, placed on
    another device or on none) by camera id, with their sources: what it probes. At most ``limit``,
    the highest priority first. The first pool by name keeps a camera id two pools declare."""
    found: list[tuple[int, str, str]] = []
    seen: set[str] = set()
    for pool in s.exec(select(Pool).order_by(col(Pool.name))):
        try:
            if not matching([dev], parse_selector(pool.selector)):
                continue
        except SelectorError:
            continue
        placed = dict(
            s.exec(
                select(PoolPlacement.camera, PoolPlacement.device_id).where(
                    col(PoolPlacement.pool) == pool.name
                )
            ).all()
        )
        for cam in s.exec(select(PoolCamera).where(col(PoolCamera.pool) == pool.name)):
            if cam.camera in seen:
                continue
            seen.add(cam.camera)
            if placed.get(cam.camera) != dev.id:
                found.append((-cam.priority, cam.camera, cam.source))
    return {cam: source for _, cam, source in sorted(found)[:limit]}


# --------------------------------------------------------------------------- the snapshot


variant_key = placement.variant_key


def _variant(value: Any) -> str | None:
    """``model/version`` from a heartbeat's ``model/version`` or ``model:version``; None if malformed."""
    if not isinstance(value, str):
        return None
    for sep in ("/", ":"):
        model, found, version = value.partition(sep)
        if found:
            return variant_key(model, version) if valid_id(model) and valid_id(version) else None
    return None


def _ms(value: Any, *, zero_ok: bool = False) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    x = float(value)
    if not math.isfinite(x) or x > _MS_MAX or x < 0 or (x == 0 and not zero_ok):
        return None
    return x


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def heartbeat_reach(health: Any) -> dict[str, bool]:
    """Per probed camera, whether the device that sent this heartbeat reached its source (its JSON as
    stored; anything malformed is left out, and a camera left out counts as reachable)."""
    reach = health.get("reach") if isinstance(health, Mapping) else None
    if not isinstance(reach, Mapping):
        return {}
    return {str(cam): ok for cam, ok in reach.items() if isinstance(ok, bool)}


def heartbeat_costs(health: Any, *, cpu_only: bool) -> dict[str, placement.Cost]:
    """Per variant, what one frame costs on the device that sent this heartbeat (its JSON as stored).

    The agent's own figures (``costs``: variant, infer_ms, cpu_ms) come first; a variant they do not
    name takes the median ``inference_ms`` of the cameras that run it. A figure made of fewer than
    ``MIN_COST_FRAMES`` frames is left out, its variant's cameras' times with it (no count, or 0, from
    an agent that does not say: taken as it is). A zero inference time is no measurement (nothing runs
    in no time) and is skipped. Anything missing or malformed
    is skipped, never an error: a heartbeat of an older or newer agent must not stop a plan. A camera's
    inference time is CPU time too on a device without a GPU (the CPU provider runs it), none on one
    with a GPU when the agent does not say.
    """
    if not isinstance(health, Mapping):
        return {}
    out: dict[str, placement.Cost] = {}
    early: set[str] = set()  # variants the agent names with too few frames behind their figure
    for entry in _items(health.get("costs")):
        if not isinstance(entry, Mapping):
            continue
        variant, infer = _variant(entry.get("variant")), _ms(entry.get("infer_ms"))
        if variant is None or infer is None or variant in out:
            continue
        frames = entry.get("frames")
        if isinstance(frames, int) and not isinstance(frames, bool) and 0 < frames < MIN_COST_FRAMES:
            early.add(variant)
            continue
        cpu = _ms(entry.get("cpu_ms"), zero_ok=True)
        out[variant] = placement.Cost(
            infer_ms=infer, cpu_ms=cpu if cpu is not None else (infer if cpu_only else 0.0)
        )
    seen: dict[str, list[float]] = {}
    for cam in _items(health.get("cameras")):
        if not isinstance(cam, Mapping):
            continue
        variant, infer = _variant(cam.get("model")), _ms(cam.get("inference_ms"))
        if variant is not None and infer is not None and variant not in out and variant not in early:
            seen.setdefault(variant, []).append(infer)
    for variant, samples in seen.items():
        ms = statistics.median(samples)
        out[variant] = placement.Cost(infer_ms=ms, cpu_ms=ms if cpu_only else 0.0)
    return out


def heartbeat_decode_ms(health: Any) -> dict[str, float]:
    """Per camera of the heartbeat: the CPU time its capture thread spends reading and decoding a frame
    (``CameraStats.decode_ms``), where reported and sane."""
    if not isinstance(health, Mapping):
        return {}
    out: dict[str, float] = {}
    for cam in _items(health.get("cameras")):
        if isinstance(cam, Mapping) and isinstance(cam.get("camera"), str):
            ms = _ms(cam.get("decode_ms"), zero_ok=True)
            if ms is not None:
                out[cam["camera"]] = ms
    return out


@dataclass(frozen=True)
class Hardware:
    hw_class: str  # devices of one class share measured costs
    lanes: int  # inference lanes: one per GPU, or the CPU's one
    cores: int
    gpu: bool


def hardware(capabilities: Any) -> Hardware:
    """A device's class and capacity from its birth's capabilities (defaults where unreported: one
    core, one lane, an unknown class shared with no one)."""
    caps = capabilities if isinstance(capabilities, Mapping) else {}
    gpus = [g for g in _items(caps.get("gpus")) if isinstance(g, Mapping) and isinstance(g.get("name"), str)]
    count = caps.get("cpu_count")
    cores = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
    if gpus:
        return Hardware(f"gpu:{gpus[0]['name']}", len(gpus), cores, True)
    cpu = caps.get("cpu_model")
    return Hardware(f"cpu:{cpu}" if isinstance(cpu, str) and cpu else "cpu:unknown", 1, cores, False)


def _epoch(dt: datetime) -> float:
    return dt.timestamp()


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


@dataclass(frozen=True)
class Member:
    """A device of a pool (its selector matches it) as the operator sees it."""

    id: str
    status: str  # a DeviceStatus
    in_grace: bool  # offline for less than the pool's failover_grace_s: keeps its cameras
    cordoned: bool
    draining: bool

    @property
    def online(self) -> bool:
        return self.status == DeviceStatus.ONLINE


@dataclass(frozen=True)
class Snapshot:
    """What one plan of a pool is made from, and the rows it was read from."""

    pool: Pool
    cameras: list[PoolCamera]
    members: dict[str, Member]
    placements: dict[str, PoolPlacement]
    site: placement.Site


def matching(devices: Iterable[Device], selector: Selector) -> list[Device]:
    """The enrolled, not decommissioned devices a selector matches, by id."""
    return sorted(
        (
            d
            for d in devices
            if d.enrolled and d.status != DeviceStatus.DECOMMISSIONED and selector.matches(d.labels or {})
        ),
        key=lambda d: d.id,
    )


def build_site(
    pool: Pool,
    cameras: Sequence[PoolCamera],
    devices: Sequence[Device],
    holds: Mapping[str, PoolDevice],
    placements: Mapping[str, PoolPlacement],
    *,
    priors: Mapping[str, placement.Cost],
    recent_moves: Sequence[float],
    now: float,
    fail: frozenset[str] = frozenset(),
    canaries: Mapping[str, str] | None = None,
) -> tuple[placement.Site, dict[str, Member]]:
    """The planner's snapshot of a pool (pure): ``devices`` are its members, ``fail`` those to take as
    offline whatever they report (a dry run), ``canaries`` the variant a rollout wants per camera."""
    members: dict[str, Member] = {}
    planned: list[placement.Device] = []
    costs: dict[tuple[str, str], placement.Cost] = {}
    decode: dict[tuple[str, str], float] = {}
    # Devices that keep the cameras they run but take no new one: cordoned (not draining), or offline
    # within the failover grace. The planner's own "cordoned" moves every camera away (a drain), so
    # these stay usable to it and are left out of the reach of cameras not already on them.
    no_new: set[str] = set()
    for dev in devices:
        hold = holds.get(dev.id)
        offline_for = (
            now - _epoch(dev.offline_since)
            if dev.status == DeviceStatus.OFFLINE and dev.offline_since is not None
            else None
        )
        in_grace = dev.id not in fail and offline_for is not None and offline_for < pool.failover_grace_s
        member = Member(
            id=dev.id,
            status=dev.status,
            in_grace=in_grace,
            cordoned=bool(hold and (hold.cordoned or hold.draining)),
            draining=bool(hold and hold.draining),
        )
        members[dev.id] = member
        if (member.cordoned and not member.draining) or in_grace:
            no_new.add(dev.id)
        hw = hardware(dev.capabilities)
        online = dev.id not in fail and (member.online or in_grace)
        planned.append(
            placement.Device(
                id=dev.id,
                hw_class=hw.hw_class,
                lane_ms_per_s=1000.0 * hw.lanes,
                cpu_ms_per_s=1000.0 * hw.cores,
                online=online,
                cordoned=member.draining,
                up_since=_epoch(dev.online_since) if online and dev.online_since is not None else None,
            )
        )
        for variant, cost in heartbeat_costs(dev.last_health, cpu_only=not hw.gpu).items():
            costs[(variant, dev.id)] = cost
        # Keyed by the device's camera id: it counts for the pool camera of that id once agents run them.
        for cam_id, ms in heartbeat_decode_ms(dev.last_health).items():
            decode[(cam_id, dev.id)] = ms
    # Reach: every member but those whose last heartbeat says they could not reach the source (the
    # agents probe the pool cameras their desired state lists); no report is taken as reachable.
    everyone = frozenset(members)
    unreached: dict[str, set[str]] = {}
    for dev in devices:
        for cam_id, ok in heartbeat_reach(dev.last_health).items():
            if not ok:
                unreached.setdefault(cam_id, set()).add(dev.id)
    declared = {cam.camera for cam in cameras}
    current = {
        cam: placement.Placement(p.device_id, p.fps, _epoch(p.since), p.canary)
        for cam, p in placements.items()
        if cam in declared
    }
    planned_cams: list[placement.Camera] = []
    for cam in cameras:
        here = current.get(cam.camera)
        # The device that runs the camera is not probed for it (its camera state says how it fares).
        reach = (everyone - no_new - unreached.get(cam.camera, set())) | (
            frozenset({here.device}) & everyone if here is not None else frozenset()
        )
        planned_cams.append(
            placement.Camera(
                id=cam.camera,
                variant=variant_key(cam.model, cam.version),
                target_fps=cam.target_fps,
                min_fps=cam.min_fps,
                reach=reach,
                priority=cam.priority,
                spread_group=cam.spread_group,
                prefer=cam.prefer,
                pin=cam.pin,
                canary=(canaries or {}).get(cam.camera),
            )
        )
    site = placement.Site(
        pool=placement.Pool(
            strategy=placement.Strategy(pool.strategy),
            headroom=pool.headroom,
            reserve_n1=pool.reserve_n1,
            failback=placement.Failback(pool.failback),
            max_moves_per_min=pool.max_moves_per_min,
            min_dwell_s=pool.min_dwell_s,
        ),
        devices=tuple(planned),
        cameras=tuple(planned_cams),
        measured=placement.Measured(costs=costs, decode_ms=decode, priors=dict(priors)),
        current=current,
        recent_moves=tuple(recent_moves),
    )
    return site, members


def _priors(
    s: Session, cameras: Iterable[PoolCamera], also: Iterable[tuple[str, str]] = ()
) -> dict[str, placement.Cost]:
    """Per model version of the pool (and ``also``, the canaries wanted): the controller's slowest
    measured variant (single thread, on its own CPU), else the default."""
    out: dict[str, placement.Cost] = {}
    for model, version in {(c.model, c.version) for c in cameras} | set(also):
        figures: list[float] = []
        mv = crud.get_model_version(s, name=model, version=version)
        if mv is not None and mv.id is not None:
            figures = [
                v.latency_ms_1t
                for v in crud.list_variants(s, model_version_id=mv.id)
                if v.latency_ms_1t is not None and math.isfinite(v.latency_ms_1t) and v.latency_ms_1t > 0
            ]
        ms = max(figures) if figures else None
        out[variant_key(model, version)] = placement.Cost(ms, ms) if ms is not None else DEFAULT_PRIOR
    return out


def _pool_events(name: str) -> SelectOfScalar[Event]:
    return select(Event).where(col(Event.kind) == EVENT_MOVED, col(Event.data)["pool"].as_string() == name)


def recent_events(s: Session, name: str, *, limit: int = RECENT_EVENTS) -> list[Event]:
    """The pool's newest ``camera_moved`` events, newest first."""
    q = _pool_events(name).order_by(col(Event.ts).desc(), col(Event.id).desc()).limit(limit)
    return list(s.exec(q).all())


def _recent_moves(s: Session, name: str, now: float) -> list[float]:
    """When the pool's moves of the last minute that count against its rate limit were made."""
    since = _at(now - 60.0)
    rows = s.exec(_pool_events(name).where(col(Event.ts) >= since)).all()
    failures = {r.value for r in placement.FAILURE_REASONS}
    return [_epoch(e.ts) for e in rows if (e.data or {}).get("reason") not in failures]


def load_snapshot(s: Session, pool: Pool, *, now: float, fail: Iterable[str] = ()) -> Snapshot:
    """A pool's snapshot from the database, as of ``now``."""
    cameras = list(
        s.exec(select(PoolCamera).where(col(PoolCamera.pool) == pool.name).order_by(col(PoolCamera.camera)))
    )
    holds = {h.device_id: h for h in s.exec(select(PoolDevice).where(col(PoolDevice.pool) == pool.name))}
    stored = {p.camera: p for p in s.exec(select(PoolPlacement).where(col(PoolPlacement.pool) == pool.name))}
    try:
        selector = parse_selector(pool.selector)
    except SelectorError:  # refused when declared: only a hand-edited row gets here
        selector = None
    devices = matching(crud.list_devices(s), selector) if selector is not None else []
    wanted = pool_camera_layers(s, applied_deployments(s), [(pool.name, c.camera) for c in cameras])
    canaries = {
        cam.camera: variant_key(layer.model, layer.version)
        for cam in cameras
        if (layer := wanted.get((pool.name, cam.camera))) is not None
        and (layer.model, layer.version) != (cam.model, cam.version)
    }
    site, members = build_site(
        pool,
        cameras,
        devices,
        holds,
        stored,
        priors=_priors(s, cameras, {(layer.model, layer.version) for layer in wanted.values()}),
        recent_moves=_recent_moves(s, pool.name, now),
        now=now,
        fail=frozenset(fail),
        canaries=canaries,
    )
    return Snapshot(pool, cameras, members, stored, site)


# --------------------------------------------------------------------------- the service


@dataclass(frozen=True)
class PoolSummary:
    pool: Pool
    cameras: int
    placed: int
    devices: int


@dataclass(frozen=True)
class PoolState:
    """A pool as it stands: the declaration, its devices, the stored placements, and a plan made now
    from the same snapshot (not stored: its moves are what the next replan would do)."""

    pool: Pool
    cameras: list[PoolCamera]
    members: list[Member]
    placements: dict[str, PoolPlacement]
    plan: placement.Plan
    recent: list[Event]


@dataclass(frozen=True)
class DryRun:
    pool: str
    fail: list[str]
    plan: placement.Plan


def _unchanged(snap: Snapshot, plan: placement.Plan) -> bool:
    """Whether storing ``plan`` would write nothing: no move, and the same cameras on the same devices
    at the same FPS as stored."""
    if plan.moves or set(plan.placements) != set(snap.placements):
        return False
    return all(_same(snap.placements[cam], p, plan) for cam, p in plan.placements.items())


def _same(row: PoolPlacement, p: placement.Placement, plan: placement.Plan) -> bool:
    """Whether the stored row says what the plan does of its camera. Only whether a canary is held is
    compared, not the why: its figures follow every heartbeat, and a row rewritten for them would cost
    a write a round."""
    held = plan.canary_held.get(row.camera)
    return (row.device_id, row.fps, row.canary, row.canary_held is not None) == (
        p.device,
        p.fps,
        p.canary,
        held is not None,
    )


_HANDOVER_WHY = {
    "running": "the new device analyses it",
    "old_offline": "the old device is offline",
    "timeout": f"the new device did not analyse it within {HANDOVER_TIMEOUT_S:g} s",
}


def _handover_over(
    row: PoolPlacement, new: Device | None, old: Device | None, now: float, offset: float | None
) -> str | None:
    """Why the handover of ``row`` is over (a key of ``_HANDOVER_WHY``), or None while it goes on.
    ``offset``: the new device's clock offset (``controller.observe.clock``), None when not known."""
    cams = ((new.reported if new is not None else None) or {}).get("cameras") or {}
    if (
        new is not None
        and ((cams.get(row.camera) or {}).get("state")) == "running"
        and _inferring_since(new.last_health, row.camera, row.handover_since, offset)
    ):
        return "running"
    if old is None or old.status != DeviceStatus.ONLINE:
        return "old_offline"
    started = row.handover_since
    if started is None or now - _epoch(started) >= HANDOVER_TIMEOUT_S:
        return "timeout"
    return None


def _inferring_since(health: Any, camera: str, since: datetime | None, offset: float | None) -> bool:
    """Whether the device's latest heartbeat, sent after ``since``, says it inferred a frame of
    ``camera``: the old device may stop only once the new one analyses the camera, not merely runs its
    model (a source may take seconds to give its first frame). A heartbeat from before ``since`` (a
    restarted agent's last one before it died) says nothing of now. Every agent that runs pool cameras
    reports ``last_inferred_at``."""
    if not isinstance(health, Mapping):
        return False
    sent = health.get("ts")
    if not isinstance(sent, int | float) or isinstance(sent, bool) or not math.isfinite(sent):
        return False
    if since is not None and sent - (offset or 0.0) < _epoch(since):
        return False
    return any(
        isinstance(c, Mapping)
        and c.get("camera") == camera
        and isinstance(c.get("last_inferred_at"), int | float)
        for c in _items(health.get("cameras"))
    )


def _holders(snap: Snapshot, plan: placement.Plan) -> set[str]:
    """The devices that held a camera of the pool before ``plan`` or hold one after it."""
    held = {p.device_id for p in snap.placements.values()}
    handing = {p.handover_from for p in snap.placements.values() if p.handover_from is not None}
    return held | handing | {p.device for p in plan.placements.values()}


def _locked(s: Session, name: str) -> Pool:
    pool = s.exec(
        select(Pool).where(col(Pool.name) == name).with_for_update().execution_options(populate_existing=True)
    ).first()
    if pool is None:
        raise NotFoundError(f"pool {name!r} is not known")
    return pool


class PoolService:
    """Pools in the database: declarations, the operator's actions, plans (stored or dry)."""

    def __init__(
        self,
        engine: Engine,
        *,
        clock: Callable[[], float] = time.time,
        on_placed: Callable[[Iterable[str]], object] | None = None,
    ) -> None:
        """``on_placed`` gets, after each commit that may change what devices run, the devices that held
        or now hold a camera of the pool (the runtime recomputes their desired states)."""
        self._engine = engine
        self._clock = clock
        self._on_placed = on_placed

    def _placed(self, devices: Iterable[str]) -> None:
        if self._on_placed is None:
            return
        try:
            self._on_placed(sorted(set(devices)))
        except Exception:
            # The plan is committed; the devices' desired states follow at the next change or replan.
            log.exception("updating the desired states of %s failed", sorted(set(devices)))

    # --- reads

    def summaries(self) -> list[PoolSummary]:
        with Session(self._engine) as s:
            pools = list(s.exec(select(Pool).order_by(col(Pool.name))))
            if not pools:
                return []
            cams = dict(s.exec(select(PoolCamera.pool, sa.func.count()).group_by(col(PoolCamera.pool))).all())
            placed = dict(
                s.exec(select(PoolPlacement.pool, sa.func.count()).group_by(col(PoolPlacement.pool))).all()
            )
            devices = crud.list_devices(s)
            out = []
            for p in pools:
                try:
                    members = len(matching(devices, parse_selector(p.selector)))
                except SelectorError:
                    members = 0
                out.append(PoolSummary(p, int(cams.get(p.name, 0)), int(placed.get(p.name, 0)), members))
            return out

    def state(self, name: str) -> PoolState:
        with Session(self._engine) as s:
            pool = s.get(Pool, name)
            if pool is None:
                raise NotFoundError(f"pool {name!r} is not known")
            return self._state(s, pool)

    def _state(self, s: Session, pool: Pool) -> PoolState:
        now = self._clock()
        snap = load_snapshot(s, pool, now=now)
        return PoolState(
            pool=pool,
            cameras=snap.cameras,
            members=[snap.members[k] for k in sorted(snap.members)],
            placements=snap.placements,
            plan=placement.plan(snap.site, now),
            recent=recent_events(s, pool.name),
        )

    def dry_run(self, name: str, fail: Sequence[str] = ()) -> DryRun:
        """The plan with the devices ``fail`` taken as offline; nothing is written."""
        with Session(self._engine) as s:
            pool = s.get(Pool, name)
            if pool is None:
                raise NotFoundError(f"pool {name!r} is not known")
            now = self._clock()
            snap = load_snapshot(s, pool, now=now, fail=fail)
            unknown = sorted(set(fail) - set(snap.members))
            if unknown:
                raise NotFoundError(
                    f"device {unknown[0]!r} is not in pool {name!r} (not enrolled, or its labels do not "
                    f"match {pool.selector!r})"
                )
            return DryRun(name, sorted(set(fail)), placement.plan(snap.site, now))

    # --- changes (each one replans in its own transaction)

    def apply(self, name: str, decl: PoolDeclaration) -> PoolState:
        """Create or replace a pool's declaration; cordons, drains and pins of cameras still declared stay."""
        with Session(self._engine) as s:
            _check_declaration(s, name, decl)
            try:
                self._declare(s, name, decl)
            except IntegrityError:
                s.rollback()
                raise ConflictError(f"pool {name!r} was changed at the same time: try again") from None
            return self._replan_commit(s, _locked(s, name), members=True)

    @staticmethod
    def _declare(s: Session, name: str, decl: PoolDeclaration) -> None:
        """The declaration's rows, flushed (the pool row locked); a concurrent first declaration of the
        same name fails here with an IntegrityError."""
        pool = s.exec(select(Pool).where(col(Pool.name) == name).with_for_update()).first()
        policy = decl.model_dump(include=set(PoolPolicy.model_fields))
        now = utcnow()
        if pool is None:
            pool = Pool(name=name, selector=decl.selector, created_at=now, updated_at=now, **policy)
        else:
            for key, value in policy.items():
                setattr(pool, key, value)
            pool.selector, pool.updated_at = decl.selector, now
        s.add(pool)
        s.flush()
        old = {c.camera: c for c in s.exec(select(PoolCamera).where(col(PoolCamera.pool) == name))}
        declared = {c.id for c in decl.cameras}
        for cam_id, stale in old.items():
            if cam_id not in declared:
                s.delete(stale)
        for spec in decl.cameras:
            fields: dict[str, Any] = {
                "source": spec.source,
                "model": spec.model,
                "version": spec.version,
                "target_fps": spec.target_fps,
                "min_fps": spec.min_fps if spec.min_fps is not None else spec.target_fps,
                "priority": spec.priority,
                "spread_group": spec.spread_group,
                "prefer": spec.prefer,
            }
            row = old.get(spec.id)
            if row is None:
                row = PoolCamera(pool=name, camera=spec.id, **fields)
            else:
                for key, value in fields.items():
                    setattr(row, key, value)
            s.add(row)
        s.flush()

    def delete(self, name: str) -> None:
        with Session(self._engine) as s:
            pool = _locked(s, name)
            held = set(s.exec(select(PoolPlacement.device_id).where(col(PoolPlacement.pool) == name)))
            held |= set(load_snapshot(s, pool, now=self._clock()).members)  # they probe its cameras
            for table in (PoolPlacement, PoolDevice, PoolCamera):
                s.exec(delete(table).where(col(table.pool) == name))
            s.exec(delete(Pool).where(col(Pool.name) == name))
            s.commit()
        self._placed(held)

    def replan(self, name: str) -> placement.Plan:
        """Plan the pool now and store it: placements replaced, one event per move."""
        with Session(self._engine) as s:
            pool = _locked(s, name)
            plan, touched = self._replan(s, pool, self._clock())
            s.commit()
        self._placed(touched)
        return plan

    def names(self) -> list[str]:
        with Session(self._engine) as s:
            return list(s.exec(select(Pool.name).order_by(col(Pool.name))))

    def replan_if_changed(
        self, name: str, *, now: float, fence: Callable[[Session], None]
    ) -> placement.Plan | None:
        """Plan the pool as of ``now`` and store the plan only if it changes something (a move, a
        camera placed or unplaced, an FPS); ``fence`` checks the transaction before it commits. Returns
        the plan stored, or None when there was nothing to store (or the pool is gone)."""
        with Session(self._engine) as s:
            pool = s.get(Pool, name)
            if pool is None:
                return None
            snap = load_snapshot(s, pool, now=now)
            if _unchanged(snap, placement.plan(snap.site, now)):
                return None  # read without a lock: a quiet pool costs no row lock and no write
            s.rollback()
            try:
                pool = _locked(s, name)
            except NotFoundError:  # deleted since the read
                return None
            # Planned again under the lock: an operator's change may have committed since the read.
            snap = load_snapshot(s, pool, now=now)
            plan = placement.plan(snap.site, now)
            if _unchanged(snap, plan):
                return None
            touched = _holders(snap, plan)  # before the store, which moves the snapshot's rows
            self._store(s, snap, plan, now)
            fence(s)
            s.commit()
        self._placed(touched)
        return plan

    def release_handovers(
        self, *, now: float, fence: Callable[[Session], None]
    ) -> list[tuple[str, str, str]]:
        """End every handover that is over: the new device reports the camera running and its heartbeat,
        sent since the handover began, says it inferred a frame of it; the old device
        is no longer online, or ``HANDOVER_TIMEOUT_S`` has passed. Each ends with an event, and the old
        devices' desired states are recomputed (they stop the camera at their next apply); ``fence``
        checks the transaction before it commits. Returns (pool, camera, old device) per handover ended."""
        handing = (
            select(PoolPlacement)
            .where(col(PoolPlacement.handover_from).is_not(None))
            .order_by(col(PoolPlacement.pool), col(PoolPlacement.camera))
        )
        with Session(self._engine) as s:
            if s.exec(handing.limit(1)).first() is None:
                return []  # read without a lock: a round with no handover takes no row lock
            rows = list(s.exec(handing.with_for_update().execution_options(populate_existing=True)))
            ids = {r.device_id for r in rows} | {r.handover_from for r in rows if r.handover_from}
            devices = {d.id: d for d in crud.list_devices(s) if d.id in ids}
            ended: list[tuple[str, str, str]] = []
            # One clock estimate per device taking cameras (a drain hands many to each).
            offsets = {
                d: device_clock_offset(s, devices[d]) for d in {r.device_id for r in rows} if d in devices
            }
            for row in rows:
                old = row.handover_from
                assert old is not None
                why = _handover_over(
                    row, devices.get(row.device_id), devices.get(old), now, offsets.get(row.device_id)
                )
                if why is None:
                    continue
                severity = "info" if why == "running" else "warning"
                s.add(
                    Event(
                        device_id=row.device_id,
                        ts=_at(now),
                        kind=EVENT_HANDOVER,
                        severity=severity,
                        camera=row.camera,
                        message=f"pool {row.pool}: camera {row.camera} handed over from {old} to "
                        f"{row.device_id} ({_HANDOVER_WHY[why]})",
                        data={
                            "pool": row.pool,
                            "camera": row.camera,
                            "source": old,
                            "target": row.device_id,
                            "end": why,
                        },
                        source=SOURCE_CONTROLLER,
                    )
                )
                row.handover_from, row.handover_since = None, None
                s.add(row)
                if why != "old_offline":
                    # Until the old device has applied a state without the camera, both analyse it.
                    s.add(
                        SupersededAnalysis(
                            pool=row.pool, device_id=old, camera=row.camera, since=_at(now), reason="handover"
                        )
                    )
                ended.append((row.pool, row.camera, old))
            if not ended:
                return []
            fence(s)
            s.commit()
        self._placed({old for _, _, old in ended})
        return ended

    def close_superseded(self, *, now: float, fence: Callable[[Session], None]) -> int:
        """Close every open superseded span whose device has stopped the camera: online and reporting it
        not running (or the camera placed on it again, or the device gone). A device that stays offline
        keeps its span open: partitioned, it may still be analysing. Returns how many were closed."""
        opened = select(SupersededAnalysis).where(col(SupersededAnalysis.until).is_(None))
        with Session(self._engine) as s:
            if s.exec(opened.limit(1)).first() is None:
                return 0  # read without a lock, as every quiet round
            spans = list(s.exec(opened.with_for_update().execution_options(populate_existing=True)))
            devices = {d.id: d for d in crud.list_devices(s) if d.id in {x.device_id for x in spans}}
            placed = {
                (p.pool, p.camera): p.device_id
                for p in s.exec(
                    select(PoolPlacement).where(col(PoolPlacement.pool).in_({x.pool for x in spans}))
                )
            }
            closed = 0
            for span in spans:
                dev = devices.get(span.device_id)
                back = placed.get((span.pool, span.camera)) == span.device_id
                if dev is not None and not back:
                    if dev.status != DeviceStatus.ONLINE:
                        continue
                    cams = (dev.reported or {}).get("cameras") or {}
                    if (cams.get(span.camera) or {}).get("state") == "running":
                        continue
                span.until = _at(now)
                s.add(span)
                closed += 1
            if closed:
                fence(s)
                s.commit()
            return closed

    def cordon(self, name: str, device_id: str) -> PoolState:
        """No new camera on the device; those it runs stay."""
        return self._hold(name, device_id, cordoned=True, draining=False)

    def drain(self, name: str, device_id: str) -> PoolState:
        """Cordoned, and its cameras planned elsewhere (reason ``cordoned``)."""
        return self._hold(name, device_id, cordoned=True, draining=True)

    def uncordon(self, name: str, device_id: str) -> PoolState:
        """The device takes cameras again; none moves back by itself (plans are sticky)."""
        return self._hold(name, device_id, cordoned=False, draining=False)

    def move(self, name: str, camera: str, device_id: str) -> PoolState:
        """Pin a camera to a device: the plan moves it there when it fits, under the rate limit."""
        with Session(self._engine) as s:
            pool = _locked(s, name)
            row = self._camera(s, pool, camera)
            member = self._member(s, pool, device_id)
            if member.cordoned:
                state = "draining" if member.draining else "cordoned"
                raise ConflictError(f"device {device_id!r} is {state} in pool {name!r}: uncordon it first")
            row.pin = device_id
            s.add(row)
            s.flush()
            return self._replan_commit(s, pool)

    def unpin(self, name: str, camera: str) -> PoolState:
        """Forget a camera's pin; it stays where it runs."""
        with Session(self._engine) as s:
            pool = _locked(s, name)
            row = self._camera(s, pool, camera)
            row.pin = None
            s.add(row)
            s.flush()
            return self._replan_commit(s, pool)

    # --- helpers

    def _hold(self, name: str, device_id: str, *, cordoned: bool, draining: bool) -> PoolState:
        with Session(self._engine) as s:
            pool = _locked(s, name)
            row = s.get(PoolDevice, (name, device_id))
            if row is None:
                self._member(s, pool, device_id)
            if not cordoned:
                if row is not None:
                    s.delete(row)
            elif row is None or (row.cordoned, row.draining) != (cordoned, draining):
                row = row or PoolDevice(pool=name, device_id=device_id)
                row.cordoned, row.draining, row.since = cordoned, draining, utcnow()
                s.add(row)
            s.flush()
            return self._replan_commit(s, pool)

    def _member(self, s: Session, pool: Pool, device_id: str) -> Member:
        snap = load_snapshot(s, pool, now=self._clock())
        member = snap.members.get(device_id)
        if member is None:
            raise NotFoundError(
                f"device {device_id!r} is not in pool {pool.name!r} (not enrolled, or its labels do not "
                f"match {pool.selector!r})"
            )
        return member

    @staticmethod
    def _camera(s: Session, pool: Pool, camera: str) -> PoolCamera:
        row = s.get(PoolCamera, (pool.name, camera))
        if row is None:
            raise NotFoundError(f"camera {camera!r} is not in pool {pool.name!r}")
        return row

    def _replan_commit(self, s: Session, pool: Pool, *, members: bool = False) -> PoolState:
        """``members``: every device of the pool is recomputed, not only those whose cameras changed
        (a declaration changes what each probes)."""
        _, touched = self._replan(s, pool, self._clock(), members=members)
        try:
            s.commit()
        except IntegrityError:
            s.rollback()
            raise ConflictError(f"pool {pool.name!r} was changed at the same time: try again") from None
        self._placed(touched)
        return self._state(s, pool)

    def _replan(
        self, s: Session, pool: Pool, now: float, *, members: bool = False
    ) -> tuple[placement.Plan, set[str]]:
        """Plan the locked pool as of ``now`` and write the plan in the caller's transaction; also the
        devices that held or now hold one of its cameras (a declaration's change of source or model
        changes what they run even where nothing moves)."""
        snap = load_snapshot(s, pool, now=now)
        plan = placement.plan(snap.site, now)
        touched = _holders(snap, plan)  # before the store, which moves the snapshot's rows
        if members:
            touched |= set(snap.members)
        self._store(s, snap, plan, now)
        return plan, touched

    @staticmethod
    def _store(s: Session, snap: Snapshot, plan: placement.Plan, now: float) -> None:
        """Write ``plan``, made from ``snap`` as of ``now``, in the caller's transaction: the placements
        that changed, one event per move."""
        pool = snap.pool
        for cam, gone in snap.placements.items():
            if cam not in plan.placements:
                s.delete(gone)
        for cam, p in plan.placements.items():
            found = snap.placements.get(cam)
            if found is None:
                row = PoolPlacement(
                    pool=pool.name, camera=cam, device_id=p.device, fps=p.fps, since=_at(p.since)
                )
            elif _same(found, p, plan):
                continue
            else:
                row = found
                row.device_id, row.fps = p.device, p.fps
                if abs(_epoch(row.since) - p.since) > 1e-3:
                    row.since = _at(p.since)
            row.canary, row.canary_held = p.canary, plan.canary_held.get(cam)
            s.add(row)
        stamp = _at(now)  # the moves' time is the plan's: a new placement's since is the same instant
        rows = {p.camera: p for p in snap.placements.values()}
        for m in plan.moves:
            moved = rows.get(m.camera)
            if moved is None:
                continue
            alive = (member := snap.members.get(m.source)) is not None and member.online
            if m.reason in BREAK_FIRST or not alive:
                # Nothing stops a device that does not answer: what it still analyses is superseded.
                s.add(
                    SupersededAnalysis(
                        pool=pool.name,
                        device_id=m.source,
                        camera=m.camera,
                        since=stamp,
                        reason=m.reason.value,
                    )
                )
            if m.reason in BREAK_FIRST or not alive or moved.handover_from == m.target:
                moved.handover_from, moved.handover_since = None, None
            elif moved.handover_from is None:
                # A camera moved again mid-handover keeps the device that still runs it.
                moved.handover_from, moved.handover_since = m.source, stamp
            s.add(moved)
        for m in plan.moves:
            failure = m.reason in placement.FAILURE_REASONS
            s.add(
                Event(
                    device_id=m.target,
                    ts=stamp,
                    kind=EVENT_MOVED,
                    severity="warning" if failure else "info",
                    camera=m.camera,
                    message=(
                        f"pool {pool.name}: camera {m.camera} moved from {m.source} to {m.target} "
                        f"at {m.fps:g} FPS ({m.reason.value})"
                    ),
                    data={
                        "pool": pool.name,
                        "camera": m.camera,
                        "source": m.source,
                        "target": m.target,
                        "fps": m.fps,
                        "reason": m.reason.value,
                    },
                    source=SOURCE_CONTROLLER,
                )
            )


# --------------------------------------------------------------------------- the leader's replan


class PoolReplanner:
    """Every ``interval_s``, the leader replans every pool as of its clock's time and stores what
    changes (:meth:`PoolService.replan_if_changed`), each write fenced.

    A pool whose round fails (a row the planner cannot read) is logged once with its traceback, again
    only at debug level while it keeps failing, and once more when it recovers; the other pools are
    planned all the same. ``FencedOut`` ends the round: another replica leads, and replans.
    """

    def __init__(
        self,
        service: PoolService,
        *,
        interval_s: float,
        stop: threading.Event,
        leadership: Leadership = ALWAYS_LEADER,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._service = service
        self._leadership = leadership
        self._clock = clock
        self._failing: dict[str, int] = {}  # pool -> rounds failed in a row
        self._loop = LeaderLoop(
            "controller-pool-replan",
            lambda: self._round(self._clock()),
            interval_s=interval_s,
            leadership=leadership,
            stop=stop,
            what="pool replan",
            logger=log,
        )

    def start(self) -> None:
        self._loop.start()

    def join(self, timeout: float = 10.0) -> None:
        self._loop.join(timeout)

    def replan(self, now: float | None = None) -> dict[str, placement.Plan]:
        """One round outside the loop, as of ``now`` (default the clock's): the plans stored, by pool
        (none on a replica that does not lead, or whose lead was fenced off during the round)."""
        return self._loop.lead(lambda: self._round(self._clock() if now is None else now), otherwise={})

    def _round(self, now: float) -> dict[str, placement.Plan]:
        stored: dict[str, placement.Plan] = {}
        names = self._service.names()
        for name in names:
            try:
                plan = self._service.replan_if_changed(name, now=now, fence=self._leadership.fence)
            except FencedOut:
                raise
            except Exception:
                failed = self._failing.get(name, 0)
                if failed:
                    log.debug("replanning pool %s failed again", name, exc_info=True)
                else:
                    log.exception("replanning pool %s failed", name)
                self._failing[name] = failed + 1
                continue
            if failed := self._failing.pop(name, 0):
                log.info("replanning pool %s recovered after %d failed round(s)", name, failed)
            if plan is not None:
                stored[name] = plan
        for gone in set(self._failing) - set(names):
            del self._failing[gone]
        for step, what in (
            (self._service.release_handovers, "ending pool camera handovers"),
            (self._service.close_superseded, "closing superseded analysis spans"),
        ):
            try:
                step(now=now, fence=self._leadership.fence)
            except FencedOut:
                raise
            except Exception:
                log.exception("%s failed", what)
        return stored
