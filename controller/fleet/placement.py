"""Camera placement for a site's pool: the pure decision function ``plan``.

``plan(site, now) -> Plan`` takes a snapshot of one site (its pool's policy, its devices, its cameras,
the measured costs, where each camera runs now) and the time, and says where every camera should run
and at what frame rate. It touches no database, no broker and no clock, so it is tested apart, the way
``controller.fleet.gate.step`` is; whoever owns pools loads the snapshot and applies the plan
(make-before-break for planned moves is the caller's job: a move only carries its reason).

Resources. A camera on a device costs, per frame, inference-lane time (ms, against ``1000 * lanes``
ms/s) and CPU time (decode, preprocessing, inference on the CPU provider; ms, against
``1000 * cores`` ms/s). Both must stay under ``headroom`` of capacity; the dominant one (the larger
share) decides how full a device is.

The algorithm, greedy best-fit-decreasing and sticky:

1. **Keep** every current placement that is still valid: the device is known, online, not cordoned,
   reaches the camera's source, can run its variant, and the device's measured load is under
   headroom. Stickiness is absolute rather than a score bonus: re-planning moves nothing unless
   something is wrong, which is what makes a failure move only the failed device's cameras.
2. **Overload**: a device whose kept cameras are measured above headroom sheds cameras, lowest
   priority first and then the largest (fewest moves), until its load at the admission factor
   (below) is under headroom again; the shed cameras are placed elsewhere like orphans.
3. **Failback** (policy ``preferred`` only) and **manual pins**: a camera whose preferred device came
   back (up since after the camera was placed, for ``min_dwell_s``), or that an operator pinned
   elsewhere, moves there if it fits at no lower FPS than it runs at now; otherwise the move is
   reported as held, with what holds it.
4. **Place** orphans and new cameras, highest priority first, then the most expensive first (large
   items first pack better), filtered by reachability, fitness and both resources, and ranked by:
   the preferred device, the fewest cameras of the same spread group, the strategy (``spread``: the
   lowest load after placing; ``pack``: the fullest device that still fits; ``energy``: the fewest
   joules a second where J/frame is known), then the camera's own cost.
5. **Degrade before leaving unplaced**: a camera that fits nowhere at its target FPS takes the
   device where it would run fastest, after cameras of *lower* priority on that device give up FPS
   toward their minimum, lowest priority first; it then runs at what is left, down to its own
   minimum. Only then is it unplaced, with the reason.
6. **Canaries**: a camera a rollout wants on a new variant (``Camera.canary``) switches to it where
   it runs, at the FPS it runs at, only if the device has room for the difference at the canary's
   cost (the same sources as any cost: measured on the device, else its class's median, else the
   controller's figure scaled), at the admission factor and, under the reserve, keeping N+1;
   otherwise it keeps its variant and the plan says why (``Plan.canary_held``). A canary admitted
   once stays while its measured load fits, like any placement. While it runs, the camera counts
   at the larger of its two costs in each resource, so that a roll back to its own variant (dearer,
   say) never overloads the device that others filled meanwhile.
7. **Raise** degraded cameras back toward their target where room is left, highest priority first,
   only on a cost measured on a device (its own figure or its class's): a camera moved off the only
   device that measured its variant has nothing but the controller's figure until its new device
   has run a frame of it, and that figure may be far below the truth (a raise on it overloads the
   device, which sheds the camera, whose next device raises it again: a camera bounced for ever).

Choices made, and why:

- *Hysteresis as admission against eviction*, not EWMA in the planner: new placements and FPS raises
  are admitted against costs inflated by ``(1 + m) / (1 - m)`` (``m = noise_margin``, 0.15 by
  default: x1.35), while an existing placement is evicted only when its *measured* load is above
  headroom. A placement admitted on a sample at -m therefore survives a later one at +m: a plan
  re-made every heartbeat on raw costs that wander ±m around their truth never moves a camera. A
  margin of only (1 + m) does not hold: a low sample lets a degraded camera regain FPS or a waiting
  camera in, and the next high sample evicts it. The price is admission at about 0.74 of headroom;
  a caller that smooths its costs (EWMA) can pass a smaller margin and get the capacity back. An
  overloaded device sheds down to the admission line, not just under headroom (a dead band, like
  the descheduler's low and high water marks).
- *No preemption*: a camera that does not fit never moves or stops a healthy camera to make room.
  It may only lower the FPS of cameras of strictly lower priority, which is not a move; moving or
  stopping them would turn one device's failure into changes on every device, the collateral this
  planner promises never to make. A high-priority camera can therefore stay unplaced while a
  lower-priority one runs at its minimum; its reason says so, and the operator decides.
- *No rebalance of healthy cameras*: degraded cameras regain FPS in place only. Moving a degraded
  camera to a device that just gained room is the move that flaps under noisy costs; it is left to
  an explicit, rate-limited operator action (``manual``).
- *Rate limit and dwell*: ``max_moves_per_min`` caps the moves a plan may make for reasons other
  than a failure (failback, manual), counting the caller's recent ones (``Site.recent_moves``);
  failure moves (the device offline, gone, cordoned, unable to reach or run the camera, overloaded)
  are never held back. ``min_dwell_s`` is how long a camera stays where it was placed, and a
  device stays up, before failback moves it.
- *A canary never moves a camera*: it is tried where the camera runs and held there when it does not
  fit, so a rollout's wave changes no placement and the pool's promise of no collateral holds. A
  camera that moves for a failure (its device offline, overloaded, gone) leaves its canary behind and
  is placed on its declared variant, the cheaper one it is known to fit on, then given the canary
  again in the same plan where its new device has room: a failover never leaves a camera unplaced for
  a canary's sake. Planned moves (a pin, a failback) take the camera with the variant it runs.
- *N+1* (``reserve_n1``) is a coarse aggregate check, not a trial failover: for each usable device,
  its cameras' load at their minimum FPS, in each resource, must fit in the free room of the
  others. It is always reported; with the flag on, a new camera that would break it is left
  unplaced and a degraded camera regains FPS only while it holds (orphans ignore the reserve: it
  exists for them).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

FPS_STEPS = 100  # plans give FPS in hundredths: equal inputs give equal FPS, and a raise of less is noise
_EPS = 1e-9  # relative slack on the headroom test, so that a device filled exactly is not "over"


class Strategy(StrEnum):
    SPREAD = "spread"
    PACK = "pack"
    ENERGY = "energy"


class Failback(StrEnum):
    NEVER = "never"
    PREFERRED = "preferred"


class MoveReason(StrEnum):
    DEVICE_OFFLINE = "device_offline"
    DEVICE_GONE = "device_gone"
    CORDONED = "cordoned"
    UNREACHABLE = "unreachable"
    UNFIT = "unfit"
    OVERLOAD = "overload"
    FAILBACK = "failback"
    MANUAL = "manual"
    REBALANCE = "rebalance"  # an operator's move to even the load; the planner itself never makes one


# Moves for these reasons are never held back by the rate limit or the dwell time.
FAILURE_REASONS = frozenset(
    {
        MoveReason.DEVICE_OFFLINE,
        MoveReason.DEVICE_GONE,
        MoveReason.CORDONED,
        MoveReason.UNREACHABLE,
        MoveReason.UNFIT,
        MoveReason.OVERLOAD,
    }
)


@dataclass(frozen=True, slots=True)
class Pool:
    strategy: Strategy = Strategy.SPREAD
    headroom: float = 0.8  # share of each resource a plan may use
    reserve_n1: bool = False
    failback: Failback = Failback.NEVER
    max_moves_per_min: int = 5
    min_dwell_s: float = 600.0
    # The relative noise (±) of measured costs that must move nothing: admission is against costs
    # (1 + m) / (1 - m) times the measured ones, eviction against the measured ones.
    noise_margin: float = 0.15

    def __post_init__(self) -> None:
        if not 0 < self.headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], not {self.headroom}")
        if not 0 <= self.noise_margin < 1:
            raise ValueError(f"noise_margin must be in [0, 1), not {self.noise_margin}")
        if self.max_moves_per_min < 0 or self.min_dwell_s < 0:
            raise ValueError("max_moves_per_min and min_dwell_s must be >= 0")


@dataclass(frozen=True, slots=True)
class Device:
    id: str
    hw_class: str  # CPU or GPU model: devices of one class share measured costs
    lane_ms_per_s: float = 1000.0  # inference lanes x 1000
    cpu_ms_per_s: float = 1000.0  # cores x 1000
    online: bool = True
    cordoned: bool = False
    runs: frozenset[str] | None = None  # variants it can run; None: any
    # Its speed against the controller's CPU, for variants measured only there: ms here = ms there x speed.
    speed: float = 1.0
    # When it last came online: failback brings back cameras placed elsewhere before it, once it has
    # been up for min_dwell_s; None (unknown) brings nothing back.
    up_since: float | None = None


@dataclass(frozen=True, slots=True)
class Camera:
    id: str
    variant: str  # model and version (the key of measured costs)
    target_fps: float
    min_fps: float
    reach: frozenset[str]  # devices that can open its source
    priority: int = 0  # higher runs first, loses FPS last
    spread_group: str | None = None
    prefer: str | None = None
    pin: str | None = None  # an operator's choice: only this device
    # The variant a rollout wants it to run instead of ``variant``; admitted only where it fits.
    canary: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.min_fps <= self.target_fps:
            raise ValueError(f"camera {self.id}: need 0 < min_fps <= target_fps")


@dataclass(frozen=True, slots=True)
class Cost:
    """Per frame of one variant on one device."""

    infer_ms: float  # inference-lane time
    cpu_ms: float = 0.0  # CPU time beside decoding (preprocessing, inference on the CPU provider)
    joules: float | None = None


@dataclass(frozen=True)
class Measured:
    costs: Mapping[tuple[str, str], Cost] = field(default_factory=dict)  # (variant, device id)
    decode_ms: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (camera id, device id)
    priors: Mapping[str, Cost] = field(default_factory=dict)  # variant -> the controller's own figure
    default_decode_ms: float = 2.0


@dataclass(frozen=True, slots=True)
class Placement:
    device: str
    fps: float
    since: float
    canary: str | None = None  # the camera's canary variant, admitted here; None: its own variant


@dataclass(frozen=True)
class Site:
    pool: Pool
    devices: tuple[Device, ...]
    cameras: tuple[Camera, ...]
    measured: Measured
    current: Mapping[str, Placement] = field(default_factory=dict)
    recent_moves: tuple[float, ...] = ()  # times of the non-failure moves already made


@dataclass(frozen=True, slots=True)
class Move:
    camera: str
    source: str
    target: str
    fps: float
    reason: MoveReason


@dataclass(frozen=True, slots=True)
class Held:
    """A non-failure move the plan did not make, and what holds it (the rate limit, no room, the
    target unusable); the caller may show it as pending."""

    move: Move
    why: str


@dataclass(frozen=True, slots=True)
class Degraded:
    fps: float
    target_fps: float
    reason: str


@dataclass(frozen=True, slots=True)
class Load:
    lane_ms_per_s: float  # measured costs x FPS
    lane_limit: float  # headroom x capacity
    cpu_ms_per_s: float
    cpu_limit: float
    cameras: int

    @property
    def util(self) -> float:
        """The dominant share of the limit (1.0 = at headroom)."""
        return max(_share(self.lane_ms_per_s, self.lane_limit), _share(self.cpu_ms_per_s, self.cpu_limit))


@dataclass(frozen=True)
class Plan:
    placements: Mapping[str, Placement]  # the next ``Site.current``
    unplaced: Mapping[str, str]  # camera -> why
    moves: tuple[Move, ...]
    held: tuple[Held, ...]
    degraded: Mapping[str, Degraded]
    loads: Mapping[str, Load]  # every usable device
    n_plus_one: bool
    # camera -> why its canary variant is not admitted where it runs (no room, cannot run it, N+1)
    canary_held: Mapping[str, str] = field(default_factory=dict)


def variant_key(model: str, version: str) -> str:
    """The planner's variant: a model version, as costs are keyed."""
    return f"{model}/{version}"


def _floor_fps(x: float) -> float:
    return round(math.floor(x * FPS_STEPS + 1e-9) / FPS_STEPS, 2)


def _ceil_fps(x: float) -> float:
    return round(math.ceil(x * FPS_STEPS - 1e-9) / FPS_STEPS, 2)


def _share(x: float, limit: float) -> float:
    if limit <= 0:
        return math.inf if x > 0 else 0.0
    return x / limit


def class_medians(measured: Measured, devices: Iterable[Device]) -> dict[tuple[str, str], Cost]:
    """(variant, hw_class) -> the median of the costs measured on devices of that class."""
    cls = {d.id: d.hw_class for d in devices}
    groups: dict[tuple[str, str], list[Cost]] = {}
    for (variant, dev), cost in measured.costs.items():
        if dev in cls:
            groups.setdefault((variant, cls[dev]), []).append(cost)
    out: dict[tuple[str, str], Cost] = {}
    for key, costs in groups.items():
        joules = [c.joules for c in costs if c.joules is not None]
        out[key] = Cost(
            infer_ms=statistics.median(c.infer_ms for c in costs),
            cpu_ms=statistics.median(c.cpu_ms for c in costs),
            joules=statistics.median(joules) if joules else None,
        )
    return out


def estimate_cost(
    variant: str, device: Device, measured: Measured, medians: Mapping[tuple[str, str], Cost]
) -> Cost | None:
    """A variant's cost on a device: measured there; else the median of devices of the same class
    (same CPU or GPU model runs it alike); else the controller's figure scaled by the device's speed;
    else None (nothing to plan with: the device is not a candidate)."""
    if (cost := measured.costs.get((variant, device.id))) is not None:
        return cost
    if (cost := medians.get((variant, device.hw_class))) is not None:
        return cost
    if (prior := measured.priors.get(variant)) is not None:
        return Cost(infer_ms=prior.infer_ms * device.speed, cpu_ms=prior.cpu_ms * device.speed, joules=None)
    return None


def estimate_decode_ms(camera: str, device: Device, measured: Measured, peers: Mapping[str, Device]) -> float:
    """Decoding one frame of a camera on a device: measured there; else the median over devices of the
    same class that decoded it; else the pool's default."""
    if (ms := measured.decode_ms.get((camera, device.id))) is not None:
        return ms
    same = [
        v
        for (cam, dev), v in measured.decode_ms.items()
        if cam == camera and (p := peers.get(dev)) is not None and p.hw_class == device.hw_class
    ]
    return statistics.median(same) if same else measured.default_decode_ms


@dataclass(slots=True)
class _Unit:
    """Per-frame cost of one camera on one device, margin applied where the name says so."""

    lane: float
    cpu: float
    joules: float | None
    assumed: bool = False  # the controller's figure: no device of its class has measured the variant


@dataclass
class _Dev:
    dev: Device
    lane_limit: float
    cpu_limit: float
    lane: float = 0.0  # planned: every camera's cost x the admission factor
    cpu: float = 0.0
    act_lane: float = 0.0  # measured
    act_cpu: float = 0.0
    cams: dict[str, float] = field(default_factory=dict)  # camera -> fps
    groups: Counter[str] = field(default_factory=Counter)

    def util(self) -> float:
        return max(_share(self.lane, self.lane_limit), _share(self.cpu, self.cpu_limit))


class _Planner:
    def __init__(self, site: Site, now: float) -> None:
        self.site = site
        self.pool = site.pool
        self.now = now
        m = self.pool.noise_margin
        # A placement admitted on a sample at -m must survive one at +m: (1 + m) / (1 - m) apart.
        self.k = (1.0 + m) / (1.0 - m)
        self.devices = {d.id: d for d in site.devices}
        self.cams = {c.id: c for c in site.cameras}
        self.medians = class_medians(site.measured, site.devices)
        self._units: dict[tuple[str, str, str], _Unit | None] = {}
        self._cands: dict[str, list[tuple[_Dev, _Unit]]] = {}
        # camera -> its canary variant, admitted where it is assigned now (its cost is the canary's)
        self.canary_on: dict[str, str] = {}
        self.canary_held: dict[str, str] = {}
        h = self.pool.headroom
        self.usable = {
            d.id: _Dev(d, h * d.lane_ms_per_s, h * d.cpu_ms_per_s)
            for d in site.devices
            if d.online and not d.cordoned
        }
        self.assign: dict[str, tuple[str, float, float]] = {}  # camera -> (device, fps, since)
        self.unplaced: dict[str, str] = {}
        self.moves: list[Move] = []
        self.held: list[Held] = []
        self.why_degraded: dict[str, str] = {}
        self.orphan_why: dict[str, tuple[MoveReason, str]] = {}  # camera -> (reason, old device)
        self.excluded: dict[str, str] = {}  # camera -> a device it must leave (overload)
        recent = sum(1 for t in site.recent_moves if now - 60.0 < t <= now)
        self.budget = max(0, self.pool.max_moves_per_min - recent)

    # --- costs and fit

    def unit(self, cam: Camera, dev: Device, variant: str | None = None) -> _Unit | None:
        """A frame of ``cam`` on ``dev`` with ``variant``, by default the one it runs in this plan."""
        v = variant if variant is not None else self.canary_on.get(cam.id, cam.variant)
        key = (cam.id, dev.id, v)
        if key in self._units:
            return self._units[key]
        u: _Unit | None = None
        if dev.runs is None or v in dev.runs:
            cost = estimate_cost(v, dev, self.site.measured, self.medians)
            if cost is not None:
                decode = estimate_decode_ms(cam.id, dev, self.site.measured, self.devices)
                known = (v, dev.id) in self.site.measured.costs or (v, dev.hw_class) in self.medians
                u = _Unit(cost.infer_ms, cost.cpu_ms + decode, cost.joules, not known)
        if u is not None and v != cam.variant:
            # A canary holds the room of the larger of its two costs: rolled back to its own variant,
            # the camera must still fit where it runs.
            own = self.unit(cam, dev, cam.variant)
            u = (
                None
                if own is None
                else _Unit(max(u.lane, own.lane), max(u.cpu, own.cpu), u.joules, u.assumed or own.assumed)
            )
        self._units[key] = u
        return u

    def why_not(self, cam: Camera, dev_id: str) -> MoveReason | None:
        """Why a camera cannot run on a device at all, whatever the load."""
        dev = self.devices.get(dev_id)
        if dev is None:
            return MoveReason.DEVICE_GONE
        if not dev.online:
            return MoveReason.DEVICE_OFFLINE
        if dev.cordoned:
            return MoveReason.CORDONED
        if dev_id not in cam.reach:
            return MoveReason.UNREACHABLE
        if self.unit(cam, dev) is None:
            return MoveReason.UNFIT
        return None

    def max_fps(self, d: _Dev, u: _Unit, lane_room: float = 0.0, cpu_room: float = 0.0) -> float:
        """The highest FPS (in steps) that fits on ``d`` at planned cost, with extra room given."""
        rooms = []
        if u.lane > 0:
            rooms.append((d.lane_limit - d.lane + lane_room) / (u.lane * self.k))
        if u.cpu > 0:
            rooms.append((d.cpu_limit - d.cpu + cpu_room) / (u.cpu * self.k))
        f = min(rooms) if rooms else math.inf
        if math.isinf(f):
            return f
        return _floor_fps(f)

    def add(self, cam: Camera, d: _Dev, fps: float, since: float) -> None:
        u = self.unit(cam, d.dev)
        assert u is not None
        d.lane += fps * u.lane * self.k
        d.cpu += fps * u.cpu * self.k
        d.act_lane += fps * u.lane
        d.act_cpu += fps * u.cpu
        d.cams[cam.id] = fps
        if cam.spread_group:
            d.groups[cam.spread_group] += 1
        self.assign[cam.id] = (d.dev.id, fps, since)

    def remove(self, cam: Camera) -> None:
        dev_id, fps, _ = self.assign.pop(cam.id)
        d = self.usable[dev_id]
        u = self.unit(cam, d.dev)
        assert u is not None
        d.lane -= fps * u.lane * self.k
        d.cpu -= fps * u.cpu * self.k
        d.act_lane -= fps * u.lane
        d.act_cpu -= fps * u.cpu
        del d.cams[cam.id]
        if cam.spread_group:
            d.groups[cam.spread_group] -= 1

    def set_fps(self, cam: Camera, fps: float) -> None:
        dev_id, _, since = self.assign[cam.id]
        self.remove(cam)
        self.add(cam, self.usable[dev_id], fps, since)

    # --- the steps

    def keep(self) -> list[Camera]:
        """Step 1: keep what is valid; return the cameras left to place."""
        todo: list[Camera] = []
        for cam in self.site.cameras:
            cur = self.site.current.get(cam.id)
            if cur is None:
                todo.append(cam)
                continue
            if cur.canary is not None and cur.canary == cam.canary:
                self.canary_on[cam.id] = cur.canary
                dev = self.devices.get(cur.device)
                if dev is not None and self.unit(cam, dev) is None:
                    # It can no longer run the canary there: its own variant, and the canary is held.
                    del self.canary_on[cam.id]
            if (why := self.why_not(cam, cur.device)) is not None:
                self.canary_on.pop(cam.id, None)  # an orphan is placed on its own variant
                self.orphan_why[cam.id] = (why, cur.device)
                todo.append(cam)
                continue
            fps = min(max(cur.fps, cam.min_fps), cam.target_fps)
            self.add(cam, self.usable[cur.device], fps, cur.since)
        return todo

    def shed_overload(self) -> list[Camera]:
        """Step 2: devices measured above headroom shed cameras until planned load fits again."""
        shed: list[Camera] = []
        for d in self.usable.values():
            if d.act_lane <= d.lane_limit * (1 + _EPS) and d.act_cpu <= d.cpu_limit * (1 + _EPS):
                continue
            order = sorted(
                (self.cams[c] for c in d.cams),
                key=lambda c: (c.priority, -self._load_share(c, d), c.id),
            )
            for cam in order:
                if d.lane <= d.lane_limit * (1 + _EPS) and d.cpu <= d.cpu_limit * (1 + _EPS):
                    break
                self.remove(cam)
                self.canary_on.pop(cam.id, None)
                self.orphan_why[cam.id] = (MoveReason.OVERLOAD, d.dev.id)
                self.excluded[cam.id] = d.dev.id
                shed.append(cam)
        return shed

    def _load_share(self, cam: Camera, d: _Dev) -> float:
        u = self.unit(cam, d.dev)
        fps = d.cams.get(cam.id, cam.target_fps)
        if u is None:
            return 0.0
        return max(_share(fps * u.lane, d.lane_limit), _share(fps * u.cpu, d.cpu_limit))

    def planned_moves(self) -> None:
        """Step 3: manual pins and failback, both held back by the rate limit."""
        for cam in sorted(self.site.cameras, key=lambda c: (-c.priority, c.id)):
            if cam.id not in self.assign:
                continue
            dev_id, _, since = self.assign[cam.id]
            if cam.pin is not None and cam.pin != dev_id:
                self._try_planned(cam, cam.pin, MoveReason.MANUAL)
            elif (
                cam.pin is None
                and self.pool.failback == Failback.PREFERRED
                and cam.prefer is not None
                and cam.prefer != dev_id
                and self.now - since >= self.pool.min_dwell_s
            ):
                # "Back" is what the planner can tell without memory: the preferred device came up
                # after the camera was placed where it is, and has stayed up for the dwell time.
                dev = self.devices.get(cam.prefer)
                up = dev.up_since if dev is not None else None
                if up is not None and since < up and self.now - up >= self.pool.min_dwell_s:
                    self._try_planned(cam, cam.prefer, MoveReason.FAILBACK)

    def _try_planned(self, cam: Camera, target: str, reason: MoveReason) -> None:
        source, fps, _ = self.assign[cam.id]
        if (why := self.why_not(cam, target)) is not None:
            self.held.append(Held(Move(cam.id, source, target, fps, reason), f"{target}: {why.value}"))
            return
        d = self.usable[target]
        u = self.unit(cam, d.dev)
        assert u is not None
        f = min(cam.target_fps, self.max_fps(d, u))
        move = Move(cam.id, source, target, f, reason)
        if f < fps and f < cam.target_fps:
            # Only to run at least as fast as it does now: a planned move never costs frames.
            self.held.append(Held(move, f"{target} has no room for {fps:g} FPS"))
            return
        if self.budget <= 0:
            self.held.append(Held(move, f"at most {self.pool.max_moves_per_min} moves a minute"))
            return
        self.budget -= 1
        self.remove(cam)
        self.add(cam, d, f, self.now)
        self.moves.append(move)

    def _candidates(self, cam: Camera) -> list[tuple[_Dev, _Unit]]:
        """Usable devices that reach and can run the camera (fixed once overloads are shed)."""
        if (cached := self._cands.get(cam.id)) is not None:
            return cached
        out = []
        ids = [cam.pin] if cam.pin is not None else cam.reach
        for dev_id in ids:
            d = self.usable.get(dev_id)
            if d is None or dev_id == self.excluded.get(cam.id) or dev_id not in cam.reach:
                continue
            u = self.unit(cam, d.dev)
            if u is not None:
                out.append((d, u))
        self._cands[cam.id] = out
        return out

    def _score(self, cam: Camera, d: _Dev, u: _Unit, fps: float) -> tuple[float | int | str, ...]:
        # Inlined shares: this runs for every (camera, candidate) pair, the planner's inner loop.
        lane, cpu = fps * u.lane * self.k, fps * u.cpu * self.k
        ll, cl = d.lane_limit, d.cpu_limit
        if ll <= 0 or cl <= 0:
            own, after = math.inf, math.inf
        else:
            own = max(lane / ll, cpu / cl)
            after = max((d.lane + lane) / ll, (d.cpu + cpu) / cl)
        strategy = self.pool.strategy
        if strategy == Strategy.PACK:
            term = -d.util()
        elif strategy == Strategy.ENERGY:
            term = fps * u.joules if u.joules is not None else math.inf
        else:
            term = after
        group = d.groups[cam.spread_group] if cam.spread_group else 0
        return (cam.prefer != d.dev.id, group, term, own, d.dev.id)

    def _n1_ok(self, extra: tuple[_Dev, Camera, _Unit] | None = None) -> bool:
        """Each usable device's cameras, at their minimum FPS, fit in the free room of the others."""
        need: dict[str, list[float]] = {i: [0.0, 0.0] for i in self.usable}
        for cam_id, (dev_id, _, _) in self.assign.items():
            cam = self.cams[cam_id]
            u = self.unit(cam, self.usable[dev_id].dev)
            assert u is not None
            need[dev_id][0] += cam.min_fps * u.lane
            need[dev_id][1] += cam.min_fps * u.cpu
        free = {i: [d.lane_limit - d.act_lane, d.cpu_limit - d.act_cpu] for i, d in self.usable.items()}
        if extra is not None:
            d, cam, u = extra
            need[d.dev.id][0] += cam.min_fps * u.lane
            need[d.dev.id][1] += cam.min_fps * u.cpu
            free[d.dev.id][0] -= cam.target_fps * u.lane
            free[d.dev.id][1] -= cam.target_fps * u.cpu
        total = [sum(f[0] for f in free.values()), sum(f[1] for f in free.values())]
        for i, (lane, cpu) in need.items():
            if lane == 0 and cpu == 0:
                continue
            if lane > total[0] - free[i][0] + _EPS or cpu > total[1] - free[i][1] + _EPS:
                return False
        return True

    def place(self, todo: list[Camera]) -> list[Camera]:
        """Step 4: at target FPS where it fits; return those that fit nowhere."""

        def order(cam: Camera) -> tuple[int, float, str]:
            costs = [
                max(_share(u.lane, d.lane_limit), _share(u.cpu, d.cpu_limit))
                for d, u in self._candidates(cam)
            ]
            return (-cam.priority, -cam.target_fps * statistics.median(costs) if costs else 0.0, cam.id)

        left: list[Camera] = []
        k = self.k
        for cam in sorted(todo, key=order):
            best: tuple[tuple[float | int | str, ...], _Dev] | None = None
            reserve = self.pool.reserve_n1 and cam.id not in self.orphan_why
            fps = cam.target_fps
            for d, u in self._candidates(cam):
                if d.lane + fps * u.lane * k > d.lane_limit * (
                    1 + _EPS
                ) or d.cpu + fps * u.cpu * k > d.cpu_limit * (1 + _EPS):
                    continue
                if reserve and not self._n1_ok((d, cam, u)):
                    continue
                s = self._score(cam, d, u, cam.target_fps)
                if best is None or s < best[0]:
                    best = (s, d)
            if best is None:
                left.append(cam)
            else:
                self._place(cam, best[1], cam.target_fps)
        return left

    def _place(self, cam: Camera, d: _Dev, fps: float) -> None:
        self.add(cam, d, fps, self.now)
        if (why := self.orphan_why.get(cam.id)) is not None:
            self.moves.append(Move(cam.id, why[1], d.dev.id, fps, why[0]))

    def degrade(self, left: list[Camera]) -> None:
        """Step 5: lower-priority cameras give up FPS first, then the camera itself, down to minimum."""
        for cam in sorted(left, key=lambda c: (-c.priority, c.id)):
            reserve = self.pool.reserve_n1 and cam.id not in self.orphan_why
            best: tuple[tuple[float | int | str, ...], _Dev, float, list[tuple[Camera, _Unit, float]]] | None
            best = None
            cands = self._candidates(cam)
            for d, u in cands:
                lower = sorted(
                    (self.cams[c] for c in d.cams if self.cams[c].priority < cam.priority),
                    key=lambda c: (c.priority, c.id),
                )
                give: list[tuple[Camera, _Unit, float]] = []
                lane_room = cpu_room = 0.0
                f = self.max_fps(d, u)
                for low in lower:
                    if f >= cam.target_fps:
                        break
                    lu = self.unit(low, d.dev)
                    assert lu is not None
                    spare = d.cams[low.id] - low.min_fps
                    if spare <= 0:
                        continue
                    # What ``cam`` still lacks at its target, per resource, in FPS of ``low``
                    lack_lane = cam.target_fps * u.lane * self.k - (d.lane_limit - d.lane + lane_room)
                    lack_cpu = cam.target_fps * u.cpu * self.k - (d.cpu_limit - d.cpu + cpu_room)
                    cut = max(
                        lack_lane / (lu.lane * self.k) if lu.lane > 0 and lack_lane > 0 else 0.0,
                        lack_cpu / (lu.cpu * self.k) if lu.cpu > 0 and lack_cpu > 0 else 0.0,
                    )
                    cut = min(spare, _ceil_fps(cut))
                    if cut <= 0:
                        continue
                    give.append((low, lu, cut))
                    lane_room += cut * lu.lane * self.k
                    cpu_room += cut * lu.cpu * self.k
                    f = self.max_fps(d, u, lane_room, cpu_room)
                f = min(f, cam.target_fps)
                if f < cam.min_fps:
                    continue
                if reserve and not self._n1_ok((d, cam, u)):
                    continue
                s = (-f, *self._score(cam, d, u, f))
                if best is None or s < best[0]:
                    best = (s, d, f, give)
            if best is None:
                self.unplaced[cam.id] = self._unplaced_reason(cam, cands, reserve)
                continue
            _, d, f, give = best
            for low, _lu, cut in give:
                self.set_fps(low, round(d.cams[low.id] - cut, 2))
                self.why_degraded[low.id] = f"gave way to higher-priority camera {cam.id}"
            self._place(cam, d, f)
            if f < cam.target_fps:
                self.why_degraded[cam.id] = "no candidate device has room at its target FPS"

    def _unplaced_reason(self, cam: Camera, cands: list[tuple[_Dev, _Unit]], reserve: bool) -> str:
        prefix = ""
        if (orphan := self.orphan_why.get(cam.id)) is not None:
            prefix = f"{orphan[0].value} ({orphan[1]}): "
        if not self.usable:
            return prefix + "no device of the site is online and uncordoned"
        if cam.pin is not None and not cands:
            return prefix + f"pinned to {cam.pin}, which cannot run it"
        if not any(i in cam.reach for i in self.usable):
            return prefix + "no usable device reaches its source"
        if not cands:
            return prefix + f"no usable device that reaches it can run {cam.variant}"
        if reserve:
            return prefix + f"no room at min FPS {cam.min_fps:g} that keeps the N+1 reserve"
        return prefix + (
            f"no room at min FPS {cam.min_fps:g} on {len(cands)} candidate device(s), "
            "even with lower-priority cameras there at their minimum"
        )

    def admit_canaries(self) -> None:
        """Step 6: cameras a rollout wants on a canary variant switch to it where they run, at the FPS
        they run at, when the device has room for the difference; never moved for it."""
        for cam in sorted(self.site.cameras, key=lambda c: (-c.priority, c.id)):
            if cam.canary is None or self.canary_on.get(cam.id) == cam.canary:
                continue
            if cam.id not in self.assign:
                self.canary_held[cam.id] = "not placed on any device"
                continue
            dev_id, fps, since = self.assign[cam.id]
            d = self.usable[dev_id]
            new = self.unit(cam, d.dev, cam.canary)
            if new is None:
                self.canary_held[cam.id] = f"{dev_id} cannot run {cam.canary}"
                continue
            old = self.unit(cam, d.dev)
            assert old is not None
            lane = d.lane + fps * (new.lane - old.lane) * self.k
            cpu = d.cpu + fps * (new.cpu - old.cpu) * self.k
            short = []
            if lane > d.lane_limit * (1 + _EPS):
                short.append(f"inference lane {lane:.0f} of {d.lane_limit:.0f} ms/s")
            if cpu > d.cpu_limit * (1 + _EPS):
                short.append(f"CPU {cpu:.0f} of {d.cpu_limit:.0f} ms/s")
            if short:
                self.canary_held[cam.id] = (
                    f"{cam.canary} at {fps:g} FPS does not fit on {dev_id}: it would need "
                    + " and ".join(short)
                    + f" (headroom {self.pool.headroom:g}, costs x{self.k:.2f} at admission)"
                )
                continue
            kept_n1 = self.pool.reserve_n1 and self._n1_ok()
            self.remove(cam)
            self.canary_on[cam.id] = cam.canary
            self.add(cam, d, fps, since)
            if kept_n1 and not self._n1_ok():
                self.remove(cam)
                del self.canary_on[cam.id]
                self.add(cam, d, fps, since)
                self.canary_held[cam.id] = f"{cam.canary} on {dev_id} would break the N+1 reserve"

    def raise_fps(self) -> None:
        """Step 7: degraded cameras regain FPS in place, highest priority first."""
        for cam in sorted(self.site.cameras, key=lambda c: (-c.priority, c.id)):
            if cam.id not in self.assign:
                continue
            dev_id, fps, _ = self.assign[cam.id]
            if fps >= cam.target_fps:
                continue
            d = self.usable[dev_id]
            u = self.unit(cam, d.dev)
            assert u is not None
            if u.assumed:
                # No room is known to have come: wait for a figure measured on a device.
                self.why_degraded.setdefault(cam.id, f"its cost on {dev_id} is not measured yet")
                continue
            f = min(cam.target_fps, self.max_fps(d, u, fps * u.lane * self.k, fps * u.cpu * self.k))
            if f <= fps:
                continue
            kept_n1 = self.pool.reserve_n1 and self._n1_ok()
            self.set_fps(cam, f)
            if kept_n1 and not self._n1_ok():
                self.set_fps(cam, fps)  # the reserve comes before this camera's frames

    def run(self) -> Plan:
        todo = self.keep()
        todo += self.shed_overload()
        self.planned_moves()
        self.degrade(self.place(todo))
        self.admit_canaries()
        self.raise_fps()
        degraded: dict[str, Degraded] = {}
        for cam_id, (_, fps, _) in self.assign.items():
            cam = self.cams[cam_id]
            if fps < cam.target_fps:
                why = self.why_degraded.get(cam_id, "no room to run at its target FPS")
                degraded[cam_id] = Degraded(fps, cam.target_fps, why)
        loads = {
            i: Load(d.act_lane, d.lane_limit, d.act_cpu, d.cpu_limit, len(d.cams))
            for i, d in self.usable.items()
        }
        return Plan(
            placements={
                c: Placement(dev, fps, since, self.canary_on.get(c))
                for c, (dev, fps, since) in sorted(self.assign.items())
            },
            unplaced=dict(sorted(self.unplaced.items())),
            moves=tuple(self.moves),
            held=tuple(self.held),
            degraded=degraded,
            loads=loads,
            n_plus_one=self._n1_ok(),
            canary_held=dict(sorted(self.canary_held.items())),
        )


def plan(site: Site, now: float) -> Plan:
    """Where every camera of the site runs next, and at what FPS. Pure: the same snapshot and time give
    the same plan."""
    return _Planner(site, now).run()
