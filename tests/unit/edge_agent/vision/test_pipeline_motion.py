"""The pipeline's motion gate: a still camera's frames are kept from the detector and counted, its
tracks coast across them and live on; settings from the desired state replace the configuration's."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.core.settings import TrackingConfig
from edge_agent.vision.pipeline import CameraParams, Pipeline
from edge_agent.vision.tracking import Track, Tracker, TrackerFactory, TrackStep, tracker_factory
from fleet_protocol.messages import Detection, EventKind, InputSpec, MotionSettings, TrackSighting
from fleet_protocol.vision.preprocess import Preprocessor
from tests.support.edge_pipeline import SHA_A, FakeBackend, make_pipeline, manifest, results
from tests.support.waiting import wait_for


class CountingTracker:
    """The real tracker, its coasting steps counted (what the pipeline is asked to do on a skip)."""

    def __init__(self, inner: Tracker) -> None:
        self.inner = inner
        self.coasts = 0

    def update(self, detections: Sequence[Detection], at: float, clock: float) -> TrackStep:
        return self.inner.update(detections, at, clock)

    def coast(self, clock: float) -> TrackStep:
        self.coasts += 1
        return self.inner.coast(clock)

    def close(self) -> TrackStep:
        return self.inner.close()

    def tracks(self) -> list[Track]:
        return self.inner.tracks()


def counted(made: list[CountingTracker]) -> TrackerFactory:
    real = tracker_factory(TrackingConfig(confirm_frames=1, lost_after_s=2.0), itertools.count(1).__next__)
    assert real is not None

    def make(fps: Callable[[], float | None] | None = None) -> Tracker:
        made.append(CountingTracker(real(fps)))
        return made[-1]

    return make


def skipped(p: Pipeline) -> int | None:
    (stats,) = p.stats()
    return stats.frames_skipped


def test_a_still_scene_is_inferred_once_per_full_frame_period_and_its_track_lives_on(
    stop: threading.Event,
) -> None:
    made: list[CountingTracker] = []
    events: list[tuple[EventKind, str, TrackSighting]] = []
    p = make_pipeline(stop, {"a": FakeBackend()}, tracker_factory=counted(made))
    p.on_track_event = lambda kind, camera, sighting: events.append((kind, camera, sighting))
    assert skipped(p) is None  # no gate configured: nothing reported
    p.set_motion("c0", MotionSettings(enabled=True, full_frame_every_s=0.5))
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    got = results(p, 6)  # 2 s of a still scene at the fake camera's ~200 FPS
    # The first frame and the next (held open until the object's track is confirmed), then one a
    # period: skip runs of 0.5 s, well under the tracker's lost_after_s.
    gaps = [b.captured_at - a.captured_at for a, b in itertools.pairwise(got)]
    assert gaps[0] < 0.45 and all(0.45 <= g < 1.0 for g in gaps[1:]), gaps
    assert got[0].detections[0].track_id is None
    got = got[1:]
    ids = {r.detections[0].track_id for r in got}
    assert len(ids) == 1 and None not in ids
    assert made[-1].coasts > 0
    wait_for(lambda: (skipped(p) or 0) > 100, what="the skipped frames counted")
    assert [k for k, _, _ in events] == [EventKind.TRACK_STARTED]
    assert [t.id for t in p.tracks("c0")] == list(ids)
    assert p.motion_of("c0") == MotionSettings(enabled=True, full_frame_every_s=0.5)


def test_turning_the_gate_off_sends_every_frame_again(stop: threading.Event) -> None:
    p = make_pipeline(stop, {"a": FakeBackend()})
    p.set_motion("c0", MotionSettings(enabled=True, full_frame_every_s=60.0))
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    results(p, 1)  # the first frame
    wait_for(lambda: (skipped(p) or 0) > 20, what="frames skipped")
    assert p.out.get(timeout=0.3) is None
    p.set_motion("c0", None)  # back to the camera's configuration: no gate
    start = time.time()
    got = results(p, 10, lambda r: r.captured_at > start)
    assert len(got) == 10 and skipped(p) is None


class ThreadCountingPreprocessor:
    """The real preprocessor, its calls counted by the thread that made them."""

    def __init__(self, spec: InputSpec, calls: Counter[str]) -> None:
        self.inner = Preprocessor(spec)
        self.calls = calls

    def __call__(self, frame_bgr: np.ndarray) -> tuple[np.ndarray, Any]:
        self.calls[threading.current_thread().name.split("-")[0]] += 1
        return self.inner(frame_bgr)

    def batch(self, frames: Sequence[np.ndarray]) -> tuple[np.ndarray, list[Any]]:
        self.calls[threading.current_thread().name.split("-")[0]] += len(frames)
        return self.inner.batch(frames)


def test_behind_a_gate_the_capture_thread_does_not_preprocess_the_frames_it_keeps_back(
    stop: threading.Event,
) -> None:
    """Preprocessing in the capture thread is for frames the detector takes: behind a gate most are
    kept back, so only the frames the gate sends are preprocessed, and turning the gate off brings
    the capture thread's preprocessing back."""
    calls: Counter[str] = Counter()
    p = make_pipeline(
        stop,
        {"a": FakeBackend()},
        recorded=True,
        preprocessor_factory=lambda s: ThreadCountingPreprocessor(s, calls),
    )
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    wait_for(lambda: calls["capture"] > 5, what="frames preprocessed in the capture thread, no gate")
    p.set_motion("c0", MotionSettings(enabled=True, full_frame_every_s=60.0))
    wait_for(lambda: (skipped(p) or 0) > 5, what="the gate keeping frames back")
    before = calls["capture"]
    wait_for(lambda: (skipped(p) or 0) > 100, what="more frames kept back")
    assert calls["capture"] == before, "frames kept back were preprocessed in the capture thread"
    p.set_motion("c0", None)
    wait_for(lambda: calls["capture"] > before + 5, what="the capture thread preprocessing again")
