"""Per-camera model slots, the inference thread, and the hand-off to the publisher.

Stages overlap: capture threads (one per camera, newest frame only) -> a prepare thread (takes the
newest frame of each camera, batches frames of cameras sharing a model, preprocesses) -> a one-item
hand-off that blocks the prepare thread when full -> ONE inference thread (runs the model, decodes)
-> a bounded drop-oldest queue -> the publisher thread. So the next batch is decoded from video and
preprocessed while the model runs on the current one.

Hot swap: a new model is loaded and warmed up beside the old one; only then does the camera's slot
point at it. A batch already prepared for the old model still runs on it, and the next frame goes to
the new one, so no frame is lost to a swap; replaced models are closed by the inference thread, the
only thread that runs them, after it has run what was prepared for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edge_agent.backends import BackendFactory, InferenceBackend
from edge_agent.capture import CameraWorker, Frame
from edge_agent.queues import DropOldestQueue, HandoffQueue
from fleet_protocol.messages import (
    Box,
    CameraState,
    CameraStats,
    Detection,
    FrameDetections,
    InputSpec,
    ModelManifest,
)

log = logging.getLogger(__name__)


class _Meta(Protocol):
    width: int
    height: int


class _Raw(Protocol):
    class_id: int
    score: float
    x0: float
    y0: float
    x1: float
    y1: float


class PreprocessorLike(Protocol):
    def __call__(self, frame_bgr: np.ndarray) -> tuple[np.ndarray, Any]: ...

    def batch(self, frames: Sequence[np.ndarray]) -> tuple[np.ndarray, list[Any]]: ...


PreprocessorFactory = Callable[[InputSpec], PreprocessorLike]
DecodeFn = Callable[[ModelManifest, Mapping[str, np.ndarray], Sequence[Any], float], Sequence[Sequence[Any]]]


class ModelLoadError(Exception):
    """A model could not be loaded or failed its warm-up; the message says why."""


@dataclass(eq=False)
class LoadedModel:
    """A model ready to serve: backend + manifest + its preprocessor. Shared by cameras on the same sha."""

    manifest: ModelManifest
    backend: InferenceBackend
    preprocessor: PreprocessorLike
    closed: bool = False

    @property
    def key(self) -> str:
        return f"{self.manifest.name}:{self.manifest.version}"

    @property
    def sha256(self) -> str:
        return self.manifest.sha256


@dataclass(frozen=True)
class CameraParams:
    """What can change without a reload."""

    threshold: float
    max_fps: float | None = None
    labels: frozenset[str] | None = None


@dataclass(eq=False)
class _Prepared:
    """One batch ready for the model: frames of cameras sharing ``model``, preprocessed."""

    model: LoadedModel
    items: list[tuple[Frame, CameraParams]]
    batch: np.ndarray
    metas: list[Any]


@dataclass
class _CamStats:
    inferred: int = 0
    skipped: int = 0
    errors: int = 0
    inference_ms: deque[float] = field(default_factory=lambda: deque(maxlen=50))
    times: deque[float] = field(default_factory=lambda: deque(maxlen=30))
    last_inferred: float = 0.0
    last: FrameDetections | None = None


class Pipeline:
    """Owns the camera workers, the model slots and the inference thread."""

    def __init__(
        self,
        cameras: Sequence[CameraWorker],
        *,
        stop: threading.Event,
        wake: threading.Event,
        backend_factory: BackendFactory,
        max_batch: int = 4,
        out_queue_size: int = 256,
        preprocessor_factory: PreprocessorFactory | None = None,
        decode_fn: DecodeFn | None = None,
    ) -> None:
        if preprocessor_factory is None:
            from edge_agent.preprocess import Preprocessor

            preprocessor_factory = Preprocessor
        if decode_fn is None:
            from edge_agent.decoders import decode

            decode_fn = decode
        self._preprocessor_factory = preprocessor_factory
        self._decode = decode_fn
        self._backend_factory = backend_factory
        self.cameras = {c.id: c for c in cameras}
        self._stop = stop
        self._wake = wake
        self.max_batch = max_batch
        # Inference -> publisher. Drop policy: oldest (see DropOldestQueue).
        self.out: DropOldestQueue[FrameDetections] = DropOldestQueue(out_queue_size)
        self._lock = threading.Lock()
        self._slots: dict[str, tuple[LoadedModel, CameraParams]] = {}
        self._retired: list[LoadedModel] = []
        self._stats = {c: _CamStats() for c in self.cameras}
        self._error_log_at = 0.0
        # Prepare -> inference. Drop policy: none; the prepare thread waits (see HandoffQueue).
        self._prepared: HandoffQueue[_Prepared] = HandoffQueue(1)
        self._prep_thread = threading.Thread(target=self._prepare_loop, name="prepare", daemon=True)
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)

    # ------------------------------------------------------------------ models

    def load(self, path: Path, manifest: ModelManifest) -> LoadedModel:
        """Load ``path`` and run one warm-up inference through preprocess, backend and decoder."""
        try:
            backend = self._backend_factory(path, manifest)
        except Exception as exc:
            raise ModelLoadError(f"load failed: {exc}") from exc
        try:
            pre = self._preprocessor_factory(manifest.input)
            warm = np.zeros((manifest.input.height, manifest.input.width, 3), dtype=np.uint8)
            tensor, meta = pre(warm)
            outputs = backend.run(tensor[None])
            self._decode(manifest, outputs, [meta], manifest.default_threshold)
        except Exception as exc:
            backend.close()
            raise ModelLoadError(f"warm-up failed: {exc}") from exc
        log.info("model %s:%s ready on %s", manifest.name, manifest.version, backend.provider)
        return LoadedModel(manifest=manifest, backend=backend, preprocessor=pre)

    def loaded(self, sha256: str) -> LoadedModel | None:
        """A model already serving some camera, to share rather than load twice."""
        with self._lock:
            for model, _ in self._slots.values():
                if model.sha256 == sha256:
                    return model
        return None

    def model_of(self, camera: str) -> LoadedModel | None:
        with self._lock:
            slot = self._slots.get(camera)
            return slot[0] if slot else None

    def activate(self, camera: str, model: LoadedModel, params: CameraParams) -> None:
        """Point ``camera`` at ``model`` (atomic swap)."""
        with self._lock:
            old = self._slots.get(camera)
            self._slots[camera] = (model, params)
            self._retire_if_unused(old[0] if old else None)
        log.info("camera %s now runs %s (threshold %.2f)", camera, model.key, params.threshold)

    def set_params(self, camera: str, params: CameraParams) -> None:
        with self._lock:
            slot = self._slots.get(camera)
            if slot is not None:
                self._slots[camera] = (slot[0], params)

    def clear(self, camera: str) -> None:
        with self._lock:
            old = self._slots.pop(camera, None)
            self._retire_if_unused(old[0] if old else None)

    def _retire_if_unused(self, model: LoadedModel | None) -> None:
        if model is not None and all(m is not model for m, _ in self._slots.values()):
            self._retired.append(model)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for cam in self.cameras.values():
            cam.start()
        self._prep_thread.start()
        self._thread.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for cam in self.cameras.values():
            if not cam.join(max(0.1, deadline - time.monotonic())):
                log.warning("capture thread of %s did not stop in time", cam.id)
        self._prep_thread.join(max(0.1, deadline - time.monotonic()))
        self._thread.join(max(0.1, deadline - time.monotonic()))
        if self._thread.is_alive() or self._prep_thread.is_alive():
            log.warning("prepare or inference thread did not stop in time")
            return
        self._prepared.drain()
        with self._lock:
            models = {id(m): m for m, _ in self._slots.values()}
            self._slots.clear()
            models.update({id(m): m for m in self._retired})
            self._retired.clear()
        for m in models.values():
            m.backend.close()

    def restart(self) -> None:
        """Reopen every source and reset the counters (command restart_pipeline)."""
        for cam in self.cameras.values():
            cam.reopen()
        with self._lock:
            self._stats = {c: _CamStats() for c in self.cameras}

    # ------------------------------------------------------------------ stats

    def stats(self) -> list[CameraStats]:
        out = []
        with self._lock:
            slots = dict(self._slots)
            stats = dict(self._stats)
        for cam_id, cam in self.cameras.items():
            st = stats[cam_id]
            slot = slots.get(cam_id)
            fps = cam.fps
            if slot is not None:
                fps = _rate(st.times)
            ms = list(st.inference_ms)
            out.append(
                CameraStats(
                    camera=cam_id,
                    state=cam.state,
                    fps=round(fps, 2),
                    frames=cam.frames,
                    dropped=cam.dropped,
                    inference_ms=round(float(np.median(ms)), 2) if ms else None,
                    model=slot[0].key if slot else None,
                )
            )
        return out

    def last_result(self, camera: str) -> FrameDetections | None:
        with self._lock:
            st = self._stats.get(camera)
            return st.last if st else None

    def providers(self) -> dict[str, str]:
        with self._lock:
            return {m.key: m.backend.provider for m, _ in self._slots.values()}

    # ------------------------------------------------------------------ inference thread

    def _prepare_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            try:
                for prepared in self._prepare_round():
                    if not self._prepared.put(prepared, self._stop):
                        return
            except Exception:
                # One bad round must not stop analytics on every camera.
                log.exception("prepare round failed")

    def _prepare_round(self) -> list[_Prepared]:
        with self._lock:
            slots = dict(self._slots)
            stats = self._stats
        now = time.monotonic()
        groups: dict[int, list[tuple[Frame, CameraParams]]] = {}
        models: dict[int, LoadedModel] = {}
        for cam_id, (model, params) in slots.items():
            cam = self.cameras.get(cam_id)
            if cam is None:
                continue
            frame = cam.slot.take()
            if frame is None:
                continue
            st = stats[cam_id]
            if params.max_fps and now - st.last_inferred < 1.0 / params.max_fps:
                st.skipped += 1  # the FPS cap asked for it; not a loss
                continue
            st.last_inferred = now
            groups.setdefault(id(model), []).append((frame, params))
            models[id(model)] = model
        out: list[_Prepared] = []
        for key, items in groups.items():
            model = models[key]
            step = self.max_batch if model.backend.dynamic_batch else 1
            for i in range(0, len(items), step):
                chunk = items[i : i + step]
                images = [f.image for f, _ in chunk]
                try:
                    if len(images) == 1:
                        tensor, meta = model.preprocessor(images[0])
                        batch, metas = tensor[None], [meta]
                    else:
                        batch, metas = model.preprocessor.batch(images)
                except Exception as exc:
                    for f, _ in chunk:
                        stats[f.camera].errors += 1
                    self._log_error("preprocessing for %s failed: %s", model.key, exc)
                    continue
                out.append(_Prepared(model=model, items=chunk, batch=batch, metas=metas))
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            prepared = self._prepared.get(0.1)
            if prepared is not None:
                with self._lock:
                    stats = self._stats
                if prepared.model.closed:
                    # Prepared for a model replaced and closed meanwhile (a rare race with the swap).
                    for f, _ in prepared.items:
                        stats[f.camera].skipped += 1
                else:
                    try:
                        self._infer(prepared, stats)
                    except Exception:
                        log.exception("inference round failed")
            self._close_retired()
        self._close_retired()

    def _close_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for m in retired:
            m.closed = True
            m.backend.close()
            log.info("closed %s", m.key)

    def _infer(self, prepared: _Prepared, stats: dict[str, _CamStats]) -> None:
        model, items, metas = prepared.model, prepared.items, prepared.metas
        t0 = time.perf_counter()
        try:
            outputs = model.backend.run(prepared.batch)
            threshold = min(p.threshold for _, p in items)
            decoded = self._decode(model.manifest, outputs, metas, threshold)
        except Exception as exc:
            for f, _ in items:
                stats[f.camera].errors += 1
            self._log_error("inference on %s failed: %s", model.key, exc)
            return
        ms = (time.perf_counter() - t0) * 1000.0
        done = time.monotonic()
        labels = model.manifest.labels
        for (frame, params), raws, meta in zip(items, decoded, metas, strict=True):
            dets = [d for d in (_detection(r, labels) for r in raws if r.score >= params.threshold) if d]
            if params.labels is not None:
                dets = [d for d in dets if d.label in params.labels]
            result = FrameDetections(
                camera=frame.camera,
                frame=frame.index,
                captured_at=frame.captured_at,
                width=int(meta.width),
                height=int(meta.height),
                model=model.key,
                inference_ms=round(ms, 3),
                detections=dets[:1000],
            )
            st = stats[frame.camera]
            st.inferred += 1
            st.inference_ms.append(ms)
            st.times.append(done)
            st.last = result
            self.out.put(result)

    def _log_error(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._error_log_at > 10.0:
            self._error_log_at = now
            log.error(fmt, *args)

    @property
    def inference_errors(self) -> int:
        with self._lock:
            return sum(s.errors for s in self._stats.values())

    def camera_states(self) -> dict[str, CameraState]:
        return {c: w.state for c, w in self.cameras.items()}

    def latest_frame(self, camera: str) -> Frame | None:
        cam = self.cameras.get(camera)
        return cam.slot.peek_latest() if cam else None

    def camera_ids(self) -> Iterable[str]:
        return self.cameras.keys()


def _detection(r: _Raw, labels: Sequence[str]) -> Detection | None:
    if not 0 <= r.class_id < len(labels):
        return None
    try:
        return Detection(
            label=labels[r.class_id],
            class_id=r.class_id,
            score=min(1.0, max(0.0, float(r.score))),
            box=Box(x0=float(r.x0), y0=float(r.y0), x1=float(r.x1), y1=float(r.y1)),
        )
    except ValueError:
        return None


def _rate(times: deque[float]) -> float:
    ts = list(times)
    if len(ts) < 2 or time.monotonic() - ts[-1] > 2.0:
        return 0.0
    return (len(ts) - 1) / max(ts[-1] - ts[0], 1e-6)
