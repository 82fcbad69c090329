"""Placement benchmark: ``controller.fleet.placement.plan`` on 100 sites x 10 devices x 100 cameras, then
the publish of the desired states a plan changes.

The planner's figures are pure computation on this machine, no broker and no database. Each site has
10 devices drawn from three device classes whose per-frame costs are the INT8 variants' figures
measured in BENCHMARKS.md (model variants, ms at 1 and 2 intra-op threads; OpenCV decode and the
preprocessing of a 768x576 frame):
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
    (``IDLE_W`` and ``BUSY_W`` per device: not measured, a model), with idle devices on and asleep;
  - publish (``--publish N`` devices, 0 skips it): what the controller does once a plan has moved
    cameras, on real parts: a mosquitto the bench starts, SQLite in a temp dir, the bundled models
    registered, and the controller's own ``TwinService`` on its ``MqttBridge`` and ``PahoTransport``
    (wired as ``controller/runtime.py`` wires them; the runtime's workers stay off). N enrolled devices
    in sites of 10, one pool per site, ``--cameras-per-device`` pool cameras placed on each. Each of
    ``--publish-runs`` runs stores a plan that moves every camera to the next device of its site, then
    times ``TwinService.recompute_many`` over the N devices: each device's state derived again (its
    pool cameras through ``placed_on``, those it could be given to probe through ``probe_for``),
    signed, committed and published retained at QoS 1, the PUBACK waited for, one device after the
    other. Printed: total and per-device time, the part spent in the
    confirmed publish, and the ratio to the raw limit measured after it in the same run: a bare paho
    client publishing the same N signed payloads (retained, QoS 1) to the same broker, one in flight
    at a time as the controller does, and pipelined (all sent, then every PUBACK waited for). Then a
    new subscriber on every device's desired topic counts what the broker retains: N states, signed
    for their device, at the version committed, naming the cameras (and sources) the last plan gives.

Results and what limits each figure: BENCHMARKS.md, "Camera placement".

Usage (from the repository root):
``python -m bench.placement [--sites 100] [--runs 5] [--minutes 60] [--seed 1] [--fps-scale 1]
[--publish 1000] [--publish-runs 3] [--cameras-per-device 10] [--smoke]``
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from paho.mqtt.enums import CallbackAPIVersion
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from controller.db import crud, tables
from controller.db.engine import make_engine, migrate
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
from controller.fleet.twin import PUBLISH_TIMEOUT_S, TwinService
from controller.link.bridge import MqttBridge, PahoTransport
from controller.link.budget import device_budgets
from controller.registry.bundled import register_bundled_models
from controller.security.keys import load_or_create_signer
from controller.settings import ControllerSettings
from fleet_protocol import TopicKind, Topics, decode
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import MAX_CAMERAS, Capabilities, DesiredState
from fleet_protocol.signing import SignatureError, verify_desired
from tests.support.mqtt_broker import MosquittoBroker

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


# --------------------------------------------------------------------------- the publish after a plan


class TimedTransport(PahoTransport):
    """The controller's own MQTT transport, keeping what it published and the time spent in each
    confirmed publish (the send and the wait for its PUBACK), so a run says where its time went and the
    raw limit can send exactly the same bytes."""

    def __init__(self, target: MqttEndpoint, *, client_id: str) -> None:
        super().__init__(target, client_id=client_id)
        self.sent: dict[str, bytes] = {}
        self.confirm_s = 0.0
        self.unconfirmed = 0

    def publish_confirmed(self, topic: str, payload: bytes, qos: int, retain: bool, timeout_s: float) -> bool:
        t = time.perf_counter()
        ok = super().publish_confirmed(topic, payload, qos, retain, timeout_s)
        self.confirm_s += time.perf_counter() - t
        self.sent[topic] = payload
        self.unconfirmed += not ok
        return ok


@dataclass(frozen=True)
class Fleet:
    """The publish section's devices: sites of about ``DEVICES_PER_SITE`` (N shared out evenly), each
    site a pool whose cameras are spread over its devices, ``per_device`` to a device."""

    sites: tuple[tuple[str, ...], ...]
    per_device: int

    @staticmethod
    def of(n: int, per_device: int) -> Fleet:
        n_sites = max(1, round(n / DEVICES_PER_SITE))
        sizes = [n // n_sites + (i < n % n_sites) for i in range(n_sites)]
        return Fleet(
            tuple(tuple(f"site{k:03d}-box{i:02d}" for i in range(size)) for k, size in enumerate(sizes)),
            per_device,
        )

    @property
    def devices(self) -> list[str]:
        return [d for site in self.sites for d in site]

    @staticmethod
    def pool(k: int) -> str:
        return f"site{k:03d}"

    def cameras(self, k: int) -> list[str]:
        return [f"site{k:03d}-cam{j:03d}" for j in range(len(self.sites[k]) * self.per_device)]

    def source(self, k: int, j: int) -> str:
        return f"rtsp://{{secret:{self.pool(k)}-cams}}@10.{k // 256}.{k % 256}.{j + 1}/stream1"

    def sources(self) -> dict[str, str]:
        """Camera -> its source, every pool's."""
        return {
            cam: self.source(k, j) for k in range(len(self.sites)) for j, cam in enumerate(self.cameras(k))
        }

    def placement(self, step: int) -> dict[tuple[str, str], str]:
        """(pool, camera) -> device after ``step`` moves: every camera of a site one device further on
        each step, so every device's cameras change at every step."""
        out: dict[tuple[str, str], str] = {}
        for k, site in enumerate(self.sites):
            for j, cam in enumerate(self.cameras(k)):
                out[(self.pool(k), cam)] = site[(j + step) % len(site)]
        return out


PUBLISH_MODELS = (("ped_ssdlite", "1"), ("nanodet_coco", "1"))
PUBLISH_FPS = 4.0


def _populate(engine: Engine, fleet: Fleet) -> None:
    """Enrolled devices reporting a CPU-only agent, and each site's pool with its cameras placed as at
    step 0 (rows written as ``PoolService`` stores a plan; the planner itself is timed above)."""
    caps = Capabilities(
        cpu_count=2, execution_providers=["CPUExecutionProvider"], cpu_flags=["avx2", "avx512_vnni"]
    )
    placed = fleet.placement(0)
    since = datetime.now(UTC)
    with Session(engine) as s:
        for k, site in enumerate(fleet.sites):
            for dev_id in site:
                dev = crud.enroll_device(
                    s, device_in=tables.DeviceCreate(id=dev_id, labels={"site": fleet.pool(k)})
                )
                dev.capabilities = caps.model_copy(update={"hostname": dev_id}).model_dump(mode="json")
                s.add(dev)
            name = fleet.pool(k)
            s.add(tables.Pool(name=name, selector=f"site={name}"))
            s.flush()
            for j, cam in enumerate(fleet.cameras(k)):
                model, version = PUBLISH_MODELS[j % len(PUBLISH_MODELS)]
                s.add(
                    tables.PoolCamera(
                        pool=name,
                        camera=cam,
                        source=fleet.source(k, j),
                        model=model,
                        version=version,
                        target_fps=PUBLISH_FPS,
                        min_fps=PUBLISH_FPS / 2,
                    )
                )
                s.add(
                    tables.PoolPlacement(
                        pool=name, camera=cam, device_id=placed[(name, cam)], fps=PUBLISH_FPS, since=since
                    )
                )
        s.commit()


def _move(engine: Engine, fleet: Fleet, step: int) -> None:
    """Store the plan of ``step``: every camera on the next device of its site."""
    placed = fleet.placement(step)
    since = datetime.now(UTC)
    with Session(engine) as s:
        for row in s.exec(select(tables.PoolPlacement)):
            row.device_id, row.since = placed[(row.pool, row.camera)], since
            s.add(row)
        s.commit()


def _bare_client(broker: MosquittoBroker, name: str) -> mqtt.Client:
    """A paho client as the controller's is set up for publishing: clean session, no in-flight window."""
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name, clean_session=True)
    c.max_inflight_messages_set(0)
    c.max_queued_messages_set(0)
    c.connect(broker.host, broker.port)
    c.loop_start()
    return c


def raw_publish(client: mqtt.Client, payloads: list[tuple[str, bytes]], *, pipelined: bool) -> float:
    """The raw limit: the same signed payloads, retained at QoS 1, every PUBACK waited for; one at a
    time as the controller sends them, or all sent before the first wait."""
    t = time.perf_counter()
    if pipelined:
        infos = [client.publish(topic, payload, qos=1, retain=True) for topic, payload in payloads]
    else:
        infos = []
        for topic, payload in payloads:
            info = client.publish(topic, payload, qos=1, retain=True)
            info.wait_for_publish(PUBLISH_TIMEOUT_S)
            infos.append(info)
    for info in infos:
        info.wait_for_publish(PUBLISH_TIMEOUT_S)
    elapsed = time.perf_counter() - t
    if not all(info.is_published() for info in infos):
        raise RuntimeError("a raw publish was not acknowledged by the broker")
    return elapsed


def retained(
    broker: MosquittoBroker, topic_filter: str, expect: int, timeout_s: float = 15.0
) -> dict[str, bytes]:
    """What the broker retains under ``topic_filter``, as a new subscriber receives it: every retained
    message arrives at once after the SUBACK, so ``expect`` of them, or a second with nothing new, ends it."""
    got: dict[str, bytes] = {}
    lock = threading.Lock()
    last = [time.monotonic()]

    def on_message(_c: mqtt.Client, _u: object, m: mqtt.MQTTMessage) -> None:
        if m.retain:
            with lock:
                got[m.topic] = bytes(m.payload)
                last[0] = time.monotonic()

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-placement-check-{os.getpid()}")
    c.on_message = on_message
    c.connect(broker.host, broker.port)
    c.loop_start()
    try:
        c.subscribe(topic_filter, qos=1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with lock:
                if len(got) >= expect or time.monotonic() - last[0] > 1.0:
                    break
            time.sleep(0.05)
        with lock:
            return dict(got)
    finally:
        c.loop_stop()
        c.disconnect()


def publish_bench(n: int, runs: int, per_device: int) -> bool:
    """The publish after a plan: each run moves every camera, then times ``recompute_many`` over every
    device (derive, sign, commit, publish retained at QoS 1 and wait for the PUBACK, one device after
    the other), beside the raw limit on the same broker. True when every figure checked out."""
    fleet = Fleet.of(n, per_device)
    devices = fleet.devices
    with tempfile.TemporaryDirectory(prefix="edgefleet-placement-") as tmp:
        work = Path(tmp)
        broker = MosquittoBroker(work / "mosquitto")
        broker.start()
        settings = ControllerSettings(
            data_dir=work / "controller",
            mqtt_url=SecretStr(broker.url),
            database_url=SecretStr(f"sqlite:///{work / 'controller' / 'edgefleet.db'}"),
            mqtt_client_id="bench-placement-controller",
        )
        url = settings.resolved_database_url()
        engine = make_engine(url)
        transport = TimedTransport(settings.mqtt_target(), client_id=settings.controller_client_id())
        topics = Topics(settings.topic_prefix)
        bridge = MqttBridge(transport, topics, budgets=device_budgets(settings))
        bare = _bare_client(broker, f"bench-placement-raw-{os.getpid()}")
        try:
            # Wired as controller/runtime.py wires them; the runtime's workers stay off, so nothing
            # else takes the twin's lock or the database meanwhile.
            migrate(url, engine=engine)
            register_bundled_models(engine, settings.models_dir)
            signer = load_or_create_signer(settings.data_dir)
            twin = TwinService(engine, bridge, chunk_size=settings.chunk_size, signer=signer)
            bridge.start()
            if not transport.wait_connected(10.0):
                raise RuntimeError(f"the controller's transport did not connect to {broker.url}")
            _populate(engine, fleet)
            first = twin.recompute_many(devices)  # the fleet's first states, and a warm-up
            sizes = [len(p) for p in transport.sent.values()]
            print(
                f"publish     : {len(devices)} devices in {len(fleet.sites)} pools, {per_device} pool "
                f"cameras each ({len(devices) * per_device} in all); {first} first states published, "
                f"{statistics.median(sizes) / 1024:.1f} KiB each (median); SQLite in a temp dir, mosquitto "
                f"on port {broker.port}"
            )
            raw_topics = Topics("bench-raw/v1")  # no controller or check subscription matches it

            ctl_s: list[float] = []
            confirm_s: list[float] = []
            seq_s: list[float] = []
            pipe_s: list[float] = []
            ok = first == len(devices)
            for step in range(1, runs + 1):
                _move(engine, fleet, step)
                transport.sent.clear()
                transport.confirm_s = 0.0
                t = time.perf_counter()
                changed = twin.recompute_many(devices)
                ctl_s.append(time.perf_counter() - t)
                confirm_s.append(transport.confirm_s)
                ok = ok and changed == len(devices) and len(transport.sent) == len(devices)
                payloads = [
                    (
                        raw_topics.device(d, TopicKind.TWIN_DESIRED),
                        transport.sent[topics.device(d, TopicKind.TWIN_DESIRED)],
                    )
                    for d in devices
                    if topics.device(d, TopicKind.TWIN_DESIRED) in transport.sent
                ]
                seq_s.append(raw_publish(bare, payloads, pipelined=False))
                pipe_s.append(raw_publish(bare, payloads, pipelined=True))
            ok = ok and transport.unconfirmed == 0

            def ms(xs: list[float]) -> str:
                return (
                    f"{statistics.median(xs) * 1000:.0f} ms (range {min(xs) * 1000:.0f}-{max(xs) * 1000:.0f})"
                )

            def per(xs: list[float]) -> float:
                return statistics.median(xs) * 1000 / len(devices)

            print(
                f"publish time: {ms(ctl_s)} for {len(devices)} changed states over {runs} runs, "
                f"{per(ctl_s):.2f} ms per device (in the confirmed publish {per(confirm_s):.2f} ms; "
                f"deriving, signing, committing {per(ctl_s) - per(confirm_s):.2f} ms); "
                f"{transport.unconfirmed} not confirmed (load {os.getloadavg()[0]:.1f})"
            )
            print(
                f"raw publish : sequential {ms(seq_s)}, {per(seq_s):.2f} ms per state; pipelined "
                f"{ms(pipe_s)}, {per(pipe_s):.2f} ms per state"
            )
            seq_r = [c / r for c, r in zip(ctl_s, seq_s, strict=True)]
            pipe_r = [c / r for c, r in zip(ctl_s, pipe_s, strict=True)]
            print(
                f"ratio publish / raw: sequential median {statistics.median(seq_r):.1f} (range "
                f"{min(seq_r):.1f}-{max(seq_r):.1f}), pipelined median {statistics.median(pipe_r):.1f} "
                f"(range {min(pipe_r):.1f}-{max(pipe_r):.1f}) over {runs} runs"
            )
            ok = _check_retained(broker, engine, fleet, topics, signer.private_key.public_key(), runs) and ok
        finally:
            bare.loop_stop()
            bare.disconnect()
            bridge.stop()
            engine.dispose()
            broker.stop()
    return ok


def _check_retained(
    broker: MosquittoBroker, engine: Engine, fleet: Fleet, topics: Topics, key: Ed25519PublicKey, step: int
) -> bool:
    """A new subscriber on every device's desired state: the broker holds one per device, signed by the
    controller's key, at the version committed, naming the cameras the last plan gives the device."""
    devices = fleet.devices
    got = retained(broker, topics.all_devices(TopicKind.TWIN_DESIRED), len(devices))
    with Session(engine) as s:
        committed = {d.id: d.desired_version for d in s.exec(select(tables.Device))}
    sources = fleet.sources()
    expected: dict[str, dict[str, str]] = {d: {} for d in devices}
    for (_, cam), dev in fleet.placement(step).items():
        expected[dev][cam] = sources[cam]
    signed = current = right = 0
    for d in devices:
        payload = got.get(topics.device(d, TopicKind.TWIN_DESIRED))
        if payload is None:
            continue
        state = decode(TopicKind.TWIN_DESIRED, payload)
        assert isinstance(state, DesiredState)
        try:
            verify_desired(state, key)
            signed += state.device_id == d
        except SignatureError:
            pass
        current += state.version == committed.get(d)
        right += {cam: c.source for cam, c in state.cameras.items()} == expected[d]
    n = len(devices)
    print(
        f"retained    : {len(got)} desired states held by the broker for {n} devices; {signed} signed for "
        f"their device, {current} at the version committed, {right} naming the cameras the last plan gives "
        "them (with their sources)"
    )
    return len(got) == signed == current == right == n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sites", type=int, default=100)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--minutes", type=int, default=60, help="simulated minutes of the noise run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--fps-scale", type=float, default=1.0, help="every camera's FPS times this (a fuller site)"
    )
    ap.add_argument(
        "--publish",
        type=int,
        default=1000,
        metavar="N",
        help="devices whose desired states are published after a plan over a real mosquitto (0: skip)",
    )
    ap.add_argument("--publish-runs", type=int, default=3, help="timed publishes of all N changed states")
    ap.add_argument(
        "--cameras-per-device", type=int, default=CAMERAS_PER_SITE // DEVICES_PER_SITE, help="in the publish"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="5 sites, 2 runs, 5 simulated minutes; 20 devices published twice",
    )
    args = ap.parse_args()
    if args.smoke:
        args.sites, args.runs, args.minutes = 5, 2, 5
        args.publish, args.publish_runs = min(args.publish, 20), 2
    if args.publish == 1 or args.publish < 0:
        ap.error("--publish needs 0 (skip it) or at least 2 devices: a camera moves between two")
    if args.publish_runs < 1 or not 1 <= args.cameras_per_device <= MAX_CAMERAS:
        ap.error(f"--publish-runs needs >= 1, --cameras-per-device 1-{MAX_CAMERAS} (a desired state's bound)")
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

    if args.publish and not publish_bench(args.publish, args.publish_runs, args.cameras_per_device):
        raise SystemExit("publish: a state was not published, not confirmed or not retained as committed")


if __name__ == "__main__":
    main()
