"""Placement benchmark: ``controller.fleet.placement.plan`` on 100 sites x 10 devices x 100 cameras.

Pure computation on this machine, no broker and no database. Each site has 10 devices drawn from three
device classes whose per-frame costs are the INT8 variants' figures measured in BENCHMARKS.md (model
variants, ms at 1 and 2 intra-op threads; OpenCV decode and the preprocessing of a 768x576 frame):
``xeon-2t`` (Intel VM, one lane of 2 threads), ``epyc-2t`` (AMD EPYC VM, one lane of 2 threads),
``epyc-1t`` (AMD EPYC VM, two lanes of one thread each). 7 devices of 10 report their own costs (each
within ±5 % of its class figure); the others are planned on their class's median. Each camera runs
ped_ssdlite or nanodet_coco at 2, 4 or 5 FPS (minimum: half), reaches 7 of its site's 10 devices, and
has a priority 0-3; a fifth of them prefer a device.

Figures, each printed:
  - full plan: every site planned from nothing, total time (median and range over ``--runs``), and
    as a ratio against the raw limit measured in the same run: sorting each site's cameras once and
    looking up every (camera, device) cost once, the least any planner that considers every pair does;
  - failover: each device of each site killed in turn and its site re-planned from the full plan:
    time per site (p50, p99), moves per failure against the dead device's cameras, collateral moves
    (any other camera changing device; must be 0), orphans left unplaced;
  - noise: every site re-planned once a simulated minute for an hour, each time on costs drawn afresh
    within ±15 % of the truth: moves per site-hour (should be 0), beside a planner without stickiness
    (every minute's plan made from nothing) on the same draws;
  - energy: spread against pack, site power from the plan's CPU loads, under an assumed power model
    (``IDLE_W`` and ``BUSY_W`` per device: not measured, a model), with idle devices on and asleep.

Usage (from the repository root):
``python -m bench.placement [--sites 100] [--runs 5] [--minutes 60] [--seed 1] [--fps-scale 1] [--smoke]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from controller.fleet.placement import (
    Camera,
    Cost,
    Device,
    Measured,
    Plan,
    Pool,
    Site,
    Strategy,
    plan,
)

DEVICES_PER_SITE = 10
CAMERAS_PER_SITE = 100
MEASURED_SHARE = 0.7
REACH = 7  # devices of the site that reach each camera
NOISE = 0.15
DECODE_MS = 0.45  # OpenCV decode + BGR of one 768x576 frame (BENCHMARKS.md, pipeline)
PRE_MS = {"ped_ssdlite/1": 0.454, "nanodet_coco/1": 0.492}  # preprocessing at 720p (bench/preprocess.py)
# Assumed, not measured: a 2-vCPU device's draw idle and with both cores busy.
IDLE_W, BUSY_W = 15.0, 45.0


@dataclass(frozen=True)
class DeviceClass:
    name: str
    lanes: int
    threads: int  # intra-op threads of one lane: CPU time per frame = threads x wall time
    infer_ms: dict[str, float]  # INT8, measured wall time per frame


CLASSES = (
    DeviceClass("xeon-2t", 1, 2, {"ped_ssdlite/1": 7.5, "nanodet_coco/1": 9.8}),
    DeviceClass("epyc-2t", 1, 2, {"ped_ssdlite/1": 8.8, "nanodet_coco/1": 11.2}),
    DeviceClass("epyc-1t", 2, 1, {"ped_ssdlite/1": 11.0, "nanodet_coco/1": 18.2}),
)
CONTROLLER_CLASS = CLASSES[2]  # the controller's own figures: one thread on the EPYC VM


def class_cost(cls: DeviceClass, variant: str, scale: float = 1.0) -> Cost:
    ms = cls.infer_ms[variant] * scale
    return Cost(infer_ms=ms, cpu_ms=cls.threads * ms + PRE_MS[variant])


def make_site(rng: random.Random, n: int, fps_scale: float = 1.0) -> tuple[Site, dict[str, DeviceClass]]:
    classes: dict[str, DeviceClass] = {}
    devices = []
    for i in range(DEVICES_PER_SITE):
        cls = rng.choice(CLASSES)
        dev_id = f"s{n}-box{i}"
        classes[dev_id] = cls
        devices.append(Device(dev_id, cls.name, lane_ms_per_s=1000.0 * cls.lanes, cpu_ms_per_s=2000.0))
    ids = [d.id for d in devices]
    costs: dict[tuple[str, str], Cost] = {}
    for dev_id in rng.sample(ids, round(MEASURED_SHARE * len(ids))):
        for variant in PRE_MS:
            costs[(variant, dev_id)] = class_cost(classes[dev_id], variant, rng.uniform(0.95, 1.05))
    cameras = []
    for i in range(CAMERAS_PER_SITE):
        target = rng.choice([2.0, 4.0, 5.0]) * fps_scale
        reach = frozenset(rng.sample(ids, REACH))
        cameras.append(
            Camera(
                id=f"s{n}-cam{i:03d}",
                variant=rng.choice(list(PRE_MS)),
                target_fps=target,
                min_fps=target / 2,
                reach=reach,
                priority=rng.randint(0, 3),
                prefer=rng.choice(sorted(reach)) if rng.random() < 0.2 else None,
            )
        )
    decode = {(c.id, d): DECODE_MS for c in cameras for d in c.reach}
    priors = {v: class_cost(CONTROLLER_CLASS, v) for v in PRE_MS}
    measured = Measured(costs=costs, decode_ms=decode, priors=priors, default_decode_ms=DECODE_MS)
    return Site(Pool(), tuple(devices), tuple(cameras), measured), classes


def noisy(measured: Measured, rng: random.Random) -> Measured:
    def n(x: float) -> float:
        return x * rng.uniform(1 - NOISE, 1 + NOISE)

    return replace(
        measured,
        costs={k: Cost(n(c.infer_ms), n(c.cpu_ms)) for k, c in measured.costs.items()},
        decode_ms={k: n(v) for k, v in measured.decode_ms.items()},
    )


def raw_pass(sites: list[Site]) -> float:
    """The raw limit: each site's cameras sorted once, every (camera, device) cost looked up once."""
    t = time.perf_counter()
    acc = 0.0
    for s in sites:
        costs = s.measured.costs
        for cam in sorted(s.cameras, key=lambda c: (-c.priority, c.id)):
            for d in s.devices:
                c = costs.get((cam.variant, d.id))
                if c is not None:
                    acc += cam.target_fps * c.infer_ms
    elapsed = time.perf_counter() - t
    assert acc > 0
    return elapsed


def timed(fn: Callable[[], Plan]) -> tuple[Plan, float]:
    t = time.perf_counter()
    p = fn()
    return p, time.perf_counter() - t


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def site_power_w(p: Plan, site: Site, asleep: bool) -> float:
    total = 0.0
    for d in site.devices:
        load = p.loads.get(d.id)
        if load is None or load.cameras == 0:
            total += 0.0 if asleep else IDLE_W
        else:
            util = load.cpu_ms_per_s / d.cpu_ms_per_s
            total += IDLE_W + (BUSY_W - IDLE_W) * util
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sites", type=int, default=100)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--minutes", type=int, default=60, help="simulated minutes of the noise run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--fps-scale", type=float, default=1.0, help="every camera's FPS times this (a fuller site)"
    )
    ap.add_argument("--smoke", action="store_true", help="5 sites, 2 runs, 5 simulated minutes")
    args = ap.parse_args()
    if args.smoke:
        args.sites, args.runs, args.minutes = 5, 2, 5
    rng = random.Random(args.seed)
    built = [make_site(rng, n, args.fps_scale) for n in range(args.sites)]
    sites = [s for s, _ in built]
    n_cams = sum(len(s.cameras) for s in sites)
    n_devs = sum(len(s.devices) for s in sites)
    print(f"placement bench: {args.sites} sites, {n_devs} devices, {n_cams} cameras, FPS x{args.fps_scale:g}")

    # Full plan, alternating with the raw pass so both see the same machine state.
    plan_s: list[float] = []
    raw_s: list[float] = []
    plans: list[Plan] = []
    for _ in range(args.runs):
        raw_s.append(raw_pass(sites))
        t = time.perf_counter()
        plans = [plan(s, 0.0) for s in sites]
        plan_s.append(time.perf_counter() - t)
    ratios = [p / r for p, r in zip(plan_s, raw_s, strict=True)]
    placed = sum(len(p.placements) for p in plans)
    degraded = sum(len(p.degraded) for p in plans)
    print(
        f"full plan   : {statistics.median(plan_s) * 1000:.1f} ms for all sites "
        f"(range {min(plan_s) * 1000:.1f}-{max(plan_s) * 1000:.1f} over {args.runs} runs); "
        f"placed {placed} of {n_cams}, degraded {degraded}, unplaced {n_cams - placed}"
    )
    print(
        f"raw limit   : {statistics.median(raw_s) * 1000:.2f} ms (sort each site's cameras, look up every "
        "(camera, device) cost once)"
    )
    print(
        f"ratio plan / raw: median {statistics.median(ratios):.1f}, range {min(ratios):.1f}-{max(ratios):.1f} "
        f"over {args.runs} runs"
    )

    # Failover: each device of each site killed in turn.
    times: list[float] = []
    moves: list[int] = []
    orphans_n: list[int] = []
    collateral = 0
    left_out = 0
    mismatched = 0
    for s, p in zip(sites, plans, strict=True):
        for dead in s.devices:
            down = replace(
                s,
                devices=tuple(replace(d, online=False) if d.id == dead.id else d for d in s.devices),
                current=p.placements,
            )
            after, dt = timed(partial(plan, down, 30.0))
            times.append(dt)
            orphans = {c for c, pl in p.placements.items() if pl.device == dead.id}
            moved = {m.camera for m in after.moves}
            collateral += len(moved - orphans)
            collateral += sum(
                1
                for c, pl in p.placements.items()
                if c not in orphans and (c not in after.placements or after.placements[c].device != pl.device)
            )
            lost = {c for c in orphans if c in after.unplaced}
            left_out += len(lost)
            mismatched += int(moved | lost != orphans)
            moves.append(len(moved))
            orphans_n.append(len(orphans))
    print(
        f"failover    : per site p50 {pct(times, 0.5) * 1000:.2f} ms, p99 {pct(times, 0.99) * 1000:.2f} ms "
        f"over {len(times)} failures (every device of every site)"
    )
    print(
        f"moves/failure: {statistics.mean(moves):.2f} (dead device's cameras {statistics.mean(orphans_n):.2f}; "
        f"orphans left unplaced {left_out} in all; failures where moves + unplaced != orphans: {mismatched})"
    )
    print(f"collateral moves: {collateral}")

    # Noise: an hour of re-plans, one a simulated minute, on fresh ±15 % draws each time.
    sticky_moves = 0
    naive_moves = 0
    noise_rng = random.Random(args.seed + 1)
    for s, p in zip(sites, plans, strict=True):
        current = p.placements
        previous_fresh = {c: pl.device for c, pl in p.placements.items()}
        for minute in range(1, args.minutes + 1):
            m = noisy(s.measured, noise_rng)
            q = plan(replace(s, measured=m, current=current), 60.0 * minute)
            sticky_moves += len(q.moves)
            current = q.placements
            fresh = {c: pl.device for c, pl in plan(replace(s, measured=m), 60.0 * minute).placements.items()}
            naive_moves += sum(1 for c, d in fresh.items() if c in previous_fresh and previous_fresh[c] != d)
            previous_fresh = fresh
    hours = args.sites * args.minutes / 60.0
    print(
        f"noise ±{NOISE:.0%}  : {sticky_moves / hours:.1f} moves per site-hour ({sticky_moves} in "
        f"{args.sites} sites x {args.minutes} re-plans); without stickiness {naive_moves / hours:.1f} "
        "per site-hour"
    )

    # Energy: spread against pack, from the same sites.
    for strategy in (Strategy.SPREAD, Strategy.PACK):
        ps = [plan(replace(s, pool=replace(s.pool, strategy=strategy)), 0.0) for s in sites]
        used = sum(sum(1 for ld in p.loads.values() if ld.cameras) for p in ps)
        on = sum(site_power_w(p, s, asleep=False) for p, s in zip(ps, sites, strict=True))
        asleep = sum(site_power_w(p, s, asleep=True) for p, s in zip(ps, sites, strict=True))
        print(
            f"energy {strategy.value:<6}: {used} of {n_devs} devices loaded, modelled {on / 1000:.2f} kW with idle "
            f"devices on, {asleep / 1000:.2f} kW with them asleep (assumed {IDLE_W:g} W idle, {BUSY_W:g} W busy)"
        )


if __name__ == "__main__":
    main()
