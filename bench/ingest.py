"""Ingest benchmark: N simulated devices publish detection batches at QoS 1 to a real mosquitto.

Two kinds of run, alternating (raw, controller, raw, controller, ..., raw; ``--runs`` controller runs):
  (a) raw: the bench's publishers send the same batches to a topic only a bare paho subscriber
      listens on (``bench-raw/<device>/detections``), so nothing else works on them: the rate the
      broker delivers to a subscriber that does nothing per message (the raw limit), measured alone,
      with the controller idle. The first run of the bench is a raw one.
  (b) controller: the same burst on ``devices/<device>/detections`` (fresh device ids each run) to a
      real controller process (SQLite by default): the rate of batches decoded, validated and stored,
      taken from its end-to-end acks (an ack is published only after the commit, so an acked seq is
      queryable through the API). No other subscriber on those topics.
Each controller run's ratio is against the faster of the two raw runs either side of it (the stricter
limit); the median and range over the runs are printed (target >= 0.8), with the p50/p99 lag from
publish to stored (ack), the CPU time the controller used per batch and the machine's load: on a shared
machine the rates move with the load, the CPU per batch much less.

After every controller run the stored seqs are counted through the API; the bench exits non-zero if
any batch was not stored (or not acked in time).

Usage (from the repository root): ``python -m bench.ingest [--devices 20] [--batches 200] [--frames 5] [--detections 4] [--runs 3]
[--smoke] [--json] [--database-url URL] [--profile FILE [--gil]]`` (``--profile`` records the controller
with py-spy during the controller runs; py-spy is not a dependency: ``pip install py-spy``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol import TopicKind, Topics, decode, encode
from fleet_protocol.messages import Ack, Box, Detection, DetectionBatch, FrameDetections
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ControllerProcess
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]

TOPICS = Topics()
RAW_TOPIC = "bench-raw/{device}/detections"  # no controller subscription matches it
TARGET = 0.8


def _batch(seq: int, frames: int, dets: int) -> bytes:
    now = time.time()
    return encode(
        DetectionBatch(
            seq=seq,
            sent_at=now,
            frames=[
                FrameDetections(
                    camera="cam1",
                    frame=seq * frames + f,
                    captured_at=now,
                    width=768,
                    height=576,
                    model="ped_ssdlite:1",
                    inference_ms=10.0,
                    detections=[
                        Detection(
                            label="person" if i % 2 == 0 else "car",
                            class_id=i,
                            score=0.8,
                            box=Box(x0=10.0 * i, y0=20.0, x1=10.0 * i + 40, y1=120.0),
                        )
                        for i in range(dets)
                    ],
                )
                for f in range(frames)
            ],
        )
    )


def _client(broker: MosquittoBroker, name: str) -> mqtt.Client:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name)
    c.max_inflight_messages_set(100)
    c.connect(broker.host, broker.port)
    c.loop_start()
    return c


def _close(clients: list[mqtt.Client]) -> None:
    for c in clients:
        c.loop_stop()
        c.disconnect()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far: a figure the machine's load barely moves."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _profile(pid: int, out: Path, gil: bool) -> subprocess.Popen[bytes]:
    # py-spy samples the controller from outside; --gil keeps only the thread holding the GIL, which is
    # what bounds a GIL-bound process.
    cmd = [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--rate", "200"]
    cmd += ["--format", "raw", "--threads", "--output", str(out)]
    if gil:
        cmd.append("--gil")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@dataclass
class Burst:
    """The bench's publishers: ``devices`` clients, each sending ``batches`` QoS 1 batches in a thread."""

    broker: MosquittoBroker
    devices: int
    batches: int
    payloads: dict[int, bytes]
    published: dict[tuple[str, int], float] = field(default_factory=dict)

    def send(self, names: list[str], topics: list[str], lock: threading.Lock) -> float:
        """Publish every batch of every device; returns the start time (monotonic)."""
        pubs = [_client(self.broker, f"pub-{name}") for name in names]

        def publish(i: int) -> None:
            infos = []
            for seq in range(1, self.batches + 1):
                with lock:
                    self.published[(names[i], seq)] = time.monotonic()
                infos.append(pubs[i].publish(topics[i], self.payloads[seq], qos=1))
            for info in infos:
                info.wait_for_publish(120)

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(names))]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._pubs = pubs
        return t0

    def close(self) -> None:
        _close(getattr(self, "_pubs", []))


def raw_run(broker: MosquittoBroker, burst: Burst, run: int) -> float:
    """(a) batches/s delivered to a bare subscriber, nothing else listening: the raw limit."""
    total = burst.devices * burst.batches
    times: list[float] = []
    sub = _client(broker, f"bench-raw-sub-{run}")
    sub.on_message = lambda _c, _u, _m: times.append(time.monotonic())
    sub.subscribe(RAW_TOPIC.format(device="+"), qos=1)
    time.sleep(0.5)  # SUBACK before the first publish
    names = [f"raw{run}-{i:03d}" for i in range(burst.devices)]
    try:
        t0 = burst.send(names, [RAW_TOPIC.format(device=n) for n in names], threading.Lock())
        wait_for(lambda: len(times) >= total, timeout=300, what="raw subscriber got every batch")
    finally:
        burst.close()
        _close([sub])
    return total / (max(times) - t0)


def controller_run(
    broker: MosquittoBroker,
    controller: ControllerProcess,
    burst: Burst,
    run: int,
    profile: Path | None,
    gil: bool,
) -> dict[str, Any]:
    """(b) batches/s stored and acked by the controller, and the stored count per the API."""
    total = burst.devices * burst.batches
    batches = burst.batches
    lock = threading.Lock()
    stored: dict[tuple[str, int], float] = {}
    # Per device, the seqs no ack has covered yet (ascending): an ack costs the bench what it newly
    # covers, not a scan of every seq (the bench shares the machine it measures).
    uncovered: dict[str, list[int]] = {}

    def on_ack(_c: mqtt.Client, _u: Any, m: mqtt.MQTTMessage) -> None:
        now = time.monotonic()
        parsed = TOPICS.parse(m.topic)
        if parsed is None:
            return
        ack = decode(TopicKind.ACKS, bytes(m.payload))
        assert isinstance(ack, Ack)
        dev = parsed.device_id
        with lock:
            left = uncovered.setdefault(dev, list(range(1, batches + 1)))
            i = bisect.bisect_right(left, ack.upto)
            for seq in left[:i]:
                stored[(dev, seq)] = now
            rest = left[i:]
            if ack.ranges:
                for seq in rest:
                    if ack.covers(seq):
                        stored[(dev, seq)] = now
                rest = [seq for seq in rest if (dev, seq) not in stored]
            uncovered[dev] = rest

    acks = _client(broker, f"bench-acks-{run}")
    acks.on_message = on_ack
    acks.subscribe(TOPICS.all_devices(TopicKind.ACKS), qos=1)
    time.sleep(0.5)  # SUBACK before the first publish
    names = [f"bench{run}-{i:03d}" for i in range(burst.devices)]
    assert controller.proc is not None
    spy = None
    if profile is not None:
        spy = _profile(controller.proc.pid, profile.with_name(f"{profile.stem}.{run}{profile.suffix}"), gil)
        time.sleep(1.0)  # py-spy attaches
    try:
        cpu0 = _cpu_s(controller.proc.pid)
        t0 = burst.send(names, [TOPICS.device(n, TopicKind.DETECTIONS) for n in names], lock)
        wait_for(lambda: len(stored) >= total, timeout=600, what="controller acked every batch", interval=0.1)
        ctl_cpu = _cpu_s(controller.proc.pid) - cpu0
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            spy.wait(30)
        burst.close()
        _close([acks])
    lags = sorted(stored[k] - burst.published[k] for k in stored)
    with controller.client() as api:
        stored_api = sum(api.get(f"/api/v1/devices/{n}").json()["stats"]["stored"] for n in names)
    return {
        "rate": total / (max(stored.values()) - t0),
        "lag_p50_ms": 1000 * statistics.median(lags),
        "lag_p99_ms": 1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))],
        "stored_via_api": stored_api,
        "cpu_s": ctl_cpu,
    }


def run(
    devices: int,
    batches: int,
    frames: int,
    dets: int,
    runs: int = 3,
    profile: Path | None = None,
    gil: bool = False,
    database_url: str | None = None,
    say: Any = None,
) -> dict[str, Any]:
    total = devices * batches
    say = say or (lambda _text: None)
    raws: list[float] = []
    ctls: list[dict[str, Any]] = []
    ratios: list[float] = []
    payloads = {seq: _batch(seq, frames, dets) for seq in range(1, batches + 1)}
    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-ingest-") as tmp:
        work = Path(tmp)
        broker = MosquittoBroker(work / "mosquitto")
        broker.start()
        env = {"EDGEFLEET_LOG_LEVEL": "WARNING"}
        if database_url:
            env["EDGEFLEET_DATABASE_URL"] = database_url
        controller = ControllerProcess(work, broker.url, **env)
        try:
            # The first raw run before the controller exists: the broker and the publishers alone.
            raws.append(raw_run(broker, Burst(broker, devices, batches, payloads), 0))
            say(f"  raw 1       : {raws[-1]:9.1f} batches/s  (before the controller started)")
            controller.start()
            time.sleep(1.0)  # its subscriptions settle
            for i in range(runs):
                c = controller_run(
                    broker, controller, Burst(broker, devices, batches, payloads), i, profile, gil
                )
                ctls.append(c)
                say(
                    f"  controller {i + 1}: {c['rate']:9.1f} batches/s  (lag p50 {c['lag_p50_ms']:.0f} ms, "
                    f"p99 {c['lag_p99_ms']:.0f} ms; {1e6 * c['cpu_s'] / total:.0f} us CPU/batch; "
                    f"stored per the API {c['stored_via_api']} of {total})"
                )
                raws.append(raw_run(broker, Burst(broker, devices, batches, payloads), i + 1))
                say(f"  raw {i + 2}       : {raws[-1]:9.1f} batches/s  (controller idle)")
                ratios.append(c["rate"] / max(raws[-2], raws[-1]))
        finally:
            controller.stop()
            broker.stop()
    rates = [c["rate"] for c in ctls]
    ctl_rate = statistics.median(rates)
    cpu = statistics.median(c["cpu_s"] for c in ctls)
    return {
        "devices": devices,
        "batches": total,
        "frames_per_batch": frames,
        "detections_per_batch": frames * dets,
        "runs": runs,
        "raw_rate_batches_s_runs": [round(r, 1) for r in raws],
        "raw_rate_batches_s": round(statistics.median(raws), 1),
        "controller_rate_batches_s_runs": [round(r, 1) for r in rates],
        "controller_rate_batches_s": round(ctl_rate, 1),
        "controller_rate_frames_s": round(ctl_rate * frames, 1),
        "controller_rate_detections_s": round(ctl_rate * frames * dets, 1),
        "ratios": [round(r, 3) for r in ratios],
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "lag_p50_ms": round(statistics.median(c["lag_p50_ms"] for c in ctls), 1),
        "lag_p99_ms": round(statistics.median(c["lag_p99_ms"] for c in ctls), 1),
        "stored_via_api": [c["stored_via_api"] for c in ctls],
        "all_stored": all(c["stored_via_api"] == total for c in ctls),
        "controller_cpu_s": round(cpu, 2),
        "controller_cpu_us_per_batch": round(1e6 * cpu / total, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--batches", type=int, default=200, help="per device")
    ap.add_argument("--frames", type=int, default=5, help="frames per batch")
    ap.add_argument("--detections", type=int, default=4, help="detections per frame")
    ap.add_argument(
        "--runs", type=int, default=3, help="controller runs, alternating with raw runs (default 3)"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="a quick check that it runs: 4 devices x 25 batches, 1 run"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--profile",
        type=Path,
        help="record the controller with py-spy (raw format) to FILE.<run>; needs `pip install py-spy`",
    )
    ap.add_argument("--gil", action="store_true", help="with --profile: only samples holding the GIL")
    ap.add_argument(
        "--database-url", help="the controller's database (default: SQLite in a temporary folder)"
    )
    a = ap.parse_args()
    if a.smoke:
        a.devices, a.batches, a.runs = 4, 25, 1
    if min(a.devices, a.batches, a.frames, a.runs) < 1 or a.detections < 0:
        ap.error("--devices, --batches, --frames and --runs must be positive")

    def say(text: str) -> None:
        if not a.json:
            print(text, flush=True)

    total = a.devices * a.batches
    say(
        f"{a.devices} devices x {a.batches} batches of {a.frames} frames x {a.detections} detections "
        f"({a.frames * a.detections} rows per batch), QoS 1; {a.runs} controller run(s), alternating with raw"
    )
    r = run(a.devices, a.batches, a.frames, a.detections, a.runs, a.profile, a.gil, a.database_url, say=say)
    if a.json:
        print(json.dumps(r))
    else:
        print(
            f"bare paho subscriber, alone : median {r['raw_rate_batches_s']:9.1f} batches/s over "
            f"{len(r['raw_rate_batches_s_runs'])} runs"
        )
        print(
            f"controller (stored)         : median {r['controller_rate_batches_s']:9.1f} batches/s"
            f"  ({r['controller_rate_frames_s']:.0f} frames/s, {r['controller_rate_detections_s']:.0f} "
            f"detections/s) over {r['runs']} runs"
        )
        print(
            f"ratio controller / raw: median {r['ratio']:.3f}, range {r['ratio_min']:.3f}-{r['ratio_max']:.3f} "
            f"over {r['runs']} run(s)  (target >= {TARGET})"
        )
        print(f"publish -> stored lag: p50 {r['lag_p50_ms']} ms, p99 {r['lag_p99_ms']} ms (median over runs)")
        print(
            f"controller CPU: {r['controller_cpu_s']:.2f} s per run ({r['controller_cpu_us_per_batch']:.0f} "
            f"us/batch), machine load {r['load_avg_1m']}"
        )
        print(f"stored per the API: {', '.join(str(s) for s in r['stored_via_api'])} of {total} per run")
    if not r["all_stored"]:
        print(
            f"FAIL: not every batch was stored (per the API: {r['stored_via_api']} of {total} per run)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
