"""What a camera costs where it runs (PROTOCOL.md "Heartbeat"): the pipeline measures each variant's
inference-lane and CPU time per frame, and each camera's decode time, source rate and last inference,
so that the controller can place cameras by measurement. Measured here against what the backends and
sources themselves measure, on the bundled model and footage and on stubs."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from edge_agent.control.heartbeat import LaneShares, build_heartbeat, variant_costs
from edge_agent.core.settings import CameraConfig
from edge_agent.inference.backend import InferenceBackend
from edge_agent.inference.ort import OnnxRuntimeBackend
from edge_agent.vision.capture import CameraWorker, VideoSource
from edge_agent.vision.pipeline import CameraParams, Pipeline, VariantFigures
from fleet_protocol import TopicKind, decode, encode
from fleet_protocol.messages import CameraStats, Heartbeat, ModelManifest
from tests.support.edge_pipeline import SHA_A, SHA_B, FakeBackend, make_pipeline, manifest, results
from tests.support.paths import FOOTAGE, MODELS
from tests.support.waiting import wait_for

CPU = "CPUExecutionProvider"


def documented_smoothing(samples: list[float]) -> float:
    """PROTOCOL.md "Heartbeat": the mean of the first 10 runs, then an EWMA with alpha 0.1."""
    value = 0.0
    for n, sample in enumerate(samples, 1):
        value += max(0.1, 1.0 / n) * (sample - value)
    return value


class Gate:
    """Holds a backend's runs on demand. With one inference worker, once :meth:`close` returns a run
    waits here and every run before it is over and counted, so the figures read then are of exactly
    the runs the backend noted."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._held = threading.Event()

    def enter(self) -> None:
        if not self._open.is_set():
            self._held.set()
            self._open.wait(10)

    def close(self) -> None:
        self._open.clear()
        wait_for(self._held.is_set, what="a run held at the gate")

    def open(self) -> None:
        self._open.set()


class Timed:
    """A backend that notes what each run of the one it wraps took, per frame of the batch, as the
    backend's own clock sees it (the warm-up run included, first)."""

    def __init__(self, inner: InferenceBackend) -> None:
        self.inner = inner
        self.provider = inner.provider
        self.input_name = inner.input_name
        self.input_shape = inner.input_shape
        self.dynamic_batch = inner.dynamic_batch
        self.cpu_threads: int = getattr(inner, "cpu_threads", 0)
        self.per_frame_ms: list[float] = []
        self.gate = Gate()

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        self.gate.enter()
        t0 = time.perf_counter()
        out = self.inner.run(batch)
        self.per_frame_ms.append((time.perf_counter() - t0) * 1000.0 / batch.shape[0])
        return out

    def close(self) -> None:
        self.inner.close()


class Noting(FakeBackend):
    """A stub model that notes what each run took per frame, by its own clock; ``first_delay``: its
    first run (the warm-up at load) is that much slower, as a CUDA or TensorRT start is.
    ``cpu_threads``: it says it runs on the CPU with that many threads (0: on an accelerator, so its
    runs, sleeps here, spend no CPU)."""

    def __init__(self, delay: float, first_delay: float = 0.0, cpu_threads: int = 0) -> None:
        super().__init__(delay=delay)
        self.first_delay = first_delay
        self.cpu_threads = cpu_threads
        self.per_frame_ms: list[float] = []
        self.gate = Gate()

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        self.gate.enter()
        t0 = time.perf_counter()
        if not self.batches:
            time.sleep(self.first_delay)
        out = super().run(batch)
        self.per_frame_ms.append((time.perf_counter() - t0) * 1000.0 / batch.shape[0])
        return out


def measured(p: Pipeline, variants: int) -> list[VariantFigures] | None:
    costs = [c for c in p.variant_costs() if c.frames]
    return costs if len(costs) == variants else None


def rates_known(p: Pipeline) -> CameraStats | None:
    cam = camera(p)
    return cam if cam.source_fps and cam.fps else None


def only_cost(p: Pipeline) -> VariantFigures:
    (cost,) = wait_for(lambda: measured(p, 1), what="a measured variant")
    return cost


def camera(p: Pipeline, cam: str = "c0") -> CameraStats:
    return next(s for s in p.stats() if s.camera == cam)


def heartbeat_of(p: Pipeline, shares: LaneShares) -> Heartbeat:
    """What the heartbeat thread sends, through the codec as the controller receives it."""
    figures = p.variant_costs()
    hb = build_heartbeat(
        {},
        p.stats(),
        outbox_pending=0,
        outbox_dropped=0,
        queue_dropped=0,
        costs=variant_costs(figures, shares.shares(figures, time.monotonic())),
    )
    back = decode(TopicKind.HEARTBEAT, encode(hb))
    assert isinstance(back, Heartbeat)
    return back


# --------------------------------------------------------------------------- the bundled model


def test_the_bundled_model_on_the_bundled_footage_reports_what_it_costs(stop: threading.Event) -> None:
    made: list[Timed] = []

    def factory(path: Path, m: ModelManifest) -> Timed:
        made.append(Timed(OnnxRuntimeBackend(path, threads=1, available=[CPU])))
        return made[-1]

    wake = threading.Event()
    footage = CameraConfig(id="c0", source=str(FOOTAGE), realtime=False)
    p = Pipeline([CameraWorker(footage, stop=stop, wake=wake)], stop=stop, wake=wake, backend_factory=factory)
    p.start()
    ped = ModelManifest.model_validate_json((MODELS / "ped_ssdlite" / "manifest.json").read_text())
    p.activate("c0", p.load(MODELS / "ped_ssdlite" / "model.onnx", ped), CameraParams(threshold=0.5))
    shares = LaneShares()
    heartbeat_of(p, shares)  # the first heartbeat opens the interval busy is measured over
    results(p, 12)
    (timed,) = made
    timed.gate.close()
    try:
        hb = heartbeat_of(p, shares)
    finally:
        timed.gate.open()

    (cost,) = hb.costs
    assert cost.variant == "ped_ssdlite/1"
    # The backend's own time per frame, smoothed as documented, less its warm-up run: no production run.
    production = timed.per_frame_ms[1:]
    assert cost.frames == len(production) >= 12
    assert cost.infer_ms == pytest.approx(documented_smoothing(production), rel=0.1)
    # On the CPU provider the run itself is CPU time, and preprocessing a 768x576 frame adds to it.
    assert cost.cpu_ms is not None and cost.cpu_ms > cost.infer_ms
    # The footage is read as fast as the model takes it: its lane is busy most of the interval.
    assert cost.busy is not None and 0.0 < cost.busy <= 1.0

    (cam,) = hb.cameras
    cap = cv2.VideoCapture(str(FOOTAGE))
    recorded_fps = cap.get(cv2.CAP_PROP_FPS)
    cap.release()
    assert cam.source_fps == pytest.approx(recorded_fps)
    assert cam.decode_ms is not None and cam.decode_ms > 0.0
    assert cam.last_inferred_at is not None and abs(cam.last_inferred_at - time.time()) < 60


# --------------------------------------------------------------------------- stubs


def test_a_batch_run_is_shared_by_its_frames_and_the_warm_up_is_not_counted(stop: threading.Event) -> None:
    timed = Noting(delay=0.04, first_delay=0.5)
    p = make_pipeline(stop, {"a": timed}, cameras=2)
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    for cam in ("c0", "c1"):
        p.activate(cam, model, CameraParams(threshold=0.5))
    results(p, 30)
    timed.gate.close()
    try:
        cost = only_cost(p)
    finally:
        timed.gate.open()
    assert cost.variant == "a/1" and cost.frames == sum(timed.batches[1:]) >= 30
    # Two live cameras far faster than the model: runs of two frames, each frame half the run.
    assert 2 in timed.batches[1:]
    production = timed.per_frame_ms[1:]
    assert cost.infer_ms == pytest.approx(documented_smoothing(production), rel=0.1)
    assert cost.infer_ms < timed.per_frame_ms[0] / 4, "the warm-up is not a production run"


def test_a_cpu_run_costs_cpu_on_each_of_its_threads_and_a_device_run_does_not(stop: threading.Event) -> None:
    on_cpu = Noting(delay=0.03, cpu_threads=2)
    on_device = Noting(delay=0.03)
    p = make_pipeline(stop, {"cpu": on_cpu, "gpu": on_device}, cameras=2, workers=2)
    p.activate("c0", p.load(Path("cpu.onnx"), manifest("cpu", SHA_A)), CameraParams(threshold=0.5))
    p.activate("c1", p.load(Path("gpu.onnx"), manifest("gpu", SHA_B)), CameraParams(threshold=0.5))
    results(p, 6, lambda r: r.camera == "c0")
    results(p, 6, lambda r: r.camera == "c1")
    costs = {c.variant: c for c in wait_for(lambda: measured(p, 2), what="both variants measured")}
    cpu, gpu = costs["cpu/1"], costs["gpu/1"]
    assert cpu.cpu_ms >= 2 * cpu.infer_ms
    assert gpu.cpu_ms < gpu.infer_ms / 2


class Concurrent(FakeBackend):
    concurrent_runs = True  # as onnxruntime on the CPU: several workers may run it at once


def test_a_variant_has_a_lane_per_worker_only_where_its_backend_runs_concurrently(
    stop: threading.Event,
) -> None:
    p = make_pipeline(stop, {"cpu": Concurrent(), "gpu": FakeBackend()}, cameras=4, workers=2)
    cpu = p.load(Path("cpu.onnx"), manifest("cpu", SHA_A))
    gpu = p.load(Path("gpu.onnx"), manifest("gpu", SHA_B))
    for cam, model in (("c0", cpu), ("c1", cpu), ("c2", gpu), ("c3", gpu)):  # each on both workers
        p.activate(cam, model, CameraParams(threshold=0.5))
    assert {f.variant: f.lanes for f in p.variant_costs()} == {"cpu/1": 2, "gpu/1": 1}


def test_last_inferred_at_advances_on_frames_without_detections(stop: threading.Event) -> None:
    p = make_pipeline(stop, {"a": FakeBackend(score=0.3)})  # below the threshold: nothing detected
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    assert all(r.detections == [] for r in results(p, 2))
    first = wait_for(lambda: camera(p).last_inferred_at)
    assert abs(first - time.time()) < 60
    assert all(r.detections == [] for r in results(p, 2))
    wait_for(lambda: (camera(p).last_inferred_at or 0.0) > first, what="a later inference")


class BlockingReads:
    """A live source that delivers a frame every 20 ms: its reads wait, they do not work."""

    fps: float | None = None

    def read(self) -> np.ndarray | None:
        time.sleep(0.02)
        return np.full((48, 64, 3), 100, np.uint8)

    def release(self) -> None:
        pass


class BusyReads:
    """A source whose decoder spends about 2 ms of this thread's CPU per frame (it notes how much),
    then waits for the next frame."""

    fps: float | None = None

    def __init__(self) -> None:
        self.cpu_ms: list[float] = []

    def read(self) -> np.ndarray | None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.002:
            pass
        self.cpu_ms.append((time.thread_time() - t0) * 1000.0)
        time.sleep(0.01)
        return np.full((48, 64, 3), 100, np.uint8)

    def release(self) -> None:
        pass


def one_camera(stop: threading.Event, source: VideoSource, config: dict[str, object]) -> Pipeline:
    """One camera on ``source``, its frames run by a stub model of 100 ms a frame."""
    wake = threading.Event()
    cam = CameraWorker(
        CameraConfig.model_validate({"id": "c0", **config}), stop=stop, opener=lambda c: source, wake=wake
    )
    p = Pipeline(
        [cam], stop=stop, wake=wake, backend_factory=lambda path, m: FakeBackend(delay=0.1), max_batch=1
    )
    p.start()
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    return p


def test_a_live_source_reports_the_rate_it_delivers_and_its_waits_are_not_decode_time(
    stop: threading.Event,
) -> None:
    p = one_camera(stop, BlockingReads(), {"source": "rtsp://camera/1"})
    results(p, 4)
    cam = wait_for(lambda: rates_known(p), what="both rates")
    # The source delivers at most 50 frames/s; the model runs at most 10: the source's rate is not the
    # achieved one.
    assert cam.source_fps is not None and cam.fps < cam.source_fps <= 50.0
    assert cam.decode_ms is not None and cam.decode_ms < 5.0


def test_decode_time_is_the_cpu_the_capture_thread_spends_reading(stop: threading.Event) -> None:
    source = BusyReads()
    p = one_camera(stop, source, {"source": "rtsp://camera/1"})
    results(p, 4)
    cam = camera(p)
    assert cam.decode_ms is not None
    assert cam.decode_ms == pytest.approx(statistics.median(source.cpu_ms[1:]), rel=0.3)


def test_a_file_reports_the_rate_it_was_recorded_at(stop: threading.Event) -> None:
    source = BusyReads()
    source.fps = 12.5
    p = one_camera(stop, source, {"source": "/footage/yard.avi", "realtime": False})
    results(p, 3)
    assert camera(p).source_fps == 12.5
    stop.set()
    wait_for(lambda: camera(p).state == "stopped")
    assert camera(p).source_fps is None, "a camera that is not up delivers nothing"
