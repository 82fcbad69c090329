"""An in-process pipeline on fake cameras and a fake TF-OD backend (the pipeline unit tests)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from edge_agent.core.settings import CameraConfig
from edge_agent.vision.capture import CameraWorker, SourceOpener
from edge_agent.vision.pipeline import Pipeline, PreprocessorFactory
from edge_agent.vision.tracking import TrackerFactory
from fleet_protocol.messages import FrameDetections, InputSpec, ModelManifest

SHA_A = "a" * 64


SHA_B = "b" * 64


def manifest(name: str, sha: str) -> ModelManifest:
    return ModelManifest(
        name=name,
        version="1",
        sha256=sha,
        size=1,
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=32, height=32),
        labels=["person", "car"],
        decoder_params={"class_offset": 1},
    )


class FakeBackend:
    """TF-OD outputs: one box per image, class ``cls`` (1-based) with score ``score``."""

    provider = "FakeExecutionProvider"
    input_name = "x"
    input_shape: tuple[int | str | None, ...] = ("N", 32, 32, 3)

    def __init__(self, cls: int = 1, score: float = 0.9, dynamic: bool = True, delay: float = 0.0) -> None:
        self.cls, self.score, self.dynamic_batch, self.delay = cls, score, dynamic, delay
        self.batches: list[int] = []
        self.closed = False

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        b = batch.shape[0]
        self.batches.append(b)
        time.sleep(self.delay)  # a slow model: every camera has a new frame by the next round
        return {
            "num_detections:0": np.full((b,), 1.0, np.float32),
            "detection_boxes:0": np.tile(np.array([[[0.1, 0.2, 0.5, 0.6]]], np.float32), (b, 1, 1)),
            "detection_scores:0": np.full((b, 1), self.score, np.float32),
            "detection_classes:0": np.full((b, 1), float(self.cls), np.float32),
        }

    def close(self) -> None:
        self.closed = True


class Frames:
    fps: float | None = None

    def __init__(self, on_release: Callable[[], None] | None = None) -> None:
        self._on_release = on_release

    def read(self) -> np.ndarray | None:
        time.sleep(0.005)
        return np.full((48, 64, 3), 100, np.uint8)

    def release(self) -> None:
        if self._on_release is not None:
            self._on_release()


class Opener:
    """A source opener that counts, per camera, the sources it opened and those released."""

    def __init__(self) -> None:
        self.opened: Counter[str] = Counter()
        self.released: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, config: CameraConfig) -> Frames:
        with self._lock:
            self.opened[config.id] += 1
        return Frames(on_release=lambda: self._release(config.id))

    def _release(self, camera: str) -> None:
        with self._lock:
            self.released[camera] += 1


def live_camera(
    camera: str, p: Pipeline, stop: threading.Event, opener: SourceOpener | None = None
) -> CameraWorker:
    """A live camera made for ``p.add_camera``."""
    config = CameraConfig(id=camera, source=f"rtsp://fake/{camera}")
    return CameraWorker(config, stop=stop, opener=opener or (lambda c: Frames()), wake=p.wake)


def make_pipeline(
    stop: threading.Event,
    backends: dict[str, FakeBackend],
    cameras: int = 1,
    workers: int = 1,
    *,
    recorded: bool = False,
    preprocessor_factory: PreprocessorFactory | None = None,
    opener: SourceOpener | None = None,
    start: bool = True,
    tracker_factory: TrackerFactory | None = None,
    loop: bool = False,
) -> Pipeline:
    """``recorded``: the cameras play files at the pipeline's pace (realtime: false), so no frame is
    dropped (``loop``: from the start again when one ends); otherwise they are live cameras far faster
    than the model. ``opener``: the cameras' sources (default: endless fake frames). ``start``: started
    before it is returned. ``tracker_factory``: the cameras' trackers (default: no tracking)."""
    wake = threading.Event()
    cams = [
        CameraWorker(
            CameraConfig.model_validate(
                {"id": f"c{i}", "source": f"/footage/{i}.avi", "realtime": False, "loop": loop}
                if recorded
                else {"id": f"c{i}", "source": f"rtsp://fake/{i}"}
            ),
            stop=stop,
            opener=opener or (lambda c: Frames()),
            wake=wake,
        )
        for i in range(cameras)
    ]
    p = Pipeline(
        cams,
        stop=stop,
        wake=wake,
        backend_factory=lambda path, m: backends[m.name],
        max_batch=4,
        workers=workers,
        preprocessor_factory=preprocessor_factory,
        tracker_factory=tracker_factory,
    )
    if start:
        p.start()
    return p


def results(
    p: Pipeline, n: int, pred: Callable[[FrameDetections], bool] = lambda r: True
) -> list[FrameDetections]:
    got: list[FrameDetections] = []
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        r = p.out.get(timeout=0.1)
        if r is not None and pred(r):
            got.append(r)
    assert len(got) == n, f"only {len(got)} results"
    return got
