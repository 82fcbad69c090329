"""Ingest benchmark: N simulated devices publish detection batches at QoS 1 to a real mosquitto.

In the same run, two observers see the same traffic:
  (a) a bare paho subscriber on ``devices/+/detections``: the rate the broker delivers (the raw limit);
  (b) the controller (a real process, SQLite by default): the rate of batches decoded, validated and
      stored, taken from its end-to-end acks (an ack is published only after the commit, so an acked seq
      is queryable through the API).
It prints both rates, their ratio (target >= 0.8) and the p50/p99 lag from publish to stored (ack).
At the end the stored count is checked through the API.

Usage: ``python bench/ingest.py [--devices 20] [--batches 200] [--frames 5] [--detections 4] [--json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def run(devices: int, batches: int, frames: int, dets: int) -> dict[str, Any]:
    total = devices * batches
    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-ingest-") as tmp:
        work = Path(tmp)
        broker = MosquittoBroker(work / "mosquitto")
        broker.start()
        controller = ControllerProcess(work, broker.url, EDGEFLEET_LOG_LEVEL="WARNING")
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

            def on_ack(_c: mqtt.Client, _u: Any, m: mqtt.MQTTMessage) -> None:
                now = time.monotonic()
                parsed = TOPICS.parse(m.topic)
                if parsed is None:
                    return
                ack = decode(TopicKind.ACKS, m.payload)
                assert isinstance(ack, Ack)
                with lock:
                    for seq in range(1, batches + 1):
                        key = (parsed.device_id, seq)
                        if key not in stored and ack.covers(seq):
                            stored[key] = now

            acks.on_message = on_ack
            acks.subscribe(TOPICS.all_devices(TopicKind.ACKS), qos=1)
            time.sleep(1.0)  # subscriptions settle (SUBACK) before the first publish

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
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--batches", type=int, default=200, help="per device")
    ap.add_argument("--frames", type=int, default=5, help="frames per batch")
    ap.add_argument("--detections", type=int, default=4, help="detections per frame")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = run(a.devices, a.batches, a.frames, a.detections)
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


if __name__ == "__main__":
    main()
