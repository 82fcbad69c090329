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

RTSP (``--source rtsp``): capture -> detection latency of one live camera. GStreamer's RTSP server
(tests/support/rtsp_server.py) streams the footage as H.264 at its 10 FPS; the agent reads it over
``--rtsp-transport`` (TCP by default) and sends one detection batch per frame (``outbox.batch_max_frames:
1``; the default batching of up to 0.5 s would be most of the figure). Latency: from the frame's
``captured_at`` (the agent's read returned, by the agent's clock, the same machine's) to its batch
reaching this bench's MQTT subscriber, p50 and p99 over the window; with, per frame, the part until
the agent sent it, the broker hop, and inference. Raw limit: a bare ``cv2.VideoCapture`` on the same
stream in this process, each frame through the agent's Preprocessor, ``session.run`` and the shared
decoder as soon as it is read (:class:`RawRtspLatency`). Runs alternate raw, pipeline, raw, ...; each
ratio is the faster raw either side over the pipeline (p50 and p99; 1.0 would be no cost at all).

Usage (from the repository root): ``python -m bench.pipeline [--cameras 4] [--threads 2] [--workers 1] [--runs 3] [--seconds 10]
[--smoke]``; ``python -m bench.pipeline --source rtsp [--rtsp-transport udp] [--runs 3] [--seconds 10]``.
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
from collections.abc import Callable, Mapping
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
from edge_agent.vision.rtsp import FFMPEG_OPTIONS_ENV
from fleet_protocol import TopicKind, Topics, decode
from fleet_protocol.messages import DetectionBatch, ModelManifest
from fleet_protocol.vision.decoders import decode as decode_detections
from fleet_protocol.vision.preprocess import Preprocessor
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import AgentProcess, ControllerProcess
from tests.support.rtsp_server import RtspServer
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


# ------------------------------------------------------------------------------------------ rtsp raw


class RawRtspLatency:
    """The raw limit of capture -> detection on an RTSP camera: a bare ``cv2.VideoCapture`` on the
    same stream (FFmpeg, the same transport and timeouts as the agent), each frame taken as soon as it
    is read and run through the agent's Preprocessor, ``session.run`` (the agent's session options and
    threads, batch 1) and the shared decoder, nothing else. Latency: the read returned -> decoded."""

    def __init__(self, url: str, transport: str, threads: int) -> None:
        self.url, self.transport, self.threads = url, transport, threads
        self.manifest = ModelManifest.model_validate_json((MODEL_DIR / "manifest.json").read_text())

    def measure(self, warmup: float, seconds: float, server: psutil.Process) -> tuple[list[float], float]:
        """Sorted latencies (ms) of the frames read in ``seconds`` after ``warmup`` seconds, and the
        CPU s/s of other jobs (neither this bench nor the RTSP ``server``) meanwhile."""
        me = {"bench": psutil.Process(os.getpid()), "server": server}
        opts = session_options(self.threads, spin=False)
        sess = ort.InferenceSession(str(MODEL_DIR / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        pre = Preprocessor(self.manifest.input)
        # Only this reader opens a capture in the bench's process: the variable is its own.
        os.environ[FFMPEG_OPTIONS_ENV] = f"rtsp_transport;{self.transport}"
        cap = cv2.VideoCapture(
            self.url,
            cv2.CAP_FFMPEG,
            [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, 10_000, cv2.CAP_PROP_READ_TIMEOUT_MSEC, 10_000],
        )
        if not cap.isOpened():
            raise SystemExit(f"the raw reader cannot open {self.url}")
        names = [o.name for o in sess.get_outputs()]
        threshold = self.manifest.default_threshold
        latencies: list[float] = []
        cpu0, wall0 = _cpu_seconds(me), time.perf_counter()
        try:
            start = time.perf_counter()
            while time.perf_counter() - start < warmup + seconds:
                ok, frame = cap.read()
                if not ok or frame is None:
                    raise SystemExit(f"the raw reader lost {self.url}")
                t0 = time.perf_counter()
                tensor, meta = pre(frame)
                outputs = sess.run(None, {self.manifest.input.name: tensor[None]})
                decode_detections(self.manifest, dict(zip(names, outputs, strict=True)), [meta], threshold)
                if t0 - start >= warmup:
                    latencies.append((time.perf_counter() - t0) * 1000)
        finally:
            cap.release()
        cpu1, wall = _cpu_seconds(me), time.perf_counter() - wall0
        ours = sum(cpu1[k] - cpu0[k] for k in me)
        other = (cpu1["machine"] - cpu0["machine"] - ours) / wall
        return sorted(latencies), max(0.0, other)


# ----------------------------------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class _Got:
    camera: str
    frame: int
    captured_at: float
    inference_ms: float
    detections: int
    sent_at: float  # the batch's, by the agent's clock (the same machine's as this bench's)
    received_at: float  # when this bench's subscriber got the batch


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
        received_at = time.time()
        batch = decode(TopicKind.DETECTIONS, bytes(msg.payload))
        assert isinstance(batch, DetectionBatch)
        with self._lock:
            got = self._got.setdefault(topic.device_id, {})
            for f in batch.frames:
                # Keyed by camera and capture time: a QoS 1 resend does not count a frame twice (the
                # first arrival is the one its latency counts).
                got.setdefault(
                    (f.camera, f.captured_at),
                    _Got(
                        f.camera,
                        f.frame,
                        f.captured_at,
                        f.inference_ms,
                        len(f.detections),
                        batch.sent_at,
                        received_at,
                    ),
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
        cameras: list[dict[str, Any]],
        inference: dict[str, Any],
        warmup: float,
        seconds: float,
        outbox: dict[str, Any] | None = None,
        helpers: Mapping[str, psutil.Process] | None = None,
    ) -> dict[str, Any]:
        """One agent with ``cameras`` (agent camera configs) and ``inference`` settings; its figures
        over the window of ``seconds`` after ``warmup`` seconds of frames. ``helpers``: other processes
        of the bench's own (a camera server) whose CPU is counted apart from other jobs'."""
        helpers = helpers or {}
        assert self.controller is not None
        device = f"bench-{index}"
        cams = [str(c["id"]) for c in cameras]
        extra: dict[str, Any] = {"inference": inference}
        if outbox:
            extra["outbox"] = outbox
        agent = AgentProcess(
            self.workdir, device, self.broker.url, cameras=cameras, controller=self.controller, **extra
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
                    lambda: len(cams_with_frames(0.0)) == len(cams),
                    timeout=180,
                    what=f"frames from all {len(cams)} cameras (agent log: {agent.log})",
                )
                t_a = time.time() + warmup
                time.sleep(max(0.0, t_a - time.time()))
                procs = {
                    "agent": psutil.Process(agent.proc.pid) if agent.proc else None,
                    "controller": psutil.Process(self.controller.proc.pid) if self.controller.proc else None,
                    "broker": psutil.Process(self.broker.proc.pid) if self.broker.proc else None,
                    "bench": psutil.Process(os.getpid()),
                    **helpers,
                }
                cpu0 = _cpu_seconds(procs)
                t_b = t_a + seconds
                time.sleep(max(0.0, t_b - time.time()))
                cpu1 = _cpu_seconds(procs)
                wall = time.time() - t_a
                # Every camera has published a frame captured after the window: the window is complete
                # (each camera's frames are published in order).
                wait_for(
                    lambda: len(cams_with_frames(t_b)) == len(cams),
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
        received = sorted((g.received_at - g.captured_at) * 1000 for g in window)
        sent = sorted((g.sent_at - g.captured_at) * 1000 for g in window)
        hop = sorted((g.received_at - g.sent_at) * 1000 for g in window)
        cpu = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu0}
        ours = sum(v for k, v in cpu.items() if k != "machine")
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
            "lat_p50_ms": _p50(lat),
            "lat_p99_ms": _p99(lat),
            "received_p50_ms": _p50(received),
            "received_p99_ms": _p99(received),
            "sent_p50_ms": _p50(sent),
            "hop_p50_ms": _p50(hop),
            "inference_p50_ms": _p50(sorted(g.inference_ms for g in window)),
        }


def _p50(ms: list[float]) -> float:
    return statistics.median(ms) if ms else float("nan")


def _p99(ms: list[float]) -> float:
    """The 99th percentile of sorted ``ms`` (nearest rank)."""
    return ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else float("nan")


# ------------------------------------------------------------------------------------------------ main


AGENT_INFERENCE: dict[str, Any] = {}


def _sayer(args: argparse.Namespace) -> Callable[[str], None]:
    """``print`` for the progress lines, silent when the result goes out as one JSON line."""

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    return say


# A detection batch per frame: the agent's default batching (10 frames or 0.5 s) trades latency for
# fewer messages, and would be most of what a latency bench measures.
RTSP_OUTBOX = {"batch_max_frames": 1}


def rtsp_main(args: argparse.Namespace) -> None:
    """``--source rtsp``: capture -> detection latency of one RTSP camera (GStreamer's RTSP server
    streaming the footage as H.264 at its 10 FPS, tests/support/rtsp_server.py), the agent's against
    the raw limit, alternating raw, pipeline, raw, ..."""

    say = _sayer(args)
    say(
        f"{MODEL} on {FOOTAGE.name} streamed over RTSP (GStreamer's RTSP server, H.264, "
        f"{args.rtsp_transport.upper()}): 1 camera, {args.threads} intra-op thread(s), batch 1, CPU execution "
        f"provider; outbox batch_max_frames 1; {args.runs} run(s) of {args.seconds:g} s"
    )
    raws: list[list[float]] = []
    raw_other: list[float] = []
    pipes: list[dict[str, Any]] = []
    ratios: list[float] = []
    ratios99: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="edgefleet-bench-") as tmp,
        RtspServer(Path(tmp) / "rtsp") as server,
        Fleet(Path(tmp)) as fleet,
    ):
        raw_loop = RawRtspLatency(server.url(), args.rtsp_transport, args.threads)
        assert server.proc is not None
        server_proc = psutil.Process(server.proc.pid)

        def raw_run() -> None:
            r, other = raw_loop.measure(args.warmup, args.seconds, server_proc)
            raws.append(r)
            raw_other.append(other)
            say(
                f"  raw {len(raws)}: capture -> detection p50 {_p50(r):6.1f} ms, p99 {_p99(r):6.1f} ms "
                f"({len(r)} frames; bare cv2.VideoCapture + onnxruntime + decode);  CPU s/s of other jobs "
                f"{other:.2f}"
            )

        raw_run()
        for i in range(args.runs):
            camera = {"id": "cam1", "source": server.url(), "rtsp_transport": args.rtsp_transport}
            inference = {"threads": args.threads, "max_batch": 1, **AGENT_INFERENCE}
            p = fleet.run(
                i + 1,
                [camera],
                inference,
                args.warmup,
                args.seconds,
                outbox=RTSP_OUTBOX,
                helpers={"rtsp_server": server_proc},
            )
            pipes.append(p)
            cpu = p["cpu_s_per_s"]
            say(
                f"  pipeline {i + 1}: capture -> detection at a subscriber p50 {p['received_p50_ms']:6.1f} ms, "
                f"p99 {p['received_p99_ms']:6.1f} ms ({p['frames']} frames, {p['fps']:.1f} FPS); capture -> "
                f"sent p50 {p['sent_p50_ms']:.1f} ms, sent -> received p50 {p['hop_p50_ms']:.1f} ms, inference "
                f"p50 {p['inference_p50_ms']:.1f} ms; capture -> stored p50 {p['lat_p50_ms']:.1f} ms;  CPU s/s: "
                f"agent {cpu['agent']:.2f}, rtsp server {cpu['rtsp_server']:.2f}, other jobs {cpu['other']:.2f}"
            )
            raw_run()
            # The raw runs either side: the faster one is the stricter limit.
            limit50 = min(_p50(raws[-2]), _p50(raws[-1]))
            limit99 = min(_p99(raws[-2]), _p99(raws[-1]))
            ratios.append(limit50 / p["received_p50_ms"])
            ratios99.append(limit99 / p["received_p99_ms"])
            say(f"  ratio {i + 1}: raw / pipeline latency p50 {ratios[-1]:.3f}, p99 {ratios99[-1]:.3f}")
    raw50 = statistics.median(_p50(r) for r in raws)
    raw99 = statistics.median(_p99(r) for r in raws)
    pipe50 = statistics.median(p["received_p50_ms"] for p in pipes)
    pipe99 = statistics.median(p["received_p99_ms"] for p in pipes)
    med = statistics.median(ratios)
    if args.json:
        print(
            json.dumps(
                {
                    "model": MODEL,
                    "source": "rtsp",
                    "transport": args.rtsp_transport,
                    "threads": args.threads,
                    "seconds": args.seconds,
                    "raw_p50_ms": [round(_p50(r), 1) for r in raws],
                    "raw_p99_ms": [round(_p99(r), 1) for r in raws],
                    "pipeline_p50_ms": [round(p["received_p50_ms"], 1) for p in pipes],
                    "pipeline_p99_ms": [round(p["received_p99_ms"], 1) for p in pipes],
                    "sent_p50_ms": [round(p["sent_p50_ms"], 1) for p in pipes],
                    "hop_p50_ms": [round(p["hop_p50_ms"], 1) for p in pipes],
                    "inference_p50_ms": [round(p["inference_p50_ms"], 1) for p in pipes],
                    "stored_p50_ms": [round(p["lat_p50_ms"], 1) for p in pipes],
                    "frames": [p["frames"] for p in pipes],
                    "ratios_p50": [round(r, 3) for r in ratios],
                    "ratios_p99": [round(r, 3) for r in ratios99],
                    "ratio_p50_median": round(med, 3),
                    "other_jobs_cpu_s_per_s": [round(o, 2) for o in raw_other]
                    + [round(p["cpu_s_per_s"]["other"], 2) for p in pipes],
                }
            )
        )
        return
    other = max([*raw_other, *(p["cpu_s_per_s"]["other"] for p in pipes)])
    if other > OTHER_JOBS_WARN:
        print(
            f"WARNING: other processes used up to {other:.2f} CPU s/s during the runs: the machine was busy, "
            "so these figures are not comparable with a quiet machine's"
        )
    print(f"raw capture -> detection: p50 {raw50:.1f} ms, p99 {raw99:.1f} ms (median over {len(raws)} runs)")
    print(
        f"agent pipeline capture -> detection (RTSP -> capture thread -> inference -> outbox -> broker -> "
        f"subscriber): p50 {pipe50:.1f} ms, p99 {pipe99:.1f} ms (median over {len(pipes)} runs)"
    )
    print(
        f"ratio raw / pipeline latency: p50 median {med:.3f}, range {min(ratios):.3f}-{max(ratios):.3f}; "
        f"p99 median {statistics.median(ratios99):.3f} over {len(ratios)} run(s)"
    )


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
    ap.add_argument(
        "--source",
        choices=("file", "rtsp"),
        default="file",
        help="file: FPS against raw onnxruntime (default); rtsp: capture -> detection latency of one camera "
        "streamed by GStreamer's RTSP server, against a bare OpenCV reader + onnxruntime",
    )
    ap.add_argument(
        "--rtsp-transport", choices=("tcp", "udp"), default="tcp", help="with --source rtsp (default tcp)"
    )
    ap.add_argument("--smoke", action="store_true", help="a quick check that it runs: 1 run of 2 s")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.seconds, args.warmup = 1, 2.0, 1.0
    if args.cameras < 1 or args.runs < 1 or args.seconds <= 0:
        ap.error("--cameras, --runs and --seconds must be positive")
    if args.source == "rtsp":
        if args.cameras != 1 or args.workers != 1:
            ap.error("--source rtsp measures one camera on one inference worker")
        rtsp_main(args)
        return
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

    say = _sayer(args)
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
                i + 1,
                [
                    {"id": f"cam{c + 1}", "source": str(FOOTAGE), "loop": True, "realtime": False}
                    for c in range(args.cameras)
                ],
                {"threads": args.threads, "workers": args.workers, "max_batch": max_batch, **AGENT_INFERENCE},
                args.warmup,
                args.seconds,
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
