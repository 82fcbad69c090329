"""Pipeline benchmark: ped_ssdlite on the bundled footage, over one or several cameras.

Raw limit (measured in this process): frames decoded and preprocessed beforehand with the agent's own
Preprocessor, held in memory, stacked ``batch`` at a time, and ``session.run`` in a tight loop on a
session with the agent's session options (ORT_ENABLE_ALL, CPU execution provider), in each layout of
the same cores: the agent's (``--workers`` threads calling the session at once, each run on
``--threads`` intra-op threads with its share of the cameras, batch = ceil(cameras / workers)) and,
with several workers, one run at a time on workers x threads intra-op threads with every camera in the
batch. Each layout of several intra-op threads with onnxruntime's spinning off (the agent's default)
and on; the fastest of all is the limit. A one-thread layout is measured once: onnxruntime creates no
intra-op thread pool for one thread (``CreateThreadPoolHelper`` returns none when the size is 1), so
spinning on and off are the same session, and taking the faster of two runs of it would only add the
run-to-run noise to the limit (up to 6 % between such pairs on the 2-vCPU VM).

Pipeline: a real agent process (capture threads -> prepare thread -> inference worker threads ->
publisher) with N cameras, each playing the bundled footage in a loop as fast as the pipeline takes
frames (``realtime: false``), each worker's cameras batched up to the max batch (default N, at most
64, so one model run per worker per round as in the raw loop; the agent's own default is 4), publishing to a real
Mosquitto with a real controller storing every row. Aggregate FPS: the distinct frames whose capture
time falls in a window of ``--seconds`` (after ``--warmup`` seconds of frames flowing), over the window.

Runs alternate: raw, pipeline, raw, pipeline, ..., raw. Each pipeline run's ratio is taken against the
faster of the two raw runs either side of it (the stricter limit); the median and range over the runs
are printed.

Where the time goes, per pipeline run, from what the agent publishes and from the OS:
  - ``busy``: the inference threads' share of the window spent in model run + decode (the sum over
    distinct batches of the ``inference_ms`` each frame reports; an estimate, +- one batch at each edge
    of the window, so it can read a little over the worker count in short windows), and ``speed``: raw
    ms per frame over the pipeline's inference ms per frame. ratio = busy x
    speed exactly, so ``busy`` below the worker count means a worker waited for frames (capture or
    prepare too slow), and ``speed`` x workers below 1 means each run was slower than raw (other work on
    the cores, or smaller batches);
  - the mean batch size;
  - CPU seconds per second of the agent, controller, broker, this bench, and everything else on the
    machine (other people's jobs).
And the latency from frame capture (agent clock) to the row stored at the controller, p50 and p99.

Usage (from the repository root): ``python -m bench.pipeline [--cameras 4] [--threads 2] [--workers 1] [--runs 3] [--seconds 10]
[--smoke]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnxruntime as ort
import paho.mqtt.client as mqtt
import psutil

from edge_agent.inference.providers import session_options
from fleet_protocol import TopicKind, Topics, decode
from fleet_protocol.messages import DetectionBatch, ModelManifest
from fleet_protocol.vision.preprocess import Preprocessor
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import AgentProcess, ControllerProcess
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]

MODEL = "ped_ssdlite"
MODEL_DIR = REPO / "models" / MODEL
FOOTAGE = REPO / "models" / "footage" / "vtest.avi"
RAW_FRAMES = 200  # distinct frames the raw loop cycles through
MAX_BATCH = 64  # the agent's inference.max_batch limit
OTHER_JOBS_WARN = 0.2  # CPU s/s of other processes above which the figures are not trustworthy


def _ts(value: str | float) -> float:
    return float(value) if isinstance(value, int | float) else datetime.fromisoformat(value).timestamp()


# ---------------------------------------------------------------------------------------------- raw


@dataclass(frozen=True)
class Layout:
    """How the raw loop runs the model: ``workers`` threads calling one session at once, each run on
    ``threads`` intra-op threads with ``batch`` frames."""

    workers: int
    threads: int
    batch: int

    def __str__(self) -> str:
        return f"{self.workers}x{self.threads}t b{self.batch}"


@dataclass(frozen=True)
class RawFps:
    fps: dict[str, float]  # per layout and spinning ("1x2t b4 spin off": FPS)
    other_cpu: float  # CPU s/s of other processes on the machine meanwhile

    @property
    def best(self) -> float:
        return max(self.fps.values())


class RawLoop:
    """Preprocessed frames in memory, ``batch`` at a time, session.run in a tight loop, in each of
    ``layouts`` (the agent's own, and the other ways of spending the same cores)."""

    def __init__(self, layouts: list[Layout]) -> None:
        self.layouts = layouts
        manifest = ModelManifest.model_validate_json((MODEL_DIR / "manifest.json").read_text())
        self.input_name = manifest.input.name
        pre = Preprocessor(manifest.input)  # the agent's own preprocessing
        cap = cv2.VideoCapture(str(FOOTAGE))
        tensors: list[np.ndarray] = []
        biggest = max(lay.batch for lay in layouts)
        while len(tensors) < max(RAW_FRAMES, 4 * biggest):
            ok, frame = cap.read()
            if not ok:
                cap.release()
                cap = cv2.VideoCapture(str(FOOTAGE))  # from the start again if the clip is too short
                continue
            tensors.append(pre(frame)[0])
        cap.release()
        self.tensors = tensors

    def _fps(self, layout: Layout, spin: bool, seconds: float) -> float:
        # The agent's own session options, so the only difference is everything around the session.
        opts = session_options(layout.threads, spin=spin)
        sess = ort.InferenceSession(str(MODEL_DIR / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        b, t = layout.batch, self.tensors
        # Consecutive frames in one batch, as N cameras started together would give.
        feeds = [{self.input_name: np.stack(t[i : i + b])} for i in range(0, len(t) - b + 1, b)]
        for f in feeds[:5]:
            sess.run(None, f)
        counts = [0] * layout.workers
        start = time.perf_counter()

        def loop(w: int) -> None:
            n = w
            while counts[w] < 3 or time.perf_counter() - start < seconds:
                sess.run(None, feeds[n % len(feeds)])
                n += layout.workers
                counts[w] += 1

        threads = [threading.Thread(target=loop, args=(w,)) for w in range(layout.workers)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - start
        # The session (and its spinning threads) goes with this frame: none left while the agent runs.
        return sum(counts) * b / elapsed

    def measure(self, seconds: float) -> RawFps:
        me = {"bench": psutil.Process(os.getpid())}
        cpu0, t0 = _cpu_seconds(me), time.perf_counter()
        fps = {
            f"{lay} spin {'on' if spin else 'off'}": self._fps(lay, spin, seconds)
            for lay in self.layouts
            for spin in ((False, True) if lay.threads > 1 else (False,))
        }
        cpu1, wall = _cpu_seconds(me), time.perf_counter() - t0
        other = (cpu1["machine"] - cpu0["machine"] - (cpu1["bench"] - cpu0["bench"])) / wall
        return RawFps(fps=fps, other_cpu=max(0.0, other))


# ----------------------------------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class _Got:
    camera: str
    frame: int
    captured_at: float
    inference_ms: float
    detections: int


def _cpu_seconds(procs: Mapping[str, psutil.Process | None]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, p in procs.items():
        try:
            t = p.cpu_times() if p is not None else None
        except psutil.Error:
            t = None
        out[name] = (t.user + t.system) if t is not None else 0.0
    total = psutil.cpu_times()
    out["machine"] = total.user + total.nice + total.system + total.irq + total.softirq
    return out


class Fleet:
    """Broker, controller and a detections subscriber, kept up for all pipeline runs; one agent per run
    (a device of its own each time, so the stored rows of a run are easy to tell apart)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.broker = MosquittoBroker(workdir / "mosquitto")
        self.controller: ControllerProcess | None = None
        self.topics = Topics()
        self._lock = threading.Lock()
        self._got: dict[str, dict[tuple[str, float], _Got]] = {}
        self._sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-sub")
        self._sub.on_message = self._on_message

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        topic = self.topics.parse(msg.topic)
        if topic is None:
            return
        batch = decode(TopicKind.DETECTIONS, bytes(msg.payload))
        assert isinstance(batch, DetectionBatch)
        with self._lock:
            got = self._got.setdefault(topic.device_id, {})
            for f in batch.frames:
                # Keyed by camera and capture time: a QoS 1 resend does not count a frame twice.
                got[(f.camera, f.captured_at)] = _Got(
                    f.camera, f.frame, f.captured_at, f.inference_ms, len(f.detections)
                )

    def __enter__(self) -> Fleet:
        self.broker.start()
        self.controller = ControllerProcess(self.workdir, self.broker.url)
        self.controller.start()
        self._sub.connect(self.broker.host, self.broker.port)
        self._sub.subscribe(self.topics.all_devices(TopicKind.DETECTIONS), qos=1)
        self._sub.loop_start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sub.loop_stop()
        with contextlib.suppress(Exception):
            self._sub.disconnect()
        if self.controller is not None:
            self.controller.stop()
        self.broker.stop()

    def _frames(self, device: str) -> list[_Got]:
        with self._lock:
            return list(self._got.get(device, {}).values())

    def run(
        self,
        index: int,
        cameras: int,
        threads: int,
        workers: int,
        max_batch: int,
        warmup: float,
        seconds: float,
    ) -> dict[str, Any]:
        assert self.controller is not None
        device = f"bench-{index}"
        cams = [f"cam{i + 1}" for i in range(cameras)]
        agent = AgentProcess(
            self.workdir,
            device,
            self.broker.url,
            cameras=[{"id": c, "source": str(FOOTAGE), "loop": True, "realtime": False} for c in cams],
            inference={"threads": threads, "workers": workers, "max_batch": max_batch, **AGENT_INFERENCE},
            controller=self.controller,
        )
        try:
            with self.controller.client() as api:
                api.post("/api/v1/devices", json={"id": device}).raise_for_status()
                for c in cams:
                    api.put(
                        f"/api/v1/devices/{device}/cameras/{c}/model", json={"model": MODEL, "version": "1"}
                    ).raise_for_status()
                agent.start()

                def cams_with_frames(after: float) -> set[str]:
                    if not agent.alive():
                        raise SystemExit(f"the agent exited: {agent.log.read_text()[-3000:]}")
                    return {g.camera for g in self._frames(device) if g.captured_at >= after}

                wait_for(
                    lambda: len(cams_with_frames(0.0)) == cameras,
                    timeout=180,
                    what=f"frames from all {cameras} cameras (agent log: {agent.log})",
                )
                t_a = time.time() + warmup
                time.sleep(max(0.0, t_a - time.time()))
                procs = {
                    "agent": psutil.Process(agent.proc.pid) if agent.proc else None,
                    "controller": psutil.Process(self.controller.proc.pid) if self.controller.proc else None,
                    "broker": psutil.Process(self.broker.proc.pid) if self.broker.proc else None,
                    "bench": psutil.Process(os.getpid()),
                }
                cpu0 = _cpu_seconds(procs)
                t_b = t_a + seconds
                time.sleep(max(0.0, t_b - time.time()))
                cpu1 = _cpu_seconds(procs)
                wall = time.time() - t_a
                # Every camera has published a frame captured after the window: the window is complete
                # (each camera's frames are published in order).
                wait_for(
                    lambda: len(cams_with_frames(t_b)) == cameras,
                    timeout=60,
                    what="frames captured after the window",
                )
                agent.stop()
                got = self._frames(device)

                def all_stored() -> list[dict[str, Any]] | None:
                    rows: list[dict[str, Any]] = []
                    cursor = None
                    while True:
                        params: dict[str, Any] = {"device": device, "limit": 1000}
                        if cursor:
                            params["cursor"] = cursor
                        page = api.get("/api/v1/detections", params=params).json()
                        rows += page["items"]
                        cursor = page.get("next_cursor")
                        if not cursor:
                            break
                    want = sum(g.detections for g in got)
                    return rows if rows and len(rows) >= want else None

                rows = wait_for(all_stored, timeout=120, what="rows stored")
        finally:
            agent.stop()
        window = [g for g in got if t_a <= g.captured_at < t_b]
        fps = len(window) / seconds
        # Frames of one batch share their inference_ms (the batch's model run + decode).
        batches: dict[float, int] = {}
        for g in window:
            batches[g.inference_ms] = batches.get(g.inference_ms, 0) + 1
        busy_ms = sum(batches.keys())
        per_cam = {c: sum(1 for g in window if g.camera == c) for c in cams}
        lat = sorted((_ts(r["stored_at"]) - _ts(r["captured_at"])) * 1000 for r in rows)
        cpu = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu0}
        ours = cpu["agent"] + cpu["controller"] + cpu["broker"] + cpu["bench"]
        cpu["other"] = max(0.0, cpu.pop("machine") - ours)
        return {
            "fps": fps,
            "frames": len(window),
            "per_camera": per_cam,
            "batches": len(batches),
            "mean_batch": len(window) / max(1, len(batches)),
            "busy": busy_ms / 1000.0 / seconds,
            "infer_ms_per_frame": busy_ms / max(1, len(window)),
            "cpu_s_per_s": cpu,
            "rows": len(rows),
            "lat_p50_ms": statistics.median(lat) if lat else float("nan"),
            "lat_p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
        }


# ------------------------------------------------------------------------------------------------ main


AGENT_INFERENCE: dict[str, Any] = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cameras", type=int, default=1, help="cameras, each playing the footage (default 1)")
    ap.add_argument(
        "--threads", type=int, default=2, help="intra-op threads of each model run (raw and agent alike)"
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="the agent's inference workers (inference.workers), each with --threads (default 1)",
    )
    ap.add_argument(
        "--agent-spin",
        action="store_true",
        help="the agent's sessions spin (inference.spin: true; default off)",
    )
    ap.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="frames per model run, raw and agent alike (default: cameras)",
    )
    ap.add_argument(
        "--runs", type=int, default=3, help="pipeline runs, alternating with raw runs (default 3)"
    )
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window of each run (default 10)")
    ap.add_argument(
        "--warmup", type=float, default=3.0, help="seconds of frames before the window (default 3)"
    )
    ap.add_argument("--target", type=float, default=None, help="default 0.90 for one camera, else 0.85")
    ap.add_argument("--smoke", action="store_true", help="a quick check that it runs: 1 run of 2 s")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.seconds, args.warmup = 1, 2.0, 1.0
    if args.cameras < 1 or args.runs < 1 or args.seconds <= 0:
        ap.error("--cameras, --runs and --seconds must be positive")
    if args.max_batch is not None and not 1 <= args.max_batch <= MAX_BATCH:
        ap.error(f"--max-batch must be 1..{MAX_BATCH} (the agent's limit)")
    if not 1 <= args.workers <= 16 or args.threads < 1:
        ap.error("--workers must be 1..16 and --threads positive")
    max_batch = args.max_batch or min(args.cameras, MAX_BATCH)
    # Each worker batches its own cameras (camera i: worker i mod workers).
    batch = min(-(-args.cameras // args.workers), max_batch)
    # The raw limit is the best way to spend the same cores on the model: the agent's layout, and one
    # session run on all of them with every camera in one batch.
    layouts = [Layout(args.workers, args.threads, batch)]
    if args.workers > 1:
        layouts.append(Layout(1, args.threads * args.workers, min(args.cameras, max_batch)))
    target = args.target if args.target is not None else (0.90 if args.cameras == 1 else 0.85)

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    say(
        f"{MODEL} on {FOOTAGE.name}: {args.cameras} camera(s), {args.workers} inference worker(s) of "
        f"{args.threads} intra-op thread(s), batch {batch}, CPU execution provider; {args.runs} run(s) of "
        f"{args.seconds:g} s; raw layouts: {', '.join(str(lay) for lay in layouts)}"
    )
    if args.agent_spin:
        AGENT_INFERENCE["spin"] = True
    raw_loop = RawLoop(layouts)
    raws: list[RawFps] = []
    pipes: list[dict[str, Any]] = []
    ratios: list[float] = []

    def raw_run() -> None:
        r = raw_loop.measure(args.seconds)
        raws.append(r)
        each = ", ".join(f"{k} {v:.1f}" for k, v in r.fps.items())
        say(f"  raw {len(raws)}: {r.best:7.1f} FPS  ({each});  CPU s/s of other jobs {r.other_cpu:.2f}")

    with tempfile.TemporaryDirectory(prefix="edgefleet-bench-") as tmp, Fleet(Path(tmp)) as fleet:
        raw_run()
        for i in range(args.runs):
            p = fleet.run(
                i + 1, args.cameras, args.threads, args.workers, max_batch, args.warmup, args.seconds
            )
            pipes.append(p)
            cpu = p["cpu_s_per_s"]
            per_cam = p["per_camera"].values()
            say(
                f"  pipeline {i + 1}: {p['fps']:7.1f} FPS  ({p['frames']} frames in {args.seconds:g} s, "
                f"{min(per_cam)}-{max(per_cam)} per camera, mean batch {p['mean_batch']:.2f}/{batch});  "
                f"CPU s/s: agent {cpu['agent']:.2f}, controller "
                f"{cpu['controller']:.2f}, broker {cpu['broker']:.2f}, bench {cpu['bench']:.2f}, "
                f"other jobs {cpu['other']:.2f}"
            )
            raw_run()
            limit = max(raws[-2].best, raws[-1].best)  # the raw runs either side: the stricter one
            ratio = p["fps"] / limit
            ratios.append(ratio)
            p["speed"] = (1000.0 / limit) / p["infer_ms_per_frame"] if p["infer_ms_per_frame"] else 0.0
            say(
                f"  ratio {i + 1}: {ratio:.3f} = inference threads busy {p['busy']:.2f} (of {args.workers}) x "
                f"speed of their runs against raw {p['speed']:.2f}"
            )
    med = statistics.median(ratios)
    lat50 = statistics.median(p["lat_p50_ms"] for p in pipes)
    lat99 = statistics.median(p["lat_p99_ms"] for p in pipes)
    result = {
        "model": MODEL,
        "cameras": args.cameras,
        "batch": batch,
        "threads": args.threads,
        "workers": args.workers,
        "raw_layouts": [str(lay) for lay in layouts],
        "seconds": args.seconds,
        "raw_fps": [round(r.best, 1) for r in raws],
        "raw_fps_each": [{k: round(v, 1) for k, v in r.fps.items()} for r in raws],
        "raw_other_jobs_cpu_s_per_s": [round(r.other_cpu, 2) for r in raws],
        "pipeline_fps": [round(p["fps"], 1) for p in pipes],
        "ratios": [round(r, 3) for r in ratios],
        "ratio_median": round(med, 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "target": target,
        "busy": [round(p["busy"], 3) for p in pipes],
        "speed": [round(p["speed"], 3) for p in pipes],
        "mean_batch": [round(p["mean_batch"], 2) for p in pipes],
        "frames_per_camera": [p["per_camera"] for p in pipes],
        "cpu_s_per_s": [{k: round(v, 2) for k, v in p["cpu_s_per_s"].items()} for p in pipes],
        "rows_stored": [p["rows"] for p in pipes],
        "capture_to_stored_p50_ms": round(lat50, 1),
        "capture_to_stored_p99_ms": round(lat99, 1),
    }
    if args.json:
        print(json.dumps(result))
        return
    other = max(max(p["cpu_s_per_s"]["other"] for p in pipes), max(r.other_cpu for r in raws))
    if other > OTHER_JOBS_WARN:
        print(
            f"WARNING: other processes used up to {other:.2f} CPU s/s during the runs: the machine was busy, "
            "so these figures are not comparable with a quiet machine's"
        )
    print(
        f"raw onnxruntime (preprocessed frames in memory, the fastest of layouts "
        f"{', '.join(str(lay) for lay in layouts)}, spin on/off where several threads): "
        f"median {statistics.median(r.best for r in raws):.1f} FPS over {len(raws)} runs"
    )
    print(
        f"agent pipeline, {args.cameras} camera(s) (file -> broker -> stored): "
        f"median {statistics.median(p['fps'] for p in pipes):.1f} FPS over {len(pipes)} runs"
    )
    print(
        f"ratio pipeline / raw: median {med:.3f}, range {min(ratios):.3f}-{max(ratios):.3f} over "
        f"{len(ratios)} run(s)  (target >= {target:.2f})"
    )
    print(
        f"capture -> stored at controller: p50 {lat50:.1f} ms, p99 {lat99:.1f} ms (median over runs; "
        f"{sum(p['rows'] for p in pipes)} detection rows)"
    )


if __name__ == "__main__":
    main()
