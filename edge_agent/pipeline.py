"""Per-camera model slots, the inference thread, and the hand-off to the publisher.

Stages overlap: capture threads (one per camera, newest frame only) -> a prepare thread (takes the
newest frame of each camera, batches frames of cameras sharing a model, preprocesses) -> a one-item
hand-off that blocks the prepare thread when full -> ONE inference thread (runs the model, decodes)
-> a bounded drop-oldest queue -> the publisher thread. So the next batch is decoded from video and
preprocessed while the model runs on the current one.

Hot swap: a new model is loaded and warmed up beside the old one; only then does the camera's slot
point at it. A batch already prepared for the old model still runs on it, and the next frame goes to
the new one, so no frame is lost to a swap; replaced models are closed by the inference thread, the
only thread that runs them, after it has run what was prepared for them. The camera's latency and FPS
windows start afresh at the swap and count only the new model's results, so the stats (and the
rollout gate judging them) describe the model that runs now.

Watchdog: a run that takes longer than ``hang_timeout_s`` is a hang. A hung thread cannot be killed in
Python, so it is abandoned: the pipeline's generation moves on, the stuck (daemon) thread exits when
its run ever returns and its late result is dropped, its backend is never closed under it. A fresh
backend is made for the model and a new inference thread started. :class:`RestartLimiter` bounds
the restarts; past the bound the pipeline is marked failed and retried with capped backoff. Every
step goes to ``on_watchdog`` for the agent to report.
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
from edge_agent.watchdog import RestartLimiter, WatchdogAction, WatchdogNote
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


WatchdogCallback = Callable[[WatchdogNote], None]

# Abandoned inference threads still stuck, beyond which no new one is started: each may hold a
# session and its buffers; past this the pipeline stays failed and says why.
_MAX_STUCK_THREADS = 8


class ModelLoadError(Exception):
    """A model could not be loaded or failed its warm-up; the message says why."""


@dataclass(eq=False)
class LoadedModel:
    """A model ready to serve: backend + manifest + its preprocessor. Shared by cameras on the same sha."""

    manifest: ModelManifest
    backend: InferenceBackend  # replaced by the watchdog when a run on it hung
    preprocessor: PreprocessorLike
    closed: bool = False
    path: Path | None = None  # the file it was loaded from: the watchdog makes a fresh backend of it

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


@dataclass(frozen=True)
class _Busy:
    """The run in progress on the inference thread of generation ``gen``."""

    gen: int
    since: float  # time.monotonic()
    prepared: _Prepared


# Per-camera stats windows: the median over the last MEDIAN_WINDOW inference times, the p99 over the
# last LATENCY_WINDOW (200: enough samples that p99 is not simply the maximum of a handful, while at
# 2 FPS it still covers under two minutes), the rate over the last FPS_WINDOW frames.
MEDIAN_WINDOW = 50
LATENCY_WINDOW = 200
FPS_WINDOW = 30


@dataclass(eq=False)
class _ModelWindow:
    """Latency and rate of ONE model on a camera. A swap starts a fresh window, so a heartbeat sent
    shortly after activation (and the rollout gate that reads it) judges the new model, never a mix
    with its predecessor's numbers."""

    model: LoadedModel | None = None  # results of any other model are published but not counted here
    inference_ms: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    times: deque[float] = field(default_factory=lambda: deque(maxlen=FPS_WINDOW))


@dataclass
class _CamStats:
    inferred: int = 0
    skipped: int = 0
    errors: int = 0
    window: _ModelWindow = field(default_factory=_ModelWindow)
    last_inferred: float = 0.0  # the FPS cap's clock: kept across a swap, the cap is the camera's
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
        hang_timeout_s: float | None = None,
        restart_limiter: RestartLimiter | None = None,
        on_watchdog: WatchdogCallback | None = None,
    ) -> None:
        """``hang_timeout_s`` None: no watchdog. ``restart_limiter`` default: 3 restarts in 10 min,
        then retries 10 s doubling to 10 min."""
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
        # Watchdog state. ``_gen`` names the live inference thread; a thread of an older generation
        # was abandoned and must not touch anything shared when (if ever) its run returns.
        self.hang_timeout_s = hang_timeout_s
        self._limiter = restart_limiter or RestartLimiter(
            max_restarts=3, window_s=600.0, backoff_min_s=10.0, backoff_max_s=600.0
        )
        self._on_watchdog = on_watchdog
        self._gen = 0
        self._busy: _Busy | None = None
        self._ok_gen = -1  # the generation of the last run that completed
        # Abandoned threads with the backend each was stuck in: such a backend is closed only once
        # its thread has returned (closing a session under a running call could crash the process).
        self._stuck: list[tuple[threading.Thread | None, InferenceBackend]] = []
        self.late_results = 0  # results of abandoned runs that came back anyway, dropped
        self.watchdog_restarts = 0
        self._watch_state: dict[str, Any] = {"failed": False}
        self._retry_now = False
        self._failed_model: LoadedModel | None = None  # the model whose run hung last
        self._thread: threading.Thread | None = self._inference_thread(0)
        self._watch_thread = threading.Thread(target=self._watch_loop, name="watchdog", daemon=True)

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
        return LoadedModel(manifest=manifest, backend=backend, preprocessor=pre, path=path)

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
        """Point ``camera`` at ``model`` (atomic swap); a different model gets fresh stats windows."""
        with self._lock:
            old = self._slots.get(camera)
            self._slots[camera] = (model, params)
            self._retire_if_unused(old[0] if old else None)
            st = self._stats.get(camera)
            if st is not None and st.window.model is not model:
                st.window = _ModelWindow(model=model)
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
            if camera in self._stats:
                # A camera that runs no model reports no inference latency.
                self._stats[camera].window = _ModelWindow()

    def _retire_if_unused(self, model: LoadedModel | None) -> None:
        if model is not None and all(m is not model for m, _ in self._slots.values()):
            self._retired.append(model)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for cam in self.cameras.values():
            cam.start()
        self._prep_thread.start()
        assert self._thread is not None
        self._thread.start()
        if self.hang_timeout_s is not None:
            self._watch_thread.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for cam in self.cameras.values():
            if not cam.join(max(0.1, deadline - time.monotonic())):
                log.warning("capture thread of %s did not stop in time", cam.id)
        self._prep_thread.join(max(0.1, deadline - time.monotonic()))
        if self._watch_thread.is_alive():
            self._watch_thread.join(max(0.1, deadline - time.monotonic()))
        thread = self._thread  # abandoned (stuck) threads are daemons and are not waited for
        if thread is not None and thread.is_alive():
            thread.join(max(0.1, deadline - time.monotonic()))
        if (thread is not None and thread.is_alive()) or self._prep_thread.is_alive():
            log.warning("prepare or inference thread did not stop in time")
            return
        self._prepared.drain()
        with self._lock:
            models = {id(m): m for m, _ in self._slots.values()}
            self._slots.clear()
            models.update({id(m): m for m in self._retired})
            self._retired.clear()
        for m in models.values():
            self._close_backend(m.backend)
        self._release_returned()

    def restart(self) -> None:
        """Reopen every source and reset the counters (command restart_pipeline); a pipeline the
        watchdog marked failed is tried again at once."""
        for cam in self.cameras.values():
            cam.reopen()
        with self._lock:
            # Fresh counters, and fresh windows still bound to the model each camera runs.
            running = {c: m for c, (m, _) in self._slots.items()}
            self._stats = {c: _CamStats(window=_ModelWindow(model=running.get(c))) for c in self.cameras}
            self._retry_now = True

    def watchdog_status(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self._watch_state,
                "hang_timeout_s": self.hang_timeout_s,
                "restarts": self.watchdog_restarts,
                "late_results_dropped": self.late_results,
                "stuck_threads": sum(1 for t, _ in list(self._stuck) if t is not None and t.is_alive()),
            }

    # ------------------------------------------------------------------ stats

    def stats(self) -> list[CameraStats]:
        """Per camera: capture counters, and the rate and latency of the model it runs now (only
        that model's results since its activation: FPS reads 0 until it has done two frames)."""
        out = []
        with self._lock:
            slots = dict(self._slots)
            # Copied under the lock: the inference thread appends to these deques.
            windows = {
                c: (list(st.window.inference_ms), list(st.window.times)) for c, st in self._stats.items()
            }
        for cam_id, cam in self.cameras.items():
            ms, times = windows[cam_id]
            slot = slots.get(cam_id)
            fps = cam.fps
            if slot is not None:
                fps = _rate(times)
            median, p99 = latency_summary(ms)
            out.append(
                CameraStats(
                    camera=cam_id,
                    state=cam.state,
                    fps=round(fps, 2),
                    frames=cam.frames,
                    dropped=cam.dropped,
                    inference_ms=median,
                    inference_p99_ms=p99,
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

    def _inference_thread(self, gen: int) -> threading.Thread:
        name = "inference" if gen == 0 else f"inference-{gen}"
        return threading.Thread(target=self._run, args=(gen,), name=name, daemon=True)

    def _live(self, gen: int) -> bool:
        return self._gen == gen and not self._stop.is_set()

    def _run(self, gen: int) -> None:
        while self._live(gen):
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
                        self._infer(prepared, stats, gen)
                    except Exception:
                        log.exception("inference round failed")
            if self._gen != gen:
                log.warning("abandoned inference thread %s returned; exiting", gen)
                return
            self._close_retired()
        if self._gen == gen:
            self._close_retired()

    def _close_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for m in retired:
            m.closed = True
            self._close_backend(m.backend)
            log.info("closed %s", m.key)

    def _hung(self, backend: InferenceBackend) -> bool:
        return any(backend is b for _, b in list(self._stuck))

    def _close_backend(self, backend: InferenceBackend) -> None:
        if self._hung(backend):
            return  # a stuck run may still be inside it
        try:
            backend.close()
        except Exception:
            log.exception("closing a backend failed")

    def _infer(self, prepared: _Prepared, stats: dict[str, _CamStats], gen: int) -> None:
        model, items, metas = prepared.model, prepared.items, prepared.metas
        with self._lock:
            if self._gen != gen:
                return
            self._busy = _Busy(gen, time.monotonic(), prepared)
        t0 = time.perf_counter()
        error: Exception | None = None
        try:
            outputs = model.backend.run(prepared.batch)
            threshold = min(p.threshold for _, p in items)
            decoded = self._decode(model.manifest, outputs, metas, threshold)
        except Exception as exc:
            error = exc
        with self._lock:
            if self._gen != gen:
                # The watchdog gave up on this run and restarted; whatever it returned is stale.
                self.late_results += 1
                return
            self._busy = None
            if error is None:
                self._ok_gen = gen
        if error is not None:
            for f, _ in items:
                stats[f.camera].errors += 1
            self._log_error("inference on %s failed: %s", model.key, error)
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
            with self._lock:
                st.inferred += 1
                # A batch prepared for the old model that finishes after the swap is still published
                # (no gap in detections) but kept out of the new model's window.
                if st.window.model is model:
                    st.window.inference_ms.append(ms)
                    st.window.times.append(done)
                st.last = result
            self.out.put(result)

    # ------------------------------------------------------------------ watchdog thread

    def _watch_loop(self) -> None:
        assert self.hang_timeout_s is not None
        interval = min(1.0, self.hang_timeout_s / 4)
        while not self._stop.wait(interval):
            try:
                self._watch_once()
            except Exception:
                # The watchdog must outlive whatever it watches.
                log.exception("watchdog round failed")

    def _watch_once(self) -> None:
        assert self.hang_timeout_s is not None
        now = time.monotonic()
        stuck: threading.Thread | None = None
        with self._lock:
            busy = self._busy
            if busy is not None and busy.gen == self._gen and now - busy.since > self.hang_timeout_s:
                # Abandon it: from here on the stuck thread's generation is not the live one.
                self._gen += 1
                self._busy = None
                stuck, self._thread = self._thread, None
            else:
                busy = None
            retry_now, self._retry_now = self._retry_now, False
            ran_ok = self._ok_gen == self._gen
        if busy is not None:
            self._on_hang(busy, now - busy.since, stuck)
            return
        if retry_now:
            self._limiter.retry_now()
        if self._limiter.retry_due():
            self._retry()
        elif ran_ok and self._limiter.healthy():
            model = self._failed_model
            self._failed_model = None
            self._note(
                WatchdogAction.RECOVERED,
                f"inference on {model.key if model else 'the pipeline'} completes again",
                model,
            )

    def _on_hang(self, busy: _Busy, stuck_s: float, thread: threading.Thread | None) -> None:
        model = busy.prepared.model
        self._stuck.append((thread, model.backend))
        with self._lock:
            stats = self._stats
        for f, _ in busy.prepared.items:
            if f.camera in stats:
                stats[f.camera].errors += 1
        reason = (
            f"inference on {model.key} ({model.backend.provider}) hung: no result after {stuck_s:.1f} s "
            f"(bound {self.hang_timeout_s:g} s)"
        )
        self._failed_model = model
        decision = self._limiter.on_hang()
        if decision.action == WatchdogAction.RESTARTED:
            problem = self._start_inference(model)
            if problem is None:
                self._note(WatchdogAction.RESTARTED, reason, model, stuck_s=stuck_s)
                return
            reason = f"{reason}; restart failed: {problem}"
            delay = self._limiter.fail()
        else:
            reason = (
                f"{reason}; {decision.restarts_in_window} restarts in the last "
                f"{self._limiter.window_s:g} s already"
            )
            delay = decision.retry_in_s or 0.0
        self._note(WatchdogAction.FAILED, reason, model, stuck_s=stuck_s, retry_in_s=delay)

    def _retry(self) -> None:
        self._limiter.retrying()
        model = self._failed_model
        problem = self._start_inference(model)
        if problem is None:
            self._note(WatchdogAction.RETRY, "starting inference again after a failure", model)
            return
        delay = self._limiter.fail()
        self._note(WatchdogAction.FAILED, f"retry failed: {problem}", model, retry_in_s=delay)

    def _start_inference(self, model: LoadedModel | None) -> str | None:
        """A fresh backend for ``model`` if it still serves and hung, and a new inference thread;
        why not, or None."""
        stuck = sum(1 for t, _ in self._stuck if t is not None and t.is_alive())
        if stuck >= _MAX_STUCK_THREADS:
            return f"{stuck} abandoned inference threads are still stuck"
        with self._lock:
            serving = model is not None and any(m is model for m, _ in self._slots.values())
        if model is not None and serving and self._hung(model.backend):
            if model.path is None:
                return f"no model file to reload {model.key} from"
            try:
                backend = self._backend_factory(model.path, model.manifest)
            except Exception as exc:
                return f"reloading {model.key} failed: {exc}"
            with self._lock:
                model.backend = backend
            log.info("watchdog: %s reloaded on %s", model.key, backend.provider)
        self._release_returned()
        # What was prepared before the hang may be old by now: newer frames are waiting upstream.
        dropped = self._prepared.drain()
        with self._lock:
            for p in dropped:
                for f, _ in p.items:
                    if f.camera in self._stats:
                        self._stats[f.camera].skipped += 1
            thread = self._inference_thread(self._gen)
            self._thread = thread
            self.watchdog_restarts += 1
        thread.start()
        return None

    def _release_returned(self) -> None:
        """Close the backends whose stuck run has returned since, unless a model still uses one."""
        with self._lock:
            in_use = [m.backend for m, _ in self._slots.values()]
        keep: list[tuple[threading.Thread | None, InferenceBackend]] = []
        done: list[InferenceBackend] = []
        for t, b in self._stuck:
            if (t is None or not t.is_alive()) and all(b is not u for u in in_use):
                done.append(b)
            else:
                keep.append((t, b))
        self._stuck = keep
        for b in done:
            try:
                b.close()
            except Exception:
                log.exception("closing an abandoned backend failed")

    def _cameras_of(self, model: LoadedModel | None) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(c for c, (m, _) in self._slots.items() if m is model))

    def _note(
        self,
        action: WatchdogAction,
        reason: str,
        model: LoadedModel | None,
        *,
        stuck_s: float | None = None,
        retry_in_s: float | None = None,
    ) -> None:
        lim = self._limiter
        note = WatchdogNote(
            action=action,
            reason=reason,
            model=model.key if model else None,
            cameras=self._cameras_of(model),
            stuck_s=round(stuck_s, 3) if stuck_s is not None else None,
            restarts_in_window=lim.restarts_in_window(),
            max_restarts=lim.max_restarts,
            window_s=lim.window_s,
            retry_in_s=retry_in_s,
        )
        failed = action == WatchdogAction.FAILED
        with self._lock:
            self._watch_state = {
                "failed": failed,
                "last_action": action.value,
                "reason": reason,
                "retry_in_s": retry_in_s,
            }
        if failed:
            log.error("watchdog: pipeline failed: %s; next try in %.1f s", reason, retry_in_s or 0.0)
        elif action == WatchdogAction.RESTARTED:
            log.error("watchdog: %s; restarted", reason)
        else:
            log.info("watchdog: %s: %s", action.value, reason)
        if self._on_watchdog is not None:
            try:
                self._on_watchdog(note)
            except Exception:
                log.exception("watchdog callback failed")

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


def latency_summary(samples: Sequence[float]) -> tuple[float | None, float | None]:
    """(median of the newest MEDIAN_WINDOW, p99 of all) in ms, rounded; (None, None) without samples.

    p99 by linear interpolation: with fewer than about 100 samples it lies close to the maximum, which
    is the honest answer for a short window."""
    if not samples:
        return None, None
    median = float(np.median(samples[-MEDIAN_WINDOW:]))
    p99 = float(np.percentile(samples, 99))
    return round(median, 2), round(p99, 2)


def _rate(times: Sequence[float]) -> float:
    ts = list(times)
    if len(ts) < 2 or time.monotonic() - ts[-1] > 2.0:
        return 0.0
    return (len(ts) - 1) / max(ts[-1] - ts[0], 1e-6)
