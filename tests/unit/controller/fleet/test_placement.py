"""Camera placement (``controller.fleet.placement.plan``): the promises a site's operator relies on,
as properties over generated sites (hypothesis) and as worked cases.

Properties: no device is ever above headroom, and no camera runs on an offline, cordoned, unreachable
or unfit device; one device's failure moves only its own cameras; re-planning a plan moves nothing;
±15 % noise in the measured costs moves nothing; a whole-site outage moves nothing; a device coming
back gets nothing back under ``never`` and only the cameras that prefer it under ``preferred``; with
the N+1 reserve, a fresh plan survives the loss of any one device; when room runs short,
lower-priority cameras lose FPS first; a canary variant a rollout wants is admitted only where its
cost fits, moves no camera, survives the same noise, and withdrawn gives every camera its own
variant back where it runs.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.fleet.placement import (
    Camera,
    Cost,
    Degraded,
    Device,
    Failback,
    Measured,
    MoveReason,
    Placement,
    Plan,
    Pool,
    Site,
    Strategy,
    class_medians,
    estimate_cost,
    estimate_decode_ms,
    plan,
)

# Modest counts: the file must stay well under a minute on a 2-core machine.
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VARIANTS = ("ped_ssdlite/1", "nanodet_coco/1")
T0 = 1_000_000.0


@st.composite
def sites(draw: st.DrawFn, *, min_devices: int = 1) -> Site:
    """A site where every device is up: devices of a few classes, cameras that reach some of them,
    costs measured on some devices (the rest estimated), and a pool with any strategy."""
    n_dev = draw(st.integers(min_devices, 6))
    devices = tuple(
        Device(
            id=f"box-{i}",
            hw_class=draw(st.sampled_from(["epyc", "xeon", "orin"])),
            lane_ms_per_s=draw(st.sampled_from([1000.0, 2000.0])),
            cpu_ms_per_s=draw(st.sampled_from([1000.0, 2000.0, 4000.0])),
            speed=draw(st.sampled_from([0.5, 1.0, 2.0])),
        )
        for i in range(n_dev)
    )
    ids = [d.id for d in devices]
    cameras = []
    for i in range(draw(st.integers(0, 24))):
        target = draw(st.sampled_from([1.0, 2.0, 5.0, 10.0, 15.0]))
        reach = draw(st.sets(st.sampled_from(ids), min_size=1))
        cameras.append(
            Camera(
                id=f"cam-{i}",
                variant=draw(st.sampled_from(VARIANTS)),
                target_fps=target,
                min_fps=target * draw(st.sampled_from([0.2, 0.5, 1.0])),
                reach=frozenset(reach),
                priority=draw(st.integers(0, 3)),
                spread_group=draw(st.sampled_from([None, "entrance", "yard"])),
                prefer=draw(st.sampled_from([None, *ids])),
            )
        )
    costs = {}
    for v in VARIANTS:
        for d in ids:
            if draw(st.booleans()):
                costs[(v, d)] = Cost(
                    infer_ms=draw(st.floats(1.0, 60.0)),
                    cpu_ms=draw(st.floats(0.0, 40.0)),
                    joules=draw(st.sampled_from([None, 0.05, 0.4])),
                )
    decode = {(c.id, d): draw(st.floats(0.3, 4.0)) for c in cameras for d in c.reach if draw(st.booleans())}
    measured = Measured(
        costs=costs, decode_ms=decode, priors={v: Cost(infer_ms=20.0, cpu_ms=10.0) for v in VARIANTS}
    )
    pool = Pool(
        strategy=draw(st.sampled_from(list(Strategy))),
        headroom=draw(st.sampled_from([0.5, 0.8, 1.0])),
        failback=draw(st.sampled_from(list(Failback))),
        reserve_n1=draw(st.booleans()),
    )
    return Site(pool=pool, devices=devices, cameras=tuple(cameras), measured=measured)


def with_devices(site: Site, **changes: dict[str, Any]) -> Site:
    """``online={"box-1": False}`` and the like: the same site with some devices changed."""
    devices = []
    for d in site.devices:
        fields = {name: per[d.id] for name, per in changes.items() if d.id in per}
        devices.append(replace(d, **fields))
    return replace(site, devices=tuple(devices))


def noisy(measured: Measured, rng: random.Random, spread: float = 0.15) -> Measured:
    def n(x: float) -> float:
        return x * rng.uniform(1 - spread, 1 + spread)

    return replace(
        measured,
        costs={
            k: Cost(n(c.infer_ms), n(c.cpu_ms), None if c.joules is None else n(c.joules))
            for k, c in measured.costs.items()
        },
        decode_ms={k: n(v) for k, v in measured.decode_ms.items()},
    )


def check_valid(site: Site, p: Plan) -> None:
    """Every placement on a usable device that reaches and runs the camera, FPS within bounds, and no
    device above headroom (loads recomputed here from the placements and the cost rule)."""
    devices = {d.id: d for d in site.devices}
    cams = {c.id: c for c in site.cameras}
    medians = class_medians(site.measured, site.devices)
    lane = dict.fromkeys(devices, 0.0)
    cpu = dict.fromkeys(devices, 0.0)
    assert set(p.placements).isdisjoint(p.unplaced)
    assert set(p.placements) | set(p.unplaced) == set(cams)
    for cam_id, pl in p.placements.items():
        cam, dev = cams[cam_id], devices[pl.device]
        assert dev.online and not dev.cordoned, (cam_id, pl)
        assert pl.device in cam.reach, (cam_id, pl)
        assert cam.pin is None or cam.pin == pl.device
        assert cam.min_fps - 1e-9 <= pl.fps <= cam.target_fps + 1e-9, (cam_id, pl)
        assert pl.canary is None or pl.canary == cam.canary, (cam_id, pl)
        cost = estimate_cost(pl.canary or cam.variant, dev, site.measured, medians)
        assert cost is not None
        lane[dev.id] += pl.fps * cost.infer_ms
        cpu[dev.id] += pl.fps * (cost.cpu_ms + estimate_decode_ms(cam_id, dev, site.measured, devices))
    h = site.pool.headroom
    for d in site.devices:
        assert lane[d.id] <= h * d.lane_ms_per_s * (1 + 1e-6), (d.id, lane[d.id])
        assert cpu[d.id] <= h * d.cpu_ms_per_s * (1 + 1e-6), (d.id, cpu[d.id])
    for cam_id, deg in p.degraded.items():
        assert p.placements[cam_id].fps == deg.fps < cams[cam_id].target_fps


def devices_of(p: Plan) -> dict[str, str]:
    return {c: pl.device for c, pl in p.placements.items()}


# --- properties


@PROPS
@given(site=sites())
def test_a_fresh_plan_keeps_every_device_under_headroom_and_every_camera_where_it_can_run(site: Site) -> None:
    p = plan(site, T0)
    check_valid(site, p)
    assert not p.moves and not p.held


@PROPS
@given(
    site=sites(),
    data=st.data(),
)
def test_any_current_state_and_any_outage_give_a_valid_plan(site: Site, data: st.DataObject) -> None:
    """Whatever the caller says runs where (even on devices now down, or above headroom), the plan
    places nothing on a device that is offline, cordoned, unreachable, or over headroom."""
    ids = [d.id for d in site.devices]
    current = {
        c.id: Placement(data.draw(st.sampled_from([*ids, "box-gone"])), c.target_fps, T0 - 3600)
        for c in site.cameras
        if data.draw(st.booleans())
    }
    site = with_devices(
        replace(site, current=current),
        online={i: data.draw(st.booleans()) for i in ids},
        cordoned={i: data.draw(st.booleans()) for i in ids},
    )
    p = plan(site, T0)
    check_valid(site, p)
    for m in p.moves:
        assert current[m.camera].device == m.source != m.target
        assert m.reason in {*MoveReason}


@PROPS
@given(site=sites(min_devices=2), data=st.data())
def test_a_device_failure_moves_only_that_devices_cameras(site: Site, data: st.DataObject) -> None:
    before = plan(site, T0)
    dead = data.draw(st.sampled_from([d.id for d in site.devices]))
    after_site = with_devices(replace(site, current=before.placements), online={dead: False})
    after = plan(after_site, T0 + 30)
    check_valid(after_site, after)
    orphans = {c for c, pl in before.placements.items() if pl.device == dead}
    assert {m.camera for m in after.moves} <= orphans
    assert all(m.reason == MoveReason.DEVICE_OFFLINE and m.source == dead for m in after.moves)
    # Every orphan is moved or unplaced with its reason; every other camera stays where it was.
    for cam in orphans:
        assert cam in {m.camera for m in after.moves} or after.unplaced[cam].startswith("device_offline")
    for cam, pl in before.placements.items():
        if cam not in orphans:
            assert after.placements[cam].device == pl.device


@PROPS
@given(site=sites())
def test_with_the_reserve_a_fresh_plan_survives_the_loss_of_any_one_device(site: Site) -> None:
    p = plan(replace(site, pool=replace(site.pool, reserve_n1=True)), T0)
    assert p.n_plus_one


@PROPS
@given(site=sites(), data=st.data())
def test_replanning_a_plan_changes_nothing(site: Site, data: st.DataObject) -> None:
    first = plan(site, T0)
    if data.draw(st.booleans()) and site.devices:  # also the plan made after a failure
        dead = data.draw(st.sampled_from([d.id for d in site.devices]))
        site = with_devices(replace(site, current=first.placements), online={dead: False})
        first = plan(site, T0 + 30)
    again = plan(replace(site, current=first.placements), T0 + 60)
    assert not again.moves
    assert again.placements == first.placements
    assert again.unplaced.keys() == first.unplaced.keys()


@PROPS
@given(site=sites(), seed=st.integers(0, 2**32 - 1))
def test_fifteen_percent_noise_in_measured_costs_moves_nothing(site: Site, seed: int) -> None:
    site = replace(site, pool=replace(site.pool, failback=Failback.NEVER))
    first = plan(site, T0)
    rng = random.Random(seed)
    current = first.placements
    for i in range(3):  # a few re-plans, each on fresh noise around the same true costs
        s = replace(site, measured=noisy(site.measured, rng), current=current)
        p = plan(s, T0 + 60 * (i + 1))
        check_valid(s, p)
        assert not p.moves
        assert {c: pl.device for c, pl in p.placements.items() if c in first.placements} == devices_of(first)
        current = p.placements


@PROPS
@given(site=sites())
def test_a_whole_site_outage_moves_nothing(site: Site) -> None:
    first = plan(site, T0)
    down = with_devices(replace(site, current=first.placements), online={d.id: False for d in site.devices})
    p = plan(down, T0 + 30)
    assert not p.moves and not p.placements and not p.loads
    assert set(p.unplaced) == {c.id for c in site.cameras}
    # The site comes back: every camera is where it was, nothing moved.
    back = plan(replace(site, current=first.placements), T0 + 60)
    assert not back.moves and devices_of(back) == devices_of(first)


@PROPS
@given(site=sites(min_devices=2), data=st.data())
def test_a_returning_device_gets_nothing_back_under_never_and_only_its_own_under_preferred(
    site: Site, data: st.DataObject
) -> None:
    first = plan(site, T0)
    dead = data.draw(st.sampled_from([d.id for d in site.devices]))
    failed = plan(with_devices(replace(site, current=first.placements), online={dead: False}), T0 + 30)
    later = T0 + 30 + 2 * site.pool.min_dwell_s
    # Every device up for long, the dead one back since T0 + 60, and long enough for any dwell.
    up = {d.id: T0 - 86_400 for d in site.devices} | {dead: T0 + 60}
    never = replace(
        with_devices(site, up_since=up),
        pool=replace(site.pool, failback=Failback.NEVER, max_moves_per_min=1000),
        current=failed.placements,
    )
    assert not plan(never, later).moves
    preferred = replace(never, pool=replace(never.pool, failback=Failback.PREFERRED))
    p = plan(preferred, later)
    check_valid(preferred, p)
    cams = {c.id: c for c in site.cameras}
    for m in p.moves:
        assert m.reason == MoveReason.FAILBACK
        assert m.target == dead == cams[m.camera].prefer


@PROPS
@given(
    priorities=st.lists(st.integers(0, 4), min_size=1, max_size=30),
    target=st.sampled_from([5.0, 10.0]),
    min_share=st.sampled_from([0.2, 0.5]),
    lane=st.sampled_from([500.0, 1000.0, 2000.0]),
)
def test_lower_priority_cameras_lose_fps_first_and_are_left_out_first(
    priorities: list[int], target: float, min_share: float, lane: float
) -> None:
    """Alike cameras on one device: a camera runs below its target only when every placed camera of
    lower priority runs at its minimum, and is left out only when those too are at their minimum."""
    cams = tuple(
        Camera(f"cam-{i:02d}", "v", target, target * min_share, frozenset({"box"}), priority=p)
        for i, p in enumerate(priorities)
    )
    site = Site(
        Pool(),
        (Device("box", "epyc", lane_ms_per_s=lane, cpu_ms_per_s=1e9),),
        cams,
        Measured(costs={("v", "box"): Cost(infer_ms=10.0)}),
    )
    p = plan(site, T0)
    check_valid(site, p)
    short = [c for c in cams if c.id in p.unplaced or c.id in p.degraded]
    for a in short:
        for b in cams:
            if b.priority < a.priority and b.id in p.placements:
                assert p.placements[b.id].fps == b.min_fps, (a, b, p.placements[b.id])


# --- worked cases


def site_of(devices: list[Device], cameras: list[Camera], **pool: Any) -> Site:
    costs = {("v", d.id): Cost(infer_ms=20.0, cpu_ms=5.0) for d in devices}
    return Site(Pool(**pool), tuple(devices), tuple(cameras), Measured(costs=costs))


def cam(i: int, reach: set[str], **kw: Any) -> Camera:
    fields: dict[str, Any] = {"target_fps": 5.0, "min_fps": 2.0, **kw}
    return Camera(f"cam-{i}", "v", reach=frozenset(reach), **fields)


def test_an_unseen_pair_takes_its_class_median_else_the_controller_figure_scaled() -> None:
    a1, a2, a3 = (Device(f"a{i}", "epyc") for i in (1, 2, 3))
    new_class = Device("g1", "orin", speed=0.25)
    measured = Measured(
        costs={("v", "a1"): Cost(10.0, 1.0, 0.2), ("v", "a2"): Cost(30.0, 3.0)},
        decode_ms={("cam", "a1"): 1.0, ("cam", "a2"): 3.0},
        priors={"v": Cost(40.0, 8.0)},
        default_decode_ms=2.5,
    )
    devices = [a1, a2, a3, new_class]
    medians = class_medians(measured, devices)
    assert estimate_cost("v", a1, measured, medians) == Cost(10.0, 1.0, 0.2)  # measured there
    assert estimate_cost("v", a3, measured, medians) == Cost(20.0, 2.0, 0.2)  # its class's median
    assert estimate_cost("v", new_class, measured, medians) == Cost(10.0, 2.0, None)  # prior x speed
    assert estimate_cost("other", a3, measured, medians) is None  # nothing to plan with
    peers = {d.id: d for d in devices}
    assert estimate_decode_ms("cam", a3, measured, peers) == 2.0
    assert estimate_decode_ms("cam", new_class, measured, peers) == 2.5


def test_spread_evens_the_load_and_pack_fills_one_device_first() -> None:
    devices = [Device("a", "epyc"), Device("b", "epyc")]
    cameras = [cam(i, {"a", "b"}) for i in range(4)]  # 100 ms/s each; 800 ms/s of room per device
    spread = plan(site_of(devices, cameras), T0)
    assert sorted(pl.device for pl in spread.placements.values()) == ["a", "a", "b", "b"]
    pack = plan(site_of(devices, cameras, strategy=Strategy.PACK), T0)
    assert {pl.device for pl in pack.placements.values()} == {"a"}


def test_energy_picks_the_device_with_fewer_joules_a_frame() -> None:
    devices = [Device("cpu", "epyc"), Device("gpu", "orin")]
    measured = Measured(costs={("v", "cpu"): Cost(10.0, joules=0.5), ("v", "gpu"): Cost(20.0, joules=0.1)})
    site = Site(Pool(strategy=Strategy.ENERGY), tuple(devices), (cam(0, {"cpu", "gpu"}),), measured)
    assert plan(site, T0).placements["cam-0"].device == "gpu"


def test_spread_groups_and_preference_steer_the_choice() -> None:
    devices = [Device("a", "epyc"), Device("b", "epyc"), Device("c", "epyc")]
    cameras = [cam(i, {"a", "b", "c"}, spread_group="entrance", priority=1) for i in range(3)]
    cameras.append(cam(9, {"a", "b", "c"}, prefer="b"))
    p = plan(site_of(devices, cameras, strategy=Strategy.PACK), T0)
    assert sorted(p.placements[f"cam-{i}"].device for i in range(3)) == ["a", "b", "c"]
    assert p.placements["cam-9"].device == "b"


def test_an_orphan_of_higher_priority_makes_lower_priority_cameras_give_fps_not_move() -> None:
    # One device of 800 ms/s (headroom 0.8) holds six low-priority cameras at 5 FPS (600 ms/s measured).
    devices = [Device("a", "epyc"), Device("b", "epyc", online=False)]
    low = [cam(i, {"a"}, priority=0) for i in range(6)]
    vip = cam(9, {"a", "b"}, priority=5, target_fps=5.0, min_fps=5.0)
    current = {c.id: Placement("a", 5.0, T0 - 60) for c in low} | {"cam-9": Placement("b", 5.0, T0 - 60)}
    site = replace(site_of(devices, [*low, vip]), current=current)
    p = plan(site, T0)
    check_valid(site, p)
    assert [(m.camera, m.source, m.target, m.reason) for m in p.moves] == [
        ("cam-9", "b", "a", MoveReason.DEVICE_OFFLINE)
    ]
    assert p.placements["cam-9"].fps == 5.0
    assert all(p.placements[c.id].device == "a" for c in low)
    gave = {c: d for c, d in p.degraded.items() if c != "cam-9"}
    assert gave and all(d.reason == "gave way to higher-priority camera cam-9" for d in gave.values())


def test_unplaced_cameras_say_why() -> None:
    devices = [Device("a", "epyc", runs=frozenset({"other"})), Device("b", "epyc"), Device("c", "epyc")]
    cameras = [
        cam(0, {"a"}),  # only a reaches it, and a cannot run the variant
        cam(1, {"zzz"}),  # nothing usable reaches it
        cam(2, {"b"}, target_fps=50.0, min_fps=50.0),  # 1,000 ms/s of inference: no room anywhere
        cam(3, {"b", "c"}, pin="c"),
    ]
    site = with_devices(site_of(devices, cameras), online={"c": False})
    p = plan(site, T0)
    assert p.unplaced["cam-0"] == "no usable device that reaches it can run v"
    assert p.unplaced["cam-1"] == "no usable device reaches its source"
    assert p.unplaced["cam-2"].startswith("no room at min FPS 50 on 1 candidate device(s)")
    assert p.unplaced["cam-3"] == "pinned to c, which cannot run it"


def test_costs_risen_beyond_the_margin_shed_the_lowest_priority_cameras_as_overload() -> None:
    devices = [Device("a", "epyc"), Device("b", "epyc")]
    cameras = [cam(i, {"a", "b"}, priority=i) for i in range(6)]
    current = {c.id: Placement("a", 5.0, T0 - 60) for c in cameras}  # 600 of 800 ms/s at 20 ms
    site = replace(site_of(devices, cameras), current=current)
    assert not plan(site, T0).moves
    worse = replace(site, measured=Measured(costs={("v", "a"): Cost(30.0), ("v", "b"): Cost(20.0)}))
    p = plan(worse, T0)  # 900 ms/s measured on a: over its 800
    check_valid(worse, p)
    assert p.moves and all(m.reason == MoveReason.OVERLOAD and m.target == "b" for m in p.moves)
    moved = sorted(int(m.camera.split("-")[1]) for m in p.moves)
    assert moved == list(range(len(moved)))  # lowest priorities first
    assert not plan(replace(worse, current=p.placements), T0 + 1).moves  # and it settles


def test_a_degraded_camera_regains_fps_only_on_a_measured_cost_so_it_is_not_bounced() -> None:
    # cam-9 was shed from a (its variant measured there at 1000 ms a frame) and placed on b at 0.5 FPS;
    # a no longer runs it and b has not run a frame of it yet, so only the controller's 40 ms is known.
    devices = [Device("a", "epyc"), Device("b", "epyc")]
    light = [cam(i, {"a", "b"}, target_fps=1.0, min_fps=1.0) for i in range(2)]
    heavy = Camera("cam-9", "heavy", target_fps=1.0, min_fps=0.1, reach=frozenset({"a", "b"}), priority=-1)
    costs = {("v", d.id): Cost(20.0, 5.0) for d in devices}
    current = {
        "cam-0": Placement("a", 1.0, T0 - 60),
        "cam-1": Placement("b", 1.0, T0 - 60),
        "cam-9": Placement("b", 0.5, T0 - 5),
    }
    site = Site(
        Pool(),
        tuple(devices),
        (*light, heavy),
        Measured(costs=costs, priors={"heavy": Cost(40.0, 40.0)}),
        current=current,
    )
    p = plan(site, T0)
    # At 40 ms it would fit at 1 FPS, but nothing says it costs that: it keeps the FPS it was placed at.
    assert not p.moves and p.placements["cam-9"] == current["cam-9"]
    assert p.degraded["cam-9"] == Degraded(0.5, 1.0, "its cost on b is not measured yet")

    # b's own figure is a's: 500 + 20 of its 800 ms/s, no overload and nothing moves.
    dear = replace(site.measured, costs={**costs, ("heavy", "b"): Cost(1000.0, 1000.0)})
    p = plan(replace(site, measured=dear, current=p.placements), T0 + 1)
    check_valid(replace(site, measured=dear), p)
    assert not p.moves and p.placements["cam-9"].device == "b"
    assert 0.5 <= p.placements["cam-9"].fps < 0.6  # what fits at admission, measured

    # Cheaper than feared: it regains its target in place.
    cheap = replace(site.measured, costs={**costs, ("heavy", "b"): Cost(100.0, 100.0)})
    p = plan(replace(site, measured=cheap, current=p.placements), T0 + 2)
    assert not p.moves and p.placements["cam-9"] == Placement("b", 1.0, T0 - 5)
    assert "cam-9" not in p.degraded


def test_failback_waits_its_dwell_and_the_rate_limit_but_failures_never_wait() -> None:
    devices = [Device("a", "epyc"), Device("b", "epyc", up_since=T0)]
    cameras = [cam(i, {"a", "b"}, prefer="b") for i in range(4)]
    current = {c.id: Placement("a", 5.0, T0 - 100) for c in cameras}  # placed while b was down
    site = replace(
        site_of(devices, cameras, failback=Failback.PREFERRED, min_dwell_s=600.0, max_moves_per_min=3),
        current=current,
    )
    assert not plan(site, T0 + 599).moves  # b not up for the dwell time yet
    assert not plan(with_devices(site, up_since={"b": T0 - 200}), T0 + 600).moves  # b was up before
    p = plan(site, T0 + 600)
    assert [m.reason for m in p.moves] == [MoveReason.FAILBACK] * 3
    assert len(p.held) == 1 and "3 moves a minute" in p.held[0].why
    # Two moves made in the last minute leave room for one.
    p = plan(replace(site, recent_moves=(T0 + 550, T0 + 560, T0 + 500)), T0 + 600)
    assert len(p.moves) == 1
    # A failure is never held back, whatever the budget says.
    down = with_devices(replace(site, recent_moves=(T0 + 599,) * 10), online={"a": False})
    p = plan(down, T0 + 600)
    assert len(p.moves) == 4 and all(m.reason == MoveReason.DEVICE_OFFLINE for m in p.moves)


def test_an_operator_pin_moves_the_camera_as_a_manual_move() -> None:
    devices = [Device("a", "epyc"), Device("b", "epyc")]
    site = replace(
        site_of(devices, [cam(0, {"a", "b"}, pin="b")]), current={"cam-0": Placement("a", 5.0, T0 - 10)}
    )
    p = plan(site, T0)
    assert [(m.source, m.target, m.reason) for m in p.moves] == [("a", "b", MoveReason.MANUAL)]
    assert p.placements["cam-0"] == Placement("b", 5.0, T0)
    # Pinned to a device that is down: it stays where it runs, and the move is shown as held.
    p = plan(with_devices(site, online={"b": False}), T0)
    assert not p.moves and p.placements["cam-0"].device == "a"
    assert [(h.move.target, h.move.reason, h.why) for h in p.held] == [
        ("b", MoveReason.MANUAL, "b: device_offline")
    ]


@pytest.mark.parametrize("reserve", [False, True])
def test_n_plus_one_is_reported_and_with_the_reserve_new_cameras_keep_it(reserve: bool) -> None:
    devices = [Device("a", "epyc"), Device("b", "epyc")]
    cameras = [cam(i, {"a", "b"}, min_fps=5.0) for i in range(12)]  # 100 ms/s each, 800 of room a device
    p = plan(site_of(devices, cameras, reserve_n1=reserve), T0)
    if reserve:
        assert p.n_plus_one
        assert len(p.placements) == 8  # either device can take the other's 4 cameras
        assert all("N+1" in why for why in p.unplaced.values())
    else:
        assert not p.n_plus_one
        assert len(p.placements) == 10  # 5 a device: admitted at x1.35, 135 of 800 ms/s each


# --- canary variants (a rollout of pool cameras)


def with_canaries(site: Site, wanted: dict[str, str]) -> Site:
    """The same site with ``wanted`` (camera -> variant) as the variants rollouts want."""
    return replace(site, cameras=tuple(replace(c, canary=wanted.get(c.id)) for c in site.cameras))


def other(variant: str) -> str:
    return VARIANTS[1] if variant == VARIANTS[0] else VARIANTS[0]


@PROPS
@given(site=sites(), seed=st.integers(0, 2**32 - 1))
def test_a_canary_is_admitted_only_where_its_cost_fits_and_never_moves_a_camera(
    site: Site, seed: int
) -> None:
    first = plan(site, T0)
    rng = random.Random(seed)
    wanted = {c.id: other(c.variant) for c in site.cameras if rng.random() < 0.5}
    canary = replace(with_canaries(site, wanted), current=first.placements)
    p = plan(canary, T0 + 60)
    check_valid(canary, p)  # headroom holds with every admitted canary at its own cost
    assert not p.moves and devices_of(p) == devices_of(first)
    for cam_id, variant in wanted.items():
        placed = p.placements.get(cam_id)
        admitted = placed is not None and placed.canary == variant
        assert admitted != (cam_id in p.canary_held), (cam_id, placed, p.canary_held)
    assert set(p.canary_held) <= set(wanted)
    # Withdrawn (a roll back): every camera runs its own variant again, where it ran.
    back = plan(replace(site, current=p.placements), T0 + 120)
    check_valid(site, back)
    assert not back.moves and devices_of(back) == devices_of(first)
    assert all(pl.canary is None for pl in back.placements.values()) and not back.canary_held


@PROPS
@given(site=sites(), seed=st.integers(0, 2**32 - 1))
def test_an_admitted_canary_survives_fifteen_percent_noise(site: Site, seed: int) -> None:
    site = replace(site, pool=replace(site.pool, failback=Failback.NEVER))
    first = plan(site, T0)
    canary = with_canaries(site, {c.id: other(c.variant) for c in site.cameras})
    admitted = plan(replace(canary, current=first.placements), T0 + 60)
    rng = random.Random(seed)
    current = admitted.placements
    for i in range(3):
        s = replace(canary, measured=noisy(canary.measured, rng), current=current)
        p = plan(s, T0 + 120 + 60 * i)
        check_valid(s, p)
        assert not p.moves
        # Once admitted, a canary stays (a held one may get in on a low sample, and then stays too).
        assert all(p.placements[c].canary == pl.canary for c, pl in current.items() if pl.canary)
        current = p.placements


def canary_site(lane_ms: float, canary_ms: float, **pool: Any) -> Site:
    """Box a runs three 5 FPS cameras of v (20 ms a frame: 300 of its 800 ms/s); box b is empty. cam-0's
    rollout wants v2 on it, measured at ``canary_ms`` a frame on a."""
    devices = [Device("a", "epyc", lane_ms_per_s=lane_ms), Device("b", "xeon")]
    cameras = [cam(i, {"a", "b"}) for i in range(3)]
    current = {c.id: Placement("a", 5.0, T0 - 60) for c in cameras}
    measured = Measured(
        costs={("v", "a"): Cost(20.0), ("v", "b"): Cost(20.0), ("v2", "a"): Cost(canary_ms)},
        priors={"v2": Cost(infer_ms=canary_ms)},
    )
    site = Site(Pool(**pool), tuple(devices), tuple(cameras), measured, current=current)
    return with_canaries(site, {"cam-0": "v2"})


def test_a_canary_that_fits_runs_where_the_camera_is() -> None:
    # At the admission factor (x1.35): 300 ms/s of v, and 5 FPS x 40 ms more for v2: 676 of 800 ms/s.
    site = canary_site(1000.0, 60.0)
    p = plan(site, T0)
    check_valid(site, p)
    assert p.placements["cam-0"] == Placement("a", 5.0, T0 - 60, canary="v2")
    assert not p.moves and not p.canary_held
    assert p.loads["a"].lane_ms_per_s == 500.0  # measured: 2 x 100 + 300


def test_a_canary_that_does_not_fit_is_held_with_why_and_nothing_is_overloaded() -> None:
    # At the admission factor (x1.35): 300 ms/s of v, and 5 FPS x 100 ms more for v2: 1,082 of 800 ms/s.
    # Held: the camera stays on v.
    site = canary_site(1000.0, 120.0)
    p = plan(site, T0)
    check_valid(site, p)
    assert p.placements["cam-0"] == Placement("a", 5.0, T0 - 60)
    assert not p.moves  # no camera moved to make room, none moved to where it would fit
    assert p.canary_held["cam-0"] == (
        "v2 at 5 FPS does not fit on a: it would need inference lane 1082 of 800 ms/s "
        "(headroom 0.8, costs x1.35 at admission)"
    )
    assert p.loads["a"].lane_ms_per_s == 300.0
    # A device that cannot run the canary at all says so.
    unfit = with_devices(site, runs={"a": frozenset({"v"})})
    assert plan(unfit, T0).canary_held["cam-0"] == "a cannot run v2"


def test_a_failover_places_the_camera_on_its_own_variant_and_gives_it_the_canary_where_it_fits() -> None:
    admitted = plan(canary_site(1000.0, 60.0), T0)
    down = with_devices(replace(canary_site(1000.0, 60.0), current=admitted.placements), online={"a": False})
    p = plan(down, T0 + 30)
    check_valid(down, p)
    assert {m.camera for m in p.moves} == {"cam-0", "cam-1", "cam-2"}
    # b has no measurement of v2: the controller's figure (60 ms, speed 1) decides, and it fits.
    assert p.placements["cam-0"].device == "b" and p.placements["cam-0"].canary == "v2"
    # With room for the camera but not its canary, it runs its own variant there, held.
    tight = with_devices(
        replace(canary_site(1000.0, 200.0), current={"cam-0": Placement("a", 5.0, T0 - 60, "v2")}),
        online={"a": False},
    )
    p = plan(tight, T0 + 30)
    check_valid(tight, p)
    assert p.placements["cam-0"] == Placement("b", 5.0, T0 + 30)
    assert "does not fit on b" in p.canary_held["cam-0"]
