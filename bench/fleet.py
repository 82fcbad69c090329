"""Fleet benchmark: 1, 2, 3 controller replicas against a growing simulated fleet, beside a bare subscriber.

Every part is real and on this machine: a mosquitto the bench starts, the machine's PostgreSQL (a fresh
schema per replica count), N ``edgefleet controller`` replicas sharing the MQTT load through ``$share``
(as docker/compose.scale.yaml runs them), and ``edgefleet simulate`` (devices on the real contract: a
heartbeat every ``--heartbeat-s`` and one detection batch every ``--batch-s``, each resent until acked).

For each replica count and each fleet size (``--devices``, increasing) one run of ``--seconds``:
  - stored batches/s: detection batches the simulator saw acked in the window (an ack follows the
    commit), per second;
  - p99 publish -> ack (the simulator's own figure) and the ingest queue depth at the start and the
    end of the window (read from every replica's ``/api/v1/stats/ingest``);
  - controller CPU-seconds (all replicas, from /proc) per batch and per heartbeat: a heartbeat-only run
    of the same fleet gives CPU per heartbeat; the rest of a full run's CPU is divided by its batches;
  - PostgreSQL's CPU-seconds per batch (every ``postgres`` process), since on 2 cores it shares them.
The raw limit, in the same run: the same fleet against a bare paho subscriber (``$share`` in the same
group shape, no controller) that only counts what it receives: the rate the broker delivers and the
CPU a subscriber that does nothing costs per message. Each controller run prints stored batches/s
against that raw rate (the simulator's send rate is the same in both).

"Largest fleet" per replica count = the largest ``--devices`` whose run had p99 < 1 s, every batch
acked and a queue that did not grow. On this 2-core machine the simulator, the broker, PostgreSQL and
the replicas share the cores, so what transfers to a bigger machine is CPU-seconds per message per
role; the bench prints the machine's load with every row.

Usage (from the repository root): ``python -m bench.fleet [--replicas 1,2,3] [--devices 250,500,1000,2000] [--seconds 30]
[--heartbeat-s 5] [--batch-s 1] [--database-url URL] [--pin] [--smoke] [--json]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol import TopicKind, Topics
from tests.support.databases import postgres_schema
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import SimulatorProcess
from tests.support.replicas import SHARE_GROUP, ReplicaSet

REPO = Path(__file__).resolve().parents[1]

P99_LIMIT_MS = 1000.0
# "A growing queue": the ingest queues' trend over the steady window adds up to more than this many
# messages. A trend, not one sample: a commit takes up to 500 messages at once, so a single reading
# anywhere between 0 and a commit's worth says nothing about whether the replicas keep up.
QUEUE_GROWTH_LIMIT = 100.0


def _trend(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of (time, depth) samples times their span: how much the queue grew."""
    if len(samples) < 3:
        return float(samples[-1][1] - samples[0][1]) if len(samples) == 2 else 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mq = sum(q for _, q in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var <= 0:
        return 0.0
    slope = sum((t - mt) * (q - mq) for t, q in samples) / var
    return slope * (samples[-1][0] - samples[0][0])


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (sched_setaffinity acts on one thread; threads started
    later inherit it from the one that starts them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def _cpu_s(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def _postgres_cpu_s() -> float:
    total = 0.0
    for p in psutil.process_iter(["name"]):
        if (p.info.get("name") or "").startswith("postgres"):
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
    return total


class BareSubscriber:
    """The raw limit: a paho client in this process on the devices' topics that counts and does nothing
    else (QoS 1, so the broker's delivery work is the controller's)."""

    def __init__(self, broker: MosquittoBroker, prefix: str) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-bare-{os.getpid()}")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._ready.set()
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        topics = Topics()
        self.client.subscribe(
            [
                (f"$share/{SHARE_GROUP}/{topics.all_devices(TopicKind.DETECTIONS)}", 1),
                (f"$share/{SHARE_GROUP}/{topics.all_devices(TopicKind.HEARTBEAT)}", 1),
                (f"$share/{SHARE_GROUP}/{topics.all_devices(TopicKind.EVENTS)}", 1),
            ]
        )
        if not self._ready.wait(10):
            raise RuntimeError("the bare subscriber's SUBACK never came")
        self.prefix = prefix

    def _on_message(self, c: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        # Detection batches and events: the messages that carry a seq, as the simulator counts them.
        if m.topic.endswith(("/detections", "/events")):
            with self._lock:
                self.count += 1

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@dataclass
class Row:
    replicas: int
    devices: int
    kind: str  # "controller" | "raw" | "heartbeats"
    seconds: float
    batches_per_s: float
    acked: int
    sent: int
    resends: int
    p99_ms: float | None
    queue_start: int
    queue_end: int
    queue_max: int  # the largest of the samples taken every second of the steady window
    queue_growth: float  # the samples' trend over the steady window (least squares), in messages
    controller_cpu_s: float  # less the replicas' idle CPU over the same time (timers, leader checks)
    steady_s: float  # the middle of the window: every device connected, none stopping
    steady_cpu_s: float  # the replicas' CPU in it, less idle
    postgres_cpu_s: float
    simulator_cpu_per_s: float
    broker_cpu_per_s: float  # mosquitto's CPU-seconds a second over the run
    postgres_cpu_per_s: float
    load1: float
    ok: bool

    @property
    def healthy(self) -> bool:
        return (
            self.ok
            and self.p99_ms is not None
            and self.p99_ms < P99_LIMIT_MS
            and self.queue_growth <= QUEUE_GROWTH_LIMIT
        )

    @property
    def replica_cpu_per_s(self) -> float:
        """The replicas' CPU-seconds a second in the steady window (idle subtracted)."""
        return self.steady_cpu_s / max(self.steady_s, 1e-9)


def _queue(rs: ReplicaSet | None) -> int:
    if rs is None:
        return 0
    depth = 0
    for r in rs.live():
        try:
            with r.client() as api:
                depth += int(api.get("/api/v1/stats/ingest").json()["queue_depth"])
        except (httpx.HTTPError, KeyError, ValueError):
            pass
    return depth


def _simulate(
    workdir: Path,
    broker: MosquittoBroker,
    devices: int,
    prefix: str,
    args: argparse.Namespace,
    *,
    batch_s: float,
    ack_timeout_s: float,
    drain_s: float,
) -> SimulatorProcess:
    return SimulatorProcess(
        workdir,
        broker.url,
        devices,
        "--device-prefix",
        prefix,
        "--seconds",
        str(args.seconds),
        "--heartbeat-s",
        str(args.heartbeat_s),
        "--batch-s",
        str(batch_s),
        "--ack-timeout-s",
        str(ack_timeout_s),
        "--drain-s",
        str(drain_s),
        "--connect-rate",
        "500",
    ).start()


def _run(
    kind: str,
    workdir: Path,
    broker: MosquittoBroker,
    rs: ReplicaSet | None,
    devices: int,
    args: argparse.Namespace,
    tag: str,
    idle_cpu_per_s: float = 0.0,
    pin: set[int] | None = None,
) -> Row:
    """``pin``: the CPUs the simulator runs on (``--pin``)."""
    prefix = f"f{tag}-"
    pids = [r.proc.pid for r in rs.live() if r.proc is not None] if rs is not None else []
    bare = BareSubscriber(broker, prefix) if kind == "raw" else None
    batch_s = 1e6 if kind == "heartbeats" else args.batch_s
    # The raw run has nobody to ack: its devices must not resend within the window, nor wait to drain.
    ack_timeout = 1e6 if kind == "raw" else 10.0
    drain = 0.0 if kind == "raw" else 60.0
    cpu0 = sum(_cpu_s(p) for p in pids)
    pg0 = _postgres_cpu_s()
    broker_pid = broker.proc.pid if broker.proc is not None else 0
    broker0 = _cpu_s(broker_pid)
    q0 = _queue(rs)
    t0 = time.monotonic()
    sim = _simulate(
        workdir / f"sim-{tag}",
        broker,
        devices,
        prefix,
        args,
        batch_s=batch_s,
        ack_timeout_s=ack_timeout,
        drain_s=drain,
    )
    assert sim.proc is not None
    sim_pid = sim.proc.pid
    sim_cpu = 0.0
    # Steady state: from 30 % to 90 % of the window (connections, births and reported states are
    # over; nobody is stopping yet). The queue at its end, before the drain empties it.
    if pin is not None:
        _pin(sim_pid, pin)
    time.sleep(args.seconds * 0.3)
    if pin is not None:
        _pin(sim_pid, pin)  # threads the simulator started meanwhile
    cpu_a, ta = sum(_cpu_s(p) for p in pids), time.monotonic()
    samples: list[tuple[float, int]] = []
    end = ta + args.seconds * 0.6
    while (now := time.monotonic()) < end:
        samples.append((now, _queue(rs)))
        time.sleep(max(0.0, min(1.0, end - time.monotonic())))
    cpu_b, tb = sum(_cpu_s(p) for p in pids), time.monotonic()
    q1 = _queue(rs)
    samples.append((time.monotonic(), q1))
    sim_cpu = _cpu_s(sim_pid)
    code = sim.wait(timeout=args.seconds + 180)
    wall = time.monotonic() - t0
    cpu = max(0.0, sum(_cpu_s(p) for p in pids) - cpu0 - idle_cpu_per_s * wall)
    pg = _postgres_cpu_s() - pg0
    broker_cpu = _cpu_s(broker_pid) - broker0
    report = sim.report()
    total = report["total"]
    if bare is not None:
        received = bare.count
        bare.close()
        acked = received
        rate = received / args.seconds
    else:
        acked = int(total["acked"])
        rate = acked / args.seconds
    return Row(
        replicas=len(pids),
        devices=devices,
        kind=kind,
        seconds=round(wall, 1),
        batches_per_s=round(rate, 1),
        acked=acked,
        sent=int(total["sent"]),
        resends=int(total["resends"]),
        p99_ms=total["p99_ms"],
        queue_start=q0,
        queue_end=q1,
        queue_max=max(q for _, q in samples),
        queue_growth=round(_trend(samples), 1),
        controller_cpu_s=round(cpu, 2),
        steady_s=round(tb - ta, 2),
        steady_cpu_s=round(max(0.0, cpu_b - cpu_a - idle_cpu_per_s * (tb - ta)), 3),
        postgres_cpu_s=round(pg, 2),
        simulator_cpu_per_s=round(sim_cpu / max(args.seconds, 1e-9), 2),
        broker_cpu_per_s=round(broker_cpu / max(wall, 1e-9), 2),
        postgres_cpu_per_s=round(pg / max(wall, 1e-9), 2),
        load1=round(os.getloadavg()[0], 2),
        ok=(code == 0) if kind != "raw" else True,
    )


def _broker(work: Path, name: str, pin: set[int] | None = None) -> MosquittoBroker:
    broker = MosquittoBroker(work / f"mosquitto-{name}", extra_conf="max_queued_messages 100000\n")
    broker.start()
    if pin is not None and broker.proc is not None:
        _pin(broker.proc.pid, pin)
    return broker


def _settle(rs: ReplicaSet, idle: float, timeout: float = 90.0) -> None:
    """Wait until the replicas are back to idle (the previous run's devices went offline, their queues
    drained), so one run's tail is not counted in the next."""
    pids = [r.proc.pid for r in rs.live() if r.proc is not None]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cpu0, t0 = sum(_cpu_s(p) for p in pids), time.monotonic()
        time.sleep(2.0)
        rate = (sum(_cpu_s(p) for p in pids) - cpu0) / (time.monotonic() - t0)
        if rate <= idle + 0.05 and _queue(rs) == 0:
            return


def _idle_cpu_per_s(rs: ReplicaSet, seconds: float = 10.0) -> float:
    """The replicas' CPU with no device talking: their timers, leader checks and replica heartbeats."""
    pids = [r.proc.pid for r in rs.live() if r.proc is not None]
    cpu0, t0 = sum(_cpu_s(p) for p in pids), time.monotonic()
    time.sleep(seconds)
    return (sum(_cpu_s(p) for p in pids) - cpu0) / (time.monotonic() - t0)


@contextmanager
def _replicas(
    workdir: Path, broker: MosquittoBroker, n: int, database_url: str | None
) -> Iterator[ReplicaSet]:
    @contextmanager
    def schema() -> Iterator[str]:
        if database_url:
            yield database_url
        else:
            with postgres_schema() as url:
                yield url

    with schema() as url:
        rs = ReplicaSet(workdir / f"replicas-{n}", broker.url, url, n=n, EDGEFLEET_HEARTBEAT_TIMEOUT_S="60")
        try:
            rs.start()
            yield rs
        finally:
            rs.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="1,2,3", help="replica counts, comma-separated (default 1,2,3)")
    ap.add_argument("--devices", default="250,500,1000,2000", help="fleet sizes, increasing")
    ap.add_argument("--seconds", type=float, default=30.0, help="producing window of each run")
    ap.add_argument("--heartbeat-s", type=float, default=5.0)
    ap.add_argument("--batch-s", type=float, default=1.0)
    ap.add_argument("--database-url", help="PostgreSQL to use (default: a fresh schema on the machine's)")
    ap.add_argument(
        "--smoke", action="store_true", help="a quick check that it runs: 1 replica, 20 devices, 8 s"
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="the replicas on CPUs 1.. (round-robin), the simulator and the broker on CPU 0 (PostgreSQL "
        "free): each replica then has at most one core, so a fleet it keeps is a fleet per replica-core",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.replicas, a.devices, a.seconds = "1", "20", 8.0
    cpus = sorted(os.sched_getaffinity(0))
    if a.pin and len(cpus) < 2:
        ap.error("--pin needs two CPUs or more")
    side = {cpus[0]} if a.pin else None  # the simulator's and the broker's CPU
    replica_cpus = cpus[1:]
    replica_counts = [int(x) for x in a.replicas.split(",") if x]
    sizes = sorted(int(x) for x in a.devices.split(",") if x)
    if not replica_counts or not sizes or min(replica_counts + sizes) < 1 or a.seconds <= 0:
        ap.error("--replicas and --devices need positive integers, --seconds a positive time")

    def say(text: str) -> None:
        if not a.json:
            print(text, flush=True)

    say(
        f"fleet bench: replicas {replica_counts}, devices {sizes}, {a.seconds:g} s per run, heartbeat every "
        f"{a.heartbeat_s:g} s, a batch every {a.batch_s:g} s; {psutil.cpu_count()} CPUs"
    )
    rows: list[Row] = []
    derived: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="edgefleet-fleet-") as tmp:
        work = Path(tmp)
        # A broker of its own for each phase: the retained births of one phase's devices must not reach
        # the next phase's replicas (a new leader subscribes to them all and would be busy with them).
        broker = _broker(work, "raw", side)
        try:
            for n in sizes:
                row = _run("raw", work, broker, None, n, a, f"raw{n}", pin=side)
                rows.append(row)
                say(
                    f"  raw      {n:5d} devices: {row.batches_per_s:8.1f} batches/s delivered to a bare subscriber"
                )
            broker.stop()
            for rc in replica_counts:
                broker = _broker(work, f"r{rc}", side)
                with _replicas(work, broker, rc, a.database_url) as rs:
                    if a.pin:
                        for i, r in enumerate(rs.live()):
                            assert r.proc is not None
                            cpu = replica_cpus[i % len(replica_cpus)]
                            _pin(r.proc.pid, {cpu})
                            say(f"  replica {i} pinned to CPU {cpu}; simulator and broker on CPU {cpus[0]}")
                    idle = _idle_cpu_per_s(rs)
                    say(f"  {rc} replica(s) idle: {idle:.3f} CPU-s/s (subtracted below)")
                    for n in sizes:
                        _settle(rs, idle)
                        hb = _run("heartbeats", work, broker, rs, n, a, f"h{rc}x{n}", idle, side)
                        rows.append(hb)
                        _settle(rs, idle)
                        full = _run("controller", work, broker, rs, n, a, f"c{rc}x{n}", idle, side)
                        rows.append(full)
                        raw = next(r for r in rows if r.kind == "raw" and r.devices == n)
                        # CPU per message from the steady part of each run, at the rates the devices send.
                        hb_n = n * hb.steady_s / a.heartbeat_s
                        per_hb = hb.steady_cpu_s / max(hb_n, 1)
                        batches = n * full.steady_s / a.batch_s
                        per_batch = max(
                            0.0, full.steady_cpu_s - per_hb * n * full.steady_s / a.heartbeat_s
                        ) / max(batches, 1)
                        derived.append(
                            {
                                "replicas": rc,
                                "devices": n,
                                "ratio_to_raw": round(full.batches_per_s / max(raw.batches_per_s, 1e-9), 3),
                                "controller_ms_per_batch": round(per_batch * 1e3, 3),
                                "controller_ms_per_heartbeat": round(per_hb * 1e3, 3),
                                "postgres_ms_per_batch": round(
                                    full.postgres_cpu_s / max(full.acked, 1) * 1e3, 3
                                ),
                                "healthy": full.healthy,
                                "replica_cpu_per_s": round(full.replica_cpu_per_s, 3),
                                "devices_per_replica_core": round(n / max(full.replica_cpu_per_s, 1e-9)),
                            }
                        )
                        say(
                            f"  {rc} replica(s) {n:5d} devices: {full.batches_per_s:8.1f} batches/s "
                            f"({full.batches_per_s / max(raw.batches_per_s, 1e-9):.3f} of raw), p99 "
                            f"{full.p99_ms if full.p99_ms is not None else float('nan'):.0f} ms, queue "
                            f"{full.queue_start}->{full.queue_end} (max {full.queue_max}, trend "
                            f"{full.queue_growth:+.0f}), resends {full.resends}, controller CPU {per_batch * 1e3:.2f} ms/batch "
                            f"{per_hb * 1e3:.2f} ms/heartbeat, PostgreSQL {full.postgres_cpu_s / max(full.acked, 1) * 1e3:.2f} "
                            f"ms/batch, {'OK' if full.healthy else 'NOT healthy'} (load {full.load1})"
                        )
                        # On a small machine the other parts take cores too: what was left to the replicas.
                        say(
                            f"      CPU-s/s beside the replicas: simulator {full.simulator_cpu_per_s:.2f}, "
                            f"broker {full.broker_cpu_per_s:.2f}, PostgreSQL {full.postgres_cpu_per_s:.2f}; "
                            f"replicas {full.replica_cpu_per_s:.2f} in the steady window, i.e. "
                            f"{n / max(full.replica_cpu_per_s, 1e-9):,.0f} devices per replica-core"
                        )
                broker.stop()
        finally:
            broker.stop()
    summary: dict[str, Any] = {}
    for rc in replica_counts:
        good = [r for r in rows if r.kind == "controller" and r.replicas == rc and r.healthy]
        best = max(good, key=lambda r: r.devices, default=None)
        summary[str(rc)] = {
            "largest_fleet_p99_under_1s": best.devices if best else None,
            # That fleet over the replica CPU it took: what one core of replica keeps at p99 < 1 s.
            "devices_per_replica_core": round(best.devices / max(best.replica_cpu_per_s, 1e-9))
            if best
            else None,
            "pinned": bool(a.pin),
        }
    say("largest fleet with p99 < 1 s, every batch acked, no growing queue:")
    for key, s in summary.items():
        per_core = s["devices_per_replica_core"]
        say(
            f"  {key} replica(s): {s['largest_fleet_p99_under_1s']}"
            + (f" ({per_core:,} devices per replica-core)" if per_core else "")
        )
    rates = {
        rc: max((r.batches_per_s for r in rows if r.kind == "controller" and r.replicas == rc), default=0.0)
        for rc in replica_counts
    }
    if 1 in rates and rates[1] > 0:
        for rc in replica_counts:
            if rc > 1:
                say(f"  stored batches/s, {rc} replicas / 1 replica: {rates[rc] / rates[1]:.2f}")
    if a.json:
        print(
            json.dumps(
                {"rows": [asdict(r) for r in rows], "derived": derived, "summary": summary, "rates": rates}
            )
        )
    bad = [r for r in rows if r.kind == "controller" and not r.ok]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
