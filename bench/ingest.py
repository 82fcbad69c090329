"""Ingest benchmark: N simulated devices publish detection batches at QoS 1 to a real mosquitto.

In the same run, two observers see the same traffic:
  (a) a bare paho subscriber on ``devices/+/detections``: the rate the broker delivers (the raw limit).
      It does nothing per message, so in this burst it measures how fast the bench's own publishers
      (paho clients in this one Python process, on the same machine) get the batches through the
      broker; the controller cannot see them any sooner.
  (b) the controller (a real process, SQLite by default): the rate of batches decoded, validated and
      stored, taken from its end-to-end acks (an ack is published only after the commit, so an acked seq
      is queryable through the API).
It prints both rates, their ratio (target >= 0.8) and the p50/p99 lag from publish to stored (ack).
At the end the stored count is checked through the API. It also prints the CPU time the controller
used per batch and the machine's load: on a shared machine the rates move with the load, the CPU per
batch much less.

Both rates share the machine: the CPU the controller takes during the burst is taken from the
publishers, so the raw rate moves with the controller under test too; compare the controller's rate
and its CPU per batch as well as the ratio.

Usage: ``python bench/ingest.py [--devices 20] [--batches 200] [--frames 5] [--detections 4] [--json]
[--database-url URL] [--profile FILE [--gil]]`` (``--profile`` records the controller with py-spy, which is not a dependency: ``pip install py-spy``).
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from fleet_protocol import TopicKind, Topics, decode, encode  # noqa: E402
from fleet_protocol.messages import Ack, Box, Detection, DetectionBatch, FrameDetections  # noqa: E402
from tests.mqtt_broker import MosquittoBroker  # noqa: E402
from tests.processes import ControllerProcess  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

TOPICS = Topics()


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


def run(
    devices: int,
    batches: int,
    frames: int,
    dets: int,
    profile: Path | None = None,
    gil: bool = False,
    database_url: str | None = None,
) -> dict[str, Any]:
    total = devices * batches
    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-ingest-") as tmp:
        work = Path(tmp)
        broker = MosquittoBroker(work / "mosquitto")
        broker.start()
        env = {"EDGEFLEET_LOG_LEVEL": "WARNING"}
        if database_url:
            env["EDGEFLEET_DATABASE_URL"] = database_url
        controller = ControllerProcess(work, broker.url, **env)
        controller.start()
        try:
            lock = threading.Lock()
            raw_times: list[float] = []
            published: dict[tuple[str, int], float] = {}
            stored: dict[tuple[str, int], float] = {}

            raw = _client(broker, "bench-raw")
            raw.on_message = lambda _c, _u, _m: raw_times.append(time.monotonic())
            raw.subscribe(TOPICS.all_devices(TopicKind.DETECTIONS), qos=1)

            acks = _client(broker, "bench-acks")
            # Per device, the seqs no ack has covered yet (ascending): an ack costs the bench what it
            # newly covers, not a scan of every seq (the bench shares the machine it measures).
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

            acks.on_message = on_ack
            acks.subscribe(TOPICS.all_devices(TopicKind.ACKS), qos=1)
            time.sleep(1.0)  # subscriptions settle (SUBACK) before the first publish

            spy = None
            if profile is not None:
                assert controller.proc is not None
                spy = _profile(controller.proc.pid, profile, gil)
                time.sleep(1.0)  # py-spy attaches
            payloads = {seq: _batch(seq, frames, dets) for seq in range(1, batches + 1)}
            pubs = [_client(broker, f"bench-dev-{i}") for i in range(devices)]

            def publish(i: int) -> None:
                dev = f"bench-{i:03d}"
                topic = TOPICS.device(dev, TopicKind.DETECTIONS)
                infos = []
                for seq in range(1, batches + 1):
                    with lock:
                        published[(dev, seq)] = time.monotonic()
                    infos.append(pubs[i].publish(topic, payloads[seq], qos=1))
                for info in infos:
                    info.wait_for_publish(120)

            assert controller.proc is not None
            cpu0 = _cpu_s(controller.proc.pid)
            t0 = time.monotonic()
            threads = [threading.Thread(target=publish, args=(i,)) for i in range(devices)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wait_for(lambda: len(raw_times) >= total, timeout=300, what="raw subscriber got every batch")
            wait_for(
                lambda: len(stored) >= total, timeout=600, what="controller acked every batch", interval=0.1
            )
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
                spy.wait(30)
            ctl_cpu = _cpu_s(controller.proc.pid) - cpu0
            raw_s = max(raw_times) - t0
            ctl_s = max(stored.values()) - t0
            lags = sorted(stored[k] - published[k] for k in stored)
            with controller.client() as api:
                stored_api = sum(
                    api.get(f"/api/v1/devices/bench-{i:03d}").json()["stats"]["stored"]
                    for i in range(devices)
                )
            for c in [raw, acks, *pubs]:
                c.loop_stop()
                c.disconnect()
        finally:
            controller.stop()
            broker.stop()
    raw_rate = total / raw_s
    ctl_rate = total / ctl_s
    return {
        "devices": devices,
        "batches": total,
        "detections_per_batch": frames * dets,
        "raw_rate_batches_s": round(raw_rate, 1),
        "controller_rate_batches_s": round(ctl_rate, 1),
        "controller_rate_detections_s": round(ctl_rate * frames * dets, 1),
        "ratio": round(ctl_rate / raw_rate, 3),
        "lag_p50_ms": round(1000 * statistics.median(lags), 1),
        "lag_p99_ms": round(1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))], 1),
        "stored_via_api": stored_api,
        "controller_cpu_s": round(ctl_cpu, 2),
        "controller_cpu_us_per_batch": round(1e6 * ctl_cpu / total, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--batches", type=int, default=200, help="per device")
    ap.add_argument("--frames", type=int, default=5, help="frames per batch")
    ap.add_argument("--detections", type=int, default=4, help="detections per frame")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--profile",
        type=Path,
        help="record the controller with py-spy (raw format) to this file; needs `pip install py-spy`",
    )
    ap.add_argument("--gil", action="store_true", help="with --profile: only samples holding the GIL")
    ap.add_argument(
        "--database-url", help="the controller's database (default: SQLite in a temporary folder)"
    )
    a = ap.parse_args()
    r = run(a.devices, a.batches, a.frames, a.detections, a.profile, a.gil, a.database_url)
    if a.json:
        print(json.dumps(r))
        return
    print(f"{r['devices']} devices, {r['batches']} batches of {r['detections_per_batch']} detections, QoS 1")
    print(f"  bare paho subscriber : {r['raw_rate_batches_s']:>9.1f} batches/s")
    print(
        f"  controller (stored)  : {r['controller_rate_batches_s']:>9.1f} batches/s"
        f"  ({r['controller_rate_detections_s']:.0f} detections/s)"
    )
    print(f"  ratio                : {r['ratio']:>9.3f}  (target >= 0.8)")
    print(f"  publish -> stored lag: p50 {r['lag_p50_ms']} ms, p99 {r['lag_p99_ms']} ms")
    print(f"  stored per the API   : {r['stored_via_api']} of {r['batches']}")
    print(
        f"  controller CPU       : {r['controller_cpu_s']:.2f} s ({r['controller_cpu_us_per_batch']:.0f} us/batch),"
        f" machine load {r['load_avg_1m']}"
    )


if __name__ == "__main__":
    main()
