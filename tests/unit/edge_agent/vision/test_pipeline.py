from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.core.restart_policy import WatchdogAction, WatchdogNote
from edge_agent.core.settings import CameraConfig
from edge_agent.vision.capture import CameraWorker
from edge_agent.vision.pipeline import CameraParams, ModelLoadError, Pipeline
from fleet_protocol.messages import InputSpec, ModelManifest
from fleet_protocol.vision.preprocess import Preprocessor
from tests.support.edge_pipeline import SHA_A, SHA_B, FakeBackend, Frames, make_pipeline, manifest, results
from tests.support.waiting import wait_for


def test_detections_come_out_in_frame_pixels_with_capture_time(stop: threading.Event) -> None:
    p = make_pipeline(stop, {"a": FakeBackend()})
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    (r,) = results(p, 1)
    assert r.model == "a:1" and (r.width, r.height) == (64, 48)
    (d,) = r.detections
    assert d.label == "person" and d.box.x0 == pytest.approx(0.2 * 64) and d.box.y1 == pytest.approx(0.5 * 48)
    assert abs(r.captured_at - time.time()) < 60
    assert p.stats()[0].model == "a:1"


def test_zero_detection_frames_are_still_reported(stop: threading.Event) -> None:
    p = make_pipeline(stop, {"a": FakeBackend(score=0.3)})
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    assert all(r.detections == [] for r in results(p, 3))


def test_label_filter_and_threshold_change_without_reload(stop: threading.Event) -> None:
    be = FakeBackend(cls=2, score=0.7)
    p = make_pipeline(stop, {"a": be})
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    p.activate("c0", model, CameraParams(threshold=0.5))
    assert results(p, 1)[0].detections[0].label == "car"
    p.set_params("c0", CameraParams(threshold=0.5, labels=frozenset({"person"})))
    results(p, 2, lambda r: r.detections == [])
    p.set_params("c0", CameraParams(threshold=0.8))
    results(p, 2, lambda r: r.detections == [])
    assert p.model_of("c0") is model and not be.closed


def test_hot_swap_keeps_detections_flowing_and_closes_the_old_model(stop: threading.Event) -> None:
    old, new = FakeBackend(), FakeBackend()
    p = make_pipeline(stop, {"a": old, "b": new})
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    results(p, 3)
    p.activate("c0", p.load(Path("b.onnx"), manifest("b", SHA_B)), CameraParams(threshold=0.5))
    after = results(p, 3, lambda r: r.model == "b:1")
    assert all(r.detections for r in after)
    wait_for(lambda: old.closed)
    assert not new.closed


def test_failed_warm_up_keeps_the_old_model_serving(stop: threading.Event) -> None:
    class Broken(FakeBackend):
        def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
            return {"something_else": np.zeros((1,))}

    broken = Broken()
    p = make_pipeline(stop, {"a": FakeBackend(), "b": broken})
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    with pytest.raises(ModelLoadError, match="warm-up failed"):
        p.load(Path("b.onnx"), manifest("b", SHA_B))
    assert broken.closed
    p.out.drain()
    assert all(r.model == "a:1" for r in results(p, 3))


def test_nan_outputs_fail_the_warm_up(stop: threading.Event) -> None:
    p = make_pipeline(stop, {"n": FakeBackend(score=float("nan"))})
    with pytest.raises(ModelLoadError, match=r"(?i)nan"):
        p.load(Path("n.onnx"), manifest("n", SHA_B))


def test_nan_outputs_while_serving_are_counted_and_never_published(stop: threading.Event) -> None:
    be = FakeBackend()
    p = make_pipeline(stop, {"a": be})
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    results(p, 1)
    be.score = float("nan")
    wait_for(lambda: p.inference_errors >= 3)
    p.out.drain()  # results from before the model went bad
    wait_for(lambda: p.inference_errors >= 6)
    assert p.out.drain() == []


def test_cameras_on_one_model_are_batched_when_the_batch_dim_is_dynamic(stop: threading.Event) -> None:
    be = FakeBackend(delay=0.05)
    p = make_pipeline(stop, {"a": be}, cameras=3)
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    for cam in ("c0", "c1", "c2"):
        p.activate(cam, model, CameraParams(threshold=0.5))
    got = results(p, 12)
    assert 3 in be.batches
    assert {r.camera for r in got} == {"c0", "c1", "c2"}
    assert {s.model for s in p.stats()} == {"a:1"}


def test_a_fixed_batch_model_runs_one_frame_at_a_time(stop: threading.Event) -> None:
    be = FakeBackend(delay=0.05, dynamic=False)
    p = make_pipeline(stop, {"a": be}, cameras=2)
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    for cam in ("c0", "c1"):
        p.activate(cam, model, CameraParams(threshold=0.5))
    results(p, 6)
    assert set(be.batches) == {1}


def test_a_hung_run_is_abandoned_its_backend_replaced_and_its_late_result_dropped(
    stop: threading.Event,
) -> None:
    """The watchdog seam without MQTT: a hang is noted, a fresh backend serves, the stuck one's result
    (class car) never comes out, and the hung backend is never closed under its stuck call."""
    release = threading.Event()
    hang = threading.Event()

    class Hanging(FakeBackend):
        def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
            if hang.is_set() and self is made[0]:
                release.wait()
                self.cls = 2  # car: what the abandoned run returns late
            return super().run(batch)

    made: list[Hanging] = []

    def factory(path: Path, m: ModelManifest) -> Hanging:
        made.append(Hanging())
        return made[-1]

    notes: list[WatchdogNote] = []
    wake = threading.Event()
    cam = CameraWorker(
        CameraConfig(id="c0", source="rtsp://fake/0"), stop=stop, opener=lambda c: Frames(), wake=wake
    )
    p = Pipeline(
        [cam],
        stop=stop,
        wake=wake,
        backend_factory=factory,
        hang_timeout_s=0.3,
        on_watchdog=notes.append,
    )
    p.start()
    try:
        p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
        results(p, 2)
        hang.set()
        wait_for(lambda: notes)
        note = notes[0]
        assert note.action == WatchdogAction.RESTARTED and note.cameras == ("c0",) and note.model == "a:1"
        assert note.stuck_s is not None and note.stuck_s >= 0.3
        assert len(made) == 2 and p.model_of("c0").backend is made[1]  # type: ignore[union-attr]
        fresh = results(p, 3)
        release.set()
        wait_for(lambda: p.watchdog.late_results == 1)
        later = results(p, 3)
        assert all(d.label == "person" for r in fresh + later for d in r.detections)
        assert p.watchdog_status()["restarts"] == 1
    finally:
        release.set()
        stop.set()
        p.join(5)
    assert made[1].closed and made[0].closed, "both closed at the end, the hung one once it returned"


class ConcurrentBackend(FakeBackend):
    """Records which threads ran and how many runs overlapped; ``concurrent_runs`` as declared."""

    def __init__(self, concurrent: bool, delay: float = 0.02) -> None:
        super().__init__(delay=delay)
        self.concurrent_runs = concurrent
        self._lock = threading.Lock()
        self.inside = 0
        self.max_inside = 0
        self.threads: set[str] = set()

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        with self._lock:
            self.inside += 1
            self.max_inside = max(self.max_inside, self.inside)
            self.threads.add(threading.current_thread().name)
        try:
            return super().run(batch)
        finally:
            with self._lock:
                self.inside -= 1


def test_two_workers_run_their_own_cameras_concurrently_and_keep_each_camera_in_order(
    stop: threading.Event,
) -> None:
    backend = ConcurrentBackend(concurrent=True)
    p = make_pipeline(stop, {"a": backend}, cameras=4, workers=2)
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    for i in range(4):
        p.activate(f"c{i}", model, CameraParams(threshold=0.5))
    got = results(p, 80)
    assert backend.threads - {"MainThread"} == {"inference.0", "inference.1"}  # MainThread: the warm-up
    assert backend.max_inside == 2, "the two workers' runs overlapped"
    # Camera i is worker i mod 2's: batches of two cameras, never all four in one run.
    assert set(backend.batches[2:]) <= {1, 2}
    for cam in ("c0", "c1", "c2", "c3"):
        frames = [r.frame for r in got if r.camera == cam]
        assert frames and frames == sorted(frames), (cam, frames)
    p.join(5)


def test_a_backend_that_cannot_run_concurrently_gets_one_run_at_a_time(stop: threading.Event) -> None:
    backend = ConcurrentBackend(concurrent=False)
    p = make_pipeline(stop, {"a": backend}, cameras=2, workers=2)
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    for i in range(2):
        p.activate(f"c{i}", model, CameraParams(threshold=0.5))
    got = results(p, 30)
    assert {r.camera for r in got} == {"c0", "c1"}
    assert backend.threads - {"MainThread"} == {"inference.0", "inference.1"} and backend.max_inside == 1
    p.join(5)


class ThreadNoting(Preprocessor):
    """The real Preprocessor, noting which threads ran it."""

    def __init__(self, spec: InputSpec, calls: list[str]) -> None:
        super().__init__(spec)
        self.calls = calls

    def __call__(self, frame_bgr: np.ndarray) -> tuple[np.ndarray, Any]:
        self.calls.append(threading.current_thread().name)
        return super().__call__(frame_bgr)

    def batch(self, frames: Sequence[np.ndarray]) -> tuple[np.ndarray, list[Any]]:
        self.calls.extend(threading.current_thread().name for _ in frames)
        return super().batch(frames)


class ShapeNoting(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        self.shapes.append(tuple(batch.shape[1:]))
        return super().run(batch)


def test_recorded_footage_is_preprocessed_by_the_capture_threads_and_gives_the_same_detections(
    stop: threading.Event,
) -> None:
    calls: list[str] = []
    backend = ShapeNoting()
    p = make_pipeline(
        stop,
        {"a": backend},
        cameras=2,
        recorded=True,
        preprocessor_factory=lambda spec: ThreadNoting(spec, calls),
    )
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    for cam in ("c0", "c1"):
        p.activate(cam, model, CameraParams(threshold=0.5))
    got = results(p, 20)
    # The warm-up ran in this thread; every frame after it in its own camera's capture thread, but
    # for the ones each camera had read before its model was set (in its slot, and the one read ahead).
    assert calls[0] == "MainThread"
    assert set(calls[1:]) <= {"capture-c0", "capture-c1", "prepare"}
    assert calls.count("prepare") <= 4 and calls.count("capture-c0") + calls.count("capture-c1") >= 16
    assert {r.camera for r in got} == {"c0", "c1"}
    for r in got:
        (d,) = r.detections
        assert (r.width, r.height) == (64, 48) and d.box.x0 == pytest.approx(0.2 * 64)
    assert set(backend.shapes) == {(32, 32, 3)}


def test_a_swap_to_a_model_with_another_input_never_runs_it_on_frames_made_for_the_old_one(
    stop: threading.Event,
) -> None:
    calls: list[str] = []
    old, new = ShapeNoting(), ShapeNoting()
    p = make_pipeline(
        stop,
        {"a": old, "b": new},
        recorded=True,
        preprocessor_factory=lambda spec: ThreadNoting(spec, calls),
    )
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    results(p, 3)
    wide = manifest("b", SHA_B)
    wide = wide.model_copy(update={"input": wide.input.model_copy(update={"width": 48})})
    p.activate("c0", p.load(Path("b.onnx"), wide), CameraParams(threshold=0.5))
    after = results(p, 5, lambda r: r.model == "b:1")
    assert all(r.detections and r.width == 64 for r in after)
    assert set(old.shapes) == {(32, 32, 3)}
    assert set(new.shapes) == {(32, 48, 3)}  # the warm-up and every frame: none made for 32x32


def test_a_live_camera_faster_than_its_model_leaves_preprocessing_to_the_prepare_thread(
    stop: threading.Event,
) -> None:
    """Frames dropped unused would waste preprocessing: it is done only for the frames taken."""
    calls: list[str] = []
    p = make_pipeline(
        stop,
        {"a": FakeBackend(delay=0.05)},  # 200 frames/s against 20 runs/s
        preprocessor_factory=lambda spec: ThreadNoting(spec, calls),
    )
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    results(p, 10)
    camera = p.cameras["c0"]
    assert camera.dropped > 50
    assert calls.count("capture-c0") <= 2, "at most the frames before the first drop"
    assert calls.count("prepare") >= 8
