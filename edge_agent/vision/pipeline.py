"""Per-camera model slots, the inference thread, and the hand-off to the publisher.

Stages overlap: capture threads (one per camera, newest frame only; each preprocesses its frames for
the camera's model while none of them is dropped, see ``CameraWorker.use_preprocessor``) -> a prepare
thread (takes the newest frame of each camera, batches frames of cameras sharing a model,
preprocesses those the capture thread did not) -> a one-item hand-off per inference worker that blocks
the prepare thread when full -> the inference worker threads (run the model, decode) -> a bounded
drop-oldest queue -> the publisher thread. So the next batch is decoded from video and preprocessed
while the model runs on the current one.

Hot swap: a new model is loaded and warmed up beside the old one; only then does the camera's slot
point at it. A batch already prepared for the old model still runs on it, and the next frame goes to
the new one, so no frame is lost to a swap; replaced models are closed by the inference thread, the
only thread that runs them, after it has run what was prepared for them. The camera's latency and FPS
windows start afresh at the swap and count only the new model's results, so the stats (and the
rollout gate judging them) describe the model that runs now.

Measured cost, for the controller's placement (PROTOCOL.md "Heartbeat"): each run's wall time is the
inference lane's, split over the batch's frames; its CPU time is what preprocessing (in the capture
or prepare thread), output decoding and, on the CPU provider, the run on each of its threads took.
Both are smoothed per loaded model (:class:`RunCost`) and read by :meth:`Pipeline.variant_costs`,
a few clock reads and additions per run and one lock taken after it, never across it.

Hang detection is handed to :class:`~edge_agent.vision.inference_watchdog.InferenceWatchdog`, which owns
the inference thread: the pipeline tells it when each run starts and ends, and it abandons a run that
hangs and starts a fresh thread (with a fresh backend) within the bounds of a ``RestartLimiter``.

Cameras come and go while the pipeline runs (pool cameras, :meth:`Pipeline.add_camera` and
:meth:`Pipeline.remove_camera`): ``cameras`` and the per-camera maps are replaced whole under the lock,
never changed in place, so a thread that took one of them iterates a consistent copy; the cameras that
stay are neither reopened nor paused.

Two backend errors are not ordinary run errors. A :class:`~edge_agent.inference.backend.CudaFatalError` from
``run()``, from the backend factory or from the warm-up is never retried or reloaded: it goes to
``watchdog.fatal`` (the agent publishes a final event, sets the stop event and exits with
``exc.exit_code``). A :class:`~edge_agent.inference.backend.ProviderFallback` from ``run()`` loses that batch
only: it goes to :attr:`Pipeline.on_provider_fallback` (an event) and the next batch runs on the
provider the backend moved to; it is neither a hang nor a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edge_agent.core.queues import DropOldestQueue, HandoffQueue
from edge_agent.core.restart_policy import RestartLimiter
from edge_agent.inference.backend import (
    BackendFactory,
    CudaFatalError,
    InferenceBackend,
    ProviderFallback,
    host_threads,
)
from edge_agent.vision.capture import CameraWorker, Frame, smoothed
from edge_agent.vision.inference_watchdog import FatalCallback, InferenceWatchdog, WatchdogCallback
from edge_agent.vision.motion import MotionGate
from edge_agent.vision.tracking import CameraTracking, Track, TrackerFactory, TrackEventFn
from edge_agent.vision.zones import ZoneCounter, ZoneEventFn
from fleet_protocol.messages import (
    Box,
    CameraState,
    CameraStats,
    CountLine,
    Detection,
    EventKind,
    FrameDetections,
    InputSpec,
    LineCrossing,
    ModelManifest,
    MotionSettings,
    TrackSighting,
    Zone,
    ZoneTransit,
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

# (the model whose run lost a batch, the fallback with the previous and new provider); called on the
# inference thread.
FallbackCallback = Callable[["LoadedModel", ProviderFallback], None]

# Results between the inference thread and the publisher (default bound of ``Pipeline.out``).
OUT_QUEUE_SIZE = 256


class ModelLoadError(Exception):
    """A model could not be loaded or failed its warm-up; the message says why."""


@dataclass(eq=False)
class RunCost:
    """What one loaded model's production runs cost per frame, smoothed (``smoothed``: a mean of the
    first runs, then an EWMA with ``COST_EWMA_ALPHA`` per run). Changed under the pipeline's lock,
    once per run; the warm-up is not in it."""

    runs: int = 0
    frames: int = 0
    infer_ms: float = 0.0  # inference-lane wall time of a run / its frames
    cpu_ms: float = 0.0  # preprocessing + output decoding + CPU-provider inference, / frames

    def add(self, frames: int, run_ms: float, cpu_ms: float) -> None:
        self.runs += 1
        self.frames += frames
        self.infer_ms = smoothed(self.infer_ms, run_ms / frames, self.runs)
        self.cpu_ms = smoothed(self.cpu_ms, cpu_ms / frames, self.runs)


@dataclass(frozen=True, slots=True)
class VariantFigures:
    """A variant's measured cost as the heartbeat reports it, with ``lane_ms``, the inference-lane
    time it has taken in all (cumulative, so that a reader takes its share of an interval), and
    ``lanes``, how many runs of it can be under way at once: the inference workers serving its
    cameras where its backend takes concurrent runs, else one."""

    variant: str
    infer_ms: float
    cpu_ms: float
    frames: int
    lane_ms: float
    lanes: int = 1


@dataclass(eq=False)
class LoadedModel:
    """A model ready to serve: backend + manifest + its preprocessor. Shared by cameras on the same sha."""

    manifest: ModelManifest
    backend: InferenceBackend  # replaced by the watchdog when a run on it hung
    preprocessor: PreprocessorLike
    closed: bool = False
    path: Path | None = None  # the file it was loaded from: the watchdog makes a fresh backend of it
    cost: RunCost = field(default_factory=RunCost)  # of this load: a swap measures the new one afresh
    # One run at a time on a backend that cannot take concurrent runs (several inference workers),
    # per backend: a fresh one after a hang is not blocked by the lock a stuck run still holds.
    _run_lock: tuple[object, threading.Lock] | None = field(default=None, repr=False)

    def run_guard(self) -> AbstractContextManager[Any]:
        backend = self.backend
        if getattr(backend, "concurrent_runs", False):
            return nullcontext()
        held = self._run_lock
        if held is None or held[0] is not backend:
            held = self._run_lock = (backend, threading.Lock())
        return held[1]

    @property
    def key(self) -> str:
        return f"{self.manifest.name}:{self.manifest.version}"

    @property
    def sha256(self) -> str:
        return self.manifest.sha256

    @property
    def variant(self) -> str:
        """The key the controller places cameras by: ``<model>/<version>``."""
        return f"{self.manifest.name}/{self.manifest.version}"


@dataclass(frozen=True)
class CameraParams:
    """What can change without a reload.

    A detection is kept when its label passes ``labels`` (None: every label), its score reaches its
    label's entry of ``label_thresholds`` (else ``threshold``), and its box covers at least
    ``min_box_area`` of the frame (a fraction, so one setting fits cameras of any resolution)."""

    threshold: float
    max_fps: float | None = None
    labels: frozenset[str] | None = None
    label_thresholds: Mapping[str, float] = field(default_factory=dict)
    min_box_area: float = 0.0
    # Counted after tracking (edge_agent/vision/zones.py); none: no counter.
    zones: tuple[Zone, ...] = ()
    lines: tuple[CountLine, ...] = ()

    @property
    def floor(self) -> float:
        """The lowest score any label may be kept at: what the decoder must let through."""
        return min([self.threshold, *self.label_thresholds.values()])

    def keeps(self, det: Detection, frame_area: float) -> bool:
        if self.labels is not None and det.label not in self.labels:
            return False
        if det.score < self.label_thresholds.get(det.label, self.threshold):
            return False
        if self.min_box_area > 0.0:
            box = det.box
            return (box.x1 - box.x0) * (box.y1 - box.y0) >= self.min_box_area * frame_area
        return True


@dataclass(eq=False)
class _Prepared:
    """One batch ready for the model: frames of cameras sharing ``model``, preprocessed."""

    model: LoadedModel
    items: list[tuple[Frame, CameraParams]]
    batch: np.ndarray
    metas: list[Any]
    cpu_ms: float = 0.0  # preprocessing the batch took, in whichever threads did it


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
    motion_skipped: int = 0  # frames the motion gate kept from the detector
    # Capture clocks (Frame.clock) of the camera's last frame sent to the detector and of the last one
    # tracked: a skipped frame coasts the tracks only while none is in flight, since the tracker
    # refuses an update older than a coast it was given (and that update's detections would be lost).
    sent_at: float = 0.0
    tracked_at: float = 0.0
    confirming: bool = False  # its last inferred frame had detections of unconfirmed tracks
    window: _ModelWindow = field(default_factory=_ModelWindow)
    last_inferred: float = 0.0  # the FPS cap's clock: kept across a swap, the cap is the camera's
    last: FrameDetections | None = None
    inferred_at: float | None = None  # time.time() when its last frame came out of inference


class Pipeline:
    """Owns the camera workers, the model slots, and the prepare and inference stages (whose thread
    :attr:`watchdog` starts, and replaces when a run hangs)."""

    def __init__(
        self,
        cameras: Sequence[CameraWorker],
        *,
        stop: threading.Event,
        wake: threading.Event,
        backend_factory: BackendFactory,
        max_batch: int = 4,
        out: DropOldestQueue[FrameDetections] | None = None,
        preprocessor_factory: PreprocessorFactory | None = None,
        decode_fn: DecodeFn | None = None,
        hang_timeout_s: float | None = None,
        restart_limiter: RestartLimiter | None = None,
        on_watchdog: WatchdogCallback | None = None,
        on_fatal: FatalCallback | None = None,
        on_provider_fallback: FallbackCallback | None = None,
        workers: int = 1,
        tracker_factory: TrackerFactory | None = None,
        track_events_per_minute: int = 600,
    ) -> None:
        """``workers``: inference threads; each serves a fixed share of the cameras (camera i: worker
        i mod workers; a camera added later: the worker with the fewest), so one camera's frames stay
        in order. ``out`` None: a fresh queue of OUT_QUEUE_SIZE (the agent passes its own, built before the
        publisher that drains it). ``hang_timeout_s`` None: no watchdog. ``restart_limiter`` default: 3
        restarts in 10 min, then retries 10 s doubling to 10 min. ``on_fatal`` (also settable later as
        ``watchdog.on_fatal``) gets a CudaFatalError once; ``on_provider_fallback`` a ProviderFallback.
        ``tracker_factory`` makes each camera's tracker (None: no tracking, no track ids); its events go
        to :attr:`on_track_event`, at most ``track_events_per_minute`` a camera."""
        if preprocessor_factory is None:
            from fleet_protocol.vision.preprocess import Preprocessor

            preprocessor_factory = Preprocessor
        if decode_fn is None:
            from fleet_protocol.vision.decoders import decode

            decode_fn = decode
        self._preprocessor_factory = preprocessor_factory
        self._decode = decode_fn
        self._backend_factory = backend_factory
        # Replaced whole (under _lock) when a camera is added or removed, never changed in place: other
        # threads (prepare, stats, heartbeats, commands) read it without the lock.
        self.cameras: dict[str, CameraWorker] = {c.id: c for c in cameras}
        self._stop = stop
        self._wake = wake
        self.max_batch = max_batch
        # Inference -> publisher. Drop policy: oldest (see DropOldestQueue).
        self.out: DropOldestQueue[FrameDetections] = (
            out if out is not None else DropOldestQueue(OUT_QUEUE_SIZE)
        )
        self._lock = threading.Lock()
        self._slots: dict[str, tuple[LoadedModel, CameraParams]] = {}
        self._retired: list[LoadedModel] = []
        self._stats = {c: _CamStats() for c in self.cameras}  # replaced whole, like ``cameras``
        self._started = False
        # Inference-lane ms run per variant, cumulative; only variants that run now are kept.
        self._lane_ms: dict[str, float] = {}
        self._error_log_at = 0.0
        self.on_provider_fallback = on_provider_fallback
        # Tracking (edge_agent/vision/tracking.py): a camera's tracker lives while it runs one model
        # from one source; the map is replaced whole, like ``cameras``.
        self._tracker_factory = tracker_factory
        self._track_events_per_minute = track_events_per_minute
        self._tracking: dict[str, CameraTracking] = {}
        self.on_track_event: TrackEventFn | None = None
        # The prepare thread's look at sources that stopped delivering (_end_stopped_tracks): when, and
        # the cameras that were not up then.
        self._stopped_check_at = 0.0
        self._not_up: set[str] = set()
        # Motion gates (edge_agent/vision/motion.py): per camera, the desired state's settings over
        # its configuration's (replaced whole, like ``cameras``); the gates themselves belong to the
        # prepare thread alone.
        self._motion: dict[str, MotionSettings] = {}
        self._gates: dict[str, MotionGate] = {}
        # Zones and lines (edge_agent/vision/zones.py), per camera with any; replaced whole too.
        self._zone_counters: dict[str, ZoneCounter] = {}
        self.on_zone_event: ZoneEventFn | None = None
        # Prepare -> inference, one queue per worker. Drop policy: none; the prepare thread waits (see
        # HandoffQueue), and prepares only for workers with room, so one busy worker never holds
        # frames back from an idle one.
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._prepared: list[HandoffQueue[_Prepared]] = [HandoffQueue(1) for _ in range(workers)]
        self._room = threading.Event()  # a worker took a prepared batch
        self._worker_of = {c.id: i % workers for i, c in enumerate(cameras)}  # replaced whole too
        self._prep_thread = threading.Thread(target=self._prepare_loop, name="prepare", daemon=True)
        # Runs the inference thread (run_inference) and replaces it when a run hangs.
        self.watchdog: InferenceWatchdog[LoadedModel] = InferenceWatchdog(
            self,
            stop=stop,
            hang_timeout_s=hang_timeout_s,
            limiter=restart_limiter,
            on_note=on_watchdog,
            on_fatal=on_fatal,
            workers=workers,
        )

    # ------------------------------------------------------------------ models

    def load(self, path: Path, manifest: ModelManifest) -> LoadedModel:
        """Load ``path`` and run one warm-up inference through preprocess, backend and decoder.

        A CudaFatalError is reported to the watchdog (which stops the agent) and re-raised as is,
        never wrapped in ModelLoadError."""
        try:
            backend = self._backend_factory(path, manifest)
        except CudaFatalError as exc:
            self.watchdog.fatal(exc, "load")
            raise
        except Exception as exc:
            raise ModelLoadError(f"load failed: {exc}") from exc
        try:
            pre = self._preprocessor_factory(manifest.input)
            warm = np.zeros((manifest.input.height, manifest.input.width, 3), dtype=np.uint8)
            tensor, meta = pre(warm)
            outputs = backend.run(tensor[None])
            self._decode(manifest, outputs, [meta], manifest.default_threshold)
        except CudaFatalError as exc:
            # Not closed: freeing a session in a dead CUDA context can crash; the process exits anyway.
            self.watchdog.fatal(exc, "warm-up")
            raise
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
        if old is None or old[0] is not model:
            # Another model's boxes are no continuation of the old one's tracks.
            self._restart_tracking(camera, keep=True)
        self._early_preprocessing(camera)
        log.info("camera %s now runs %s (threshold %.2f)", camera, model.key, params.threshold)

    def _early_preprocessing(self, camera: str) -> None:
        """Have ``camera``'s capture thread preprocess its frames for the model it runs, except behind a
        motion gate: the gate keeps most frames from the detector, and each of those preprocessed in
        the capture thread would be work thrown away; the prepare thread preprocesses the ones it sends."""
        cam = self.cameras.get(camera)
        if cam is None:
            return
        with self._lock:
            slot = self._slots.get(camera)
            gated = self._motion.get(camera, cam.config.motion).enabled
        if slot is None or gated:
            cam.use_preprocessor(None)
        else:
            cam.use_preprocessor(slot[0].manifest.input, self._preprocessor_factory)

    def params_of(self, camera: str) -> CameraParams | None:
        """The settings ``camera``'s model applies now (None: it runs no model)."""
        with self._lock:
            slot = self._slots.get(camera)
            return slot[1] if slot else None

    def set_params(self, camera: str, params: CameraParams) -> None:
        with self._lock:
            slot = self._slots.get(camera)
            if slot is not None:
                self._slots[camera] = (slot[0], params)

    def clear(self, camera: str) -> None:
        cam = self.cameras.get(camera)
        if cam is not None:
            cam.use_preprocessor(None)
        with self._lock:
            old = self._slots.pop(camera, None)
            self._retire_if_unused(old[0] if old else None)
            if camera in self._stats:
                # A camera that runs no model reports no inference latency.
                self._stats[camera].window = _ModelWindow()
        self._restart_tracking(camera, keep=False)
        self._drop_zone_counter(camera, time.time())

    def _retire_if_unused(self, model: LoadedModel | None) -> None:
        if model is not None and all(m is not model for m, _ in self._slots.values()):
            self._retired.append(model)

    # ------------------------------------------------------------------ tracking

    def tracks(self, camera: str) -> list[Track]:
        """The confirmed tracks of ``camera`` alive now (none without tracking)."""
        with self._lock:
            tracks = self._tracking.get(camera)
        return tracks.tracks() if tracks is not None else []

    def set_motion(self, camera: str, settings: MotionSettings | None) -> None:
        """``camera``'s motion gate from now on (None: its configuration's); new settings start a new
        gate, whose first frame is inferred."""
        with self._lock:
            motion = {c: s for c, s in self._motion.items() if c != camera}
            if settings is not None:
                motion[camera] = settings
            self._motion = motion
        self._early_preprocessing(camera)

    def motion_of(self, camera: str) -> MotionSettings | None:
        """The motion settings ``camera`` runs with (None: no such camera)."""
        cam = self.cameras.get(camera)
        return self._motion.get(camera, cam.config.motion) if cam is not None else None

    def _gate_passes(self, cam: CameraWorker, frame: Frame, st: _CamStats) -> bool:
        """Whether ``cam``'s motion gate sends ``frame`` to the detector; a frame kept back is counted
        and coasts the camera's tracks. Prepare thread only."""
        settings = self._motion.get(cam.id, cam.config.motion)
        if not settings.enabled:
            self._gates.pop(cam.id, None)
            return True
        gate = self._gates.get(cam.id)
        if gate is None or gate.settings != settings:
            gate = self._gates[cam.id] = MotionGate(settings)
        try:
            # Held for the next frame only once the last one sent is tracked, so as not to send more.
            idle = st.tracked_at >= st.sent_at
            infer = gate.check(frame.image, frame.captured_at, hold=st.confirming and idle).infer
        except Exception as exc:
            # A gate that cannot judge a frame must not cost its detections.
            self._log_error("motion gate of %s failed: %s", cam.id, exc)
            infer = True
        if infer:
            return True
        st.motion_skipped += 1
        if idle:
            self.coast(frame)
        return False

    def coast(self, frame: Frame) -> None:
        """``frame`` is not inferred: its camera's tracks move on by prediction alone (unless they
        follow another run of its source, whose scene is no continuation of this one)."""
        with self._lock:
            tracks = self._tracking.get(frame.camera)
        if tracks is not None and tracks.run == frame.run:
            tracks.coast(frame.clock)

    def _restart_tracking(
        self, camera: str, *, keep: bool, run: int | None = None, replacing: CameraTracking | None = None
    ) -> bool:
        """End ``camera``'s tracks (events sent) and, with ``keep``, give it a fresh tracker for the
        frames of source run ``run`` (None: of the first frame it gets). With ``replacing``, only if
        those are still the camera's tracks (not replaced or cleared meanwhile): whether it did."""
        fresh = None
        if keep and self._tracker_factory is not None:
            fresh = CameraTracking(
                camera,
                self._tracker_factory(lambda: self._nominal_fps(camera)),
                self._send_track_event,
                events_per_minute=self._track_events_per_minute,
                run=run,
            )
        with self._lock:
            old = self._tracking.get(camera)
            if replacing is not None and old is not replacing:
                return False
            tracking = {c: t for c, t in self._tracking.items() if c != camera}
            if fresh is not None:
                tracking[camera] = fresh
            self._tracking = tracking
        if old is not None:
            old.close()
        return True

    def _nominal_fps(self, camera: str) -> float | None:
        """The frames a second of its own clock that ``camera``'s tracker is fed when the pipeline
        keeps up: its source's rate under the caps that skip frames (None: not known yet)."""
        cam = self.cameras.get(camera)
        params = self.params_of(camera)
        if cam is None:
            return None
        # A file is slowed down to its camera's max_fps (every frame is read, its clock is the file's);
        # a live camera skips the frames over it.
        caps = [params.max_fps if params else None, None if cam.config.is_file else cam.config.max_fps]
        rates = [r for r in (cam.source_fps, *caps) if r]
        return min(rates) if rates else None

    def _tracks_for(self, frame: Frame, tracks: CameraTracking) -> CameraTracking | None:
        """The tracks that ``frame`` continues: ``tracks``, or fresh ones when its source started a
        new run (the file looped, the stream reconnected: whatever moved in the jump did not walk
        across a line); None for a frame of a run already left behind."""
        if tracks.run is None:
            # The first frame since the tracker was made (one inference thread serves a camera).
            tracks.run = frame.run
        if frame.run == tracks.run:
            return tracks
        if frame.run < tracks.run:
            return None
        log.info("camera %s: its source started afresh (run %d); its tracks end", frame.camera, frame.run)
        self._reset_tracks(tracks, frame.run, frame.captured_at)
        with self._lock:
            return self._tracking.get(frame.camera)

    def _reset_tracks(self, tracks: CameraTracking, run: int | None, at: float) -> None:
        """End ``tracks`` (unless the camera's model changed or stopped meanwhile) and leave the zones
        (events sent), the camera's next tracks those of ``run``."""
        if not self._restart_tracking(tracks.camera, keep=True, run=run, replacing=tracks):
            return
        counter = self._zone_counters.get(tracks.camera)
        if counter is not None:
            counter.reset(at)

    def _end_stopped_tracks(self) -> None:
        """End the tracks of cameras whose source stopped delivering (down, or a file that ended): their
        clock stands still, so no frame would ever age their tracks out, and their zones would stay
        occupied. About once a second, a camera found not up at two looks in a row with no frame left
        in its slot: the frames it delivered before have been through the pipeline by then."""
        now = time.monotonic()
        if now - self._stopped_check_at < 1.0:
            return
        self._stopped_check_at = now
        with self._lock:
            tracking = self._tracking
            cameras = self.cameras
        not_up = {c for c, cam in cameras.items() if cam.state != CameraState.UP and not cam.slot.pending}
        for camera in not_up & self._not_up:
            tracks = tracking.get(camera)
            if tracks is not None and tracks.tracks():
                log.info("camera %s is %s; its tracks end", camera, cameras[camera].state.value)
                self._reset_tracks(tracks, tracks.run, time.time())
        self._not_up = not_up

    def _count_zones(
        self, camera: str, params: CameraParams, tracks: CameraTracking, at: float, meta: _Meta
    ) -> None:
        """Feed ``camera``'s zone counter the tracks after the frame captured at ``at``."""
        counter = self._zone_counters.get(camera)
        if not params.zones and not params.lines:
            if counter is not None:
                self._drop_zone_counter(camera, at)
            return
        if counter is None:
            counter = ZoneCounter(
                camera, self._send_zone_event, events_per_minute=self._track_events_per_minute
            )
            with self._lock:
                self._zone_counters = {**self._zone_counters, camera: counter}
        counter.configure(params.zones, params.lines)
        counter.observe(tracks.tracks(), at, float(meta.width), float(meta.height))

    def _drop_zone_counter(self, camera: str, at: float) -> None:
        with self._lock:
            counter = self._zone_counters.get(camera)
            self._zone_counters = {c: z for c, z in self._zone_counters.items() if c != camera}
        if counter is not None:
            counter.reset(at)

    def _send_zone_event(self, kind: EventKind, camera: str, data: ZoneTransit | LineCrossing) -> None:
        callback = self.on_zone_event
        if callback is not None:
            callback(kind, camera, data)

    def _send_track_event(self, kind: EventKind, camera: str, sighting: TrackSighting) -> None:
        callback = self.on_track_event
        if callback is not None:
            callback(kind, camera, sighting)

    # ------------------------------------------------------------------ cameras at run time

    @property
    def wake(self) -> threading.Event:
        """Set by the cameras' slots when a frame arrives: a worker made for :meth:`add_camera` takes it."""
        return self._wake

    def add_camera(self, worker: CameraWorker) -> None:
        """Run ``worker``'s camera beside the others from now on (its capture starts at once if the
        pipeline has started), its frames inferred by the inference worker with the fewest cameras. It
        runs no model until :meth:`activate`. ValueError if a camera of that id is already here."""
        with self._lock:
            if worker.id in self.cameras:
                raise ValueError(f"camera {worker.id} is already in the pipeline")
            load = [0] * len(self._prepared)
            for w in self._worker_of.values():
                load[w] += 1
            index = load.index(min(load))
            self._worker_of = {**self._worker_of, worker.id: index}
            self._stats = {**self._stats, worker.id: _CamStats()}
            self.cameras = {**self.cameras, worker.id: worker}
            started = self._started
        if started:
            worker.start()
        log.info("camera %s added (inference worker %d)", worker.id, index)

    def remove_camera(self, camera: str, timeout: float) -> bool:
        """Stop ``camera`` alone and forget it: its model cleared (closed when no other camera runs it),
        its capture thread stopped and joined within ``timeout`` s, its stats dropped. The other
        cameras run on untouched. False when the thread did not end in time (it ends by itself once
        its source's read returns; the camera is gone from the pipeline either way)."""
        self.clear(camera)
        with self._lock:
            worker = self.cameras.get(camera)
            if worker is None:
                return True
            self.cameras = {c: w for c, w in self.cameras.items() if c != camera}
            self._stats = {c: st for c, st in self._stats.items() if c != camera}
            self._worker_of = {c: i for c, i in self._worker_of.items() if c != camera}
        worker.stop()
        if not worker.join(timeout):
            log.warning(
                "camera %s removed, but its capture thread did not stop within %.1f s", camera, timeout
            )
            return False
        log.info("camera %s removed", camera)
        return True

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        with self._lock:
            self._started = True
            cameras = list(self.cameras.values())
        for cam in cameras:
            cam.start()
        self._prep_thread.start()
        self.watchdog.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for cam in self.cameras.values():
            if not cam.join(max(0.1, deadline - time.monotonic())):
                log.warning("capture thread of %s did not stop in time", cam.id)
        self._prep_thread.join(max(0.1, deadline - time.monotonic()))
        self.watchdog.join(max(0.1, deadline - time.monotonic()))
        threads = self.watchdog.inference_threads
        for thread in threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads) or self._prep_thread.is_alive():
            log.warning("prepare or inference thread did not stop in time")
            return
        for q in self._prepared:
            q.drain()
        with self._lock:
            models = {id(m): m for m, _ in self._slots.values()}
            self._slots.clear()
            models.update({id(m): m for m in self._retired})
            self._retired.clear()
        for m in models.values():
            self._close_backend(m.backend)
        self.watchdog.release_returned()

    def restart(self) -> None:
        """Reopen every source and reset the counters (command restart_pipeline); a pipeline the
        watchdog marked failed is tried again at once."""
        for cam in self.cameras.values():
            cam.reopen()
        for camera in list(self._tracking):
            self._restart_tracking(camera, keep=True)
        with self._lock:
            # Fresh counters, and fresh windows still bound to the model each camera runs.
            running = {c: m for c, (m, _) in self._slots.items()}
            self._stats = {c: _CamStats(window=_ModelWindow(model=running.get(c))) for c in self.cameras}
        self.watchdog.request_retry()

    def watchdog_status(self) -> dict[str, Any]:
        return self.watchdog.status()

    # ------------------------------------------------------------------ stats

    def stats(self) -> list[CameraStats]:
        """Per camera: capture counters, and the rate and latency of the model it runs now (only
        that model's results since its activation: FPS reads 0 until it has done two frames)."""
        out = []
        with self._lock:
            cameras = self.cameras
            slots = dict(self._slots)
            # Copied under the lock: the inference thread appends to these deques.
            windows = {
                c: (list(st.window.inference_ms), list(st.window.times)) for c, st in self._stats.items()
            }
            inferred_at = {c: st.inferred_at for c, st in self._stats.items()}
            skipped = {c: st.motion_skipped for c, st in self._stats.items()}
            motion = self._motion
            counters = self._zone_counters
        for cam_id, cam in cameras.items():
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
                    frames_skipped=skipped[cam_id] if motion.get(cam_id, cam.config.motion).enabled else None,
                    inference_ms=median,
                    inference_p99_ms=p99,
                    model=slot[0].key if slot else None,
                    decode_ms=cam.decode_ms,
                    source_fps=cam.source_fps,
                    last_inferred_at=inferred_at.get(cam_id),
                    occupancy=counters[cam_id].occupancy() if cam_id in counters else None,
                )
            )
        return out

    def variant_costs(self) -> list[VariantFigures]:
        """The measured cost of each variant that runs now (``frames`` 0: none measured yet). Where
        two loads of one variant serve (a swap under way), the one with more frames speaks for it.
        A variant that no longer runs loses its lane time here, so one that comes back counts from 0."""
        with self._lock:
            models = {id(m): m for m, _ in self._slots.values()}.values()
            running = {m.variant for m in models}
            for gone in self._lane_ms.keys() - running:
                del self._lane_ms[gone]
            best: dict[str, RunCost] = {}
            for m in models:
                cost, known = m.cost, best.get(m.variant)
                if known is None or cost.frames > known.frames:
                    best[m.variant] = RunCost(cost.runs, cost.frames, cost.infer_ms, cost.cpu_ms)
            workers: dict[str, set[int]] = {}
            concurrent: set[str] = set()
            for cam_id, (m, _) in self._slots.items():
                workers.setdefault(m.variant, set()).add(self._worker_of.get(cam_id, 0))
                if getattr(m.backend, "concurrent_runs", False):
                    concurrent.add(m.variant)
            lane_ms = dict(self._lane_ms)
        return [
            VariantFigures(
                v,
                c.infer_ms,
                c.cpu_ms,
                c.frames,
                lane_ms.get(v, 0.0),
                len(workers[v]) if v in concurrent else 1,
            )
            for v, c in sorted(best.items())
        ]

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
            ready = {w for w, q in enumerate(self._prepared) if len(q) < q.maxsize}
            if not ready:
                # Every worker has a batch waiting: frames keep refreshing in the camera slots.
                self._room.wait(0.1)
                self._room.clear()
                continue
            self._wake.wait(0.1)
            self._wake.clear()
            self._end_stopped_tracks()
            try:
                for worker, prepared in self._prepare_round(ready):
                    if not self._prepared[worker].put(prepared, self._stop):
                        return
            except Exception:
                # One bad round must not stop analytics on every camera.
                log.exception("prepare round failed")

    def _prepare_round(self, workers: set[int]) -> list[tuple[int, _Prepared]]:
        """Batches for the cameras of ``workers``, as (worker, batch)."""
        with self._lock:
            slots = dict(self._slots)
            stats = self._stats
            cameras = self.cameras
            worker_of = self._worker_of
        now = time.monotonic()
        groups: dict[tuple[int, int], list[tuple[Frame, CameraParams]]] = {}
        models: dict[tuple[int, int], LoadedModel] = {}
        for cam_id, (model, params) in slots.items():
            cam = cameras.get(cam_id)
            worker = worker_of.get(cam_id, 0)
            if cam is None or worker not in workers:
                continue
            frame = cam.slot.take()
            if frame is None:
                continue
            st = stats[cam_id]
            if params.max_fps and now - st.last_inferred < 1.0 / params.max_fps:
                st.skipped += 1  # the FPS cap asked for it; not a loss
                continue
            if not self._gate_passes(cam, frame, st):
                continue
            st.sent_at = frame.clock
            st.last_inferred = now
            groups.setdefault((worker, id(model)), []).append((frame, params))
            models[(worker, id(model))] = model
        out: list[tuple[int, _Prepared]] = []
        for key, items in groups.items():
            model = models[key]
            step = self.max_batch if model.backend.dynamic_batch else 1
            for i in range(0, len(items), step):
                chunk = items[i : i + step]
                images = [f.image for f, _ in chunk]
                cpu0 = time.thread_time()
                early = _prepared_for(model.manifest.input, [f for f, _ in chunk])
                try:
                    if early is not None:
                        batch, metas, cpu_ms = early
                    elif len(images) == 1:
                        tensor, meta = model.preprocessor(images[0])
                        batch, metas, cpu_ms = tensor[None], [meta], 0.0
                    else:
                        batch, metas = model.preprocessor.batch(images)
                        cpu_ms = 0.0
                except Exception as exc:
                    for f, _ in chunk:
                        stats[f.camera].errors += 1
                    self._log_error("preprocessing for %s failed: %s", model.key, exc)
                    continue
                cpu_ms += (time.thread_time() - cpu0) * 1000.0
                out.append((key[0], _Prepared(model, chunk, batch, metas, cpu_ms)))
        return out

    def _live(self, gen: int) -> bool:
        return self.watchdog.is_current(gen) and not self._stop.is_set()

    def run_inference(self, gen: int, worker: int = 0) -> None:
        """Inference thread ``worker`` of generation ``gen`` (started and replaced by the watchdog)."""
        queue = self._prepared[worker]
        while self._live(gen):
            prepared = queue.get(0.1)
            if prepared is not None:
                self._room.set()
                with self._lock:
                    stats = self._stats
                if prepared.model.closed:
                    # Prepared for a model replaced and closed meanwhile (a rare race with the swap).
                    for f, _ in prepared.items:
                        if f.camera in stats:
                            stats[f.camera].skipped += 1
                else:
                    try:
                        self._infer(prepared, stats, gen, worker)
                    except CudaFatalError as exc:
                        # Even from an abandoned run: the context of the whole process is dead.
                        self.watchdog.fatal(exc, "run")
                        return
                    except Exception:
                        log.exception("inference round failed")
            if not self.watchdog.is_current(gen):
                log.warning("abandoned inference thread %s returned; exiting", gen)
                return
            self._close_retired()
        if self.watchdog.is_current(gen):
            self._close_retired()

    def _close_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for m in retired:
            m.closed = True
            self._close_backend(m.backend)
            log.info("closed %s", m.key)

    def _close_backend(self, backend: InferenceBackend) -> None:
        if self.watchdog.stuck_in(backend):
            return  # a stuck run may still be inside it
        try:
            backend.close()
        except Exception:
            log.exception("closing a backend failed")

    def _infer(self, prepared: _Prepared, stats: dict[str, _CamStats], gen: int, worker: int = 0) -> None:
        model, items, metas = prepared.model, prepared.items, prepared.metas
        error: Exception | None = None
        # The guard is taken before the run is declared started: waiting for another worker's run on
        # a backend that takes one at a time is not this run hanging.
        with model.run_guard():
            if not self.watchdog.run_started(gen, model, tuple(f.camera for f, _ in items), worker):
                return
            backend = model.backend
            t0 = time.perf_counter()
            cpu0 = time.thread_time()
            try:
                outputs = backend.run(prepared.batch)
                t1 = time.perf_counter()
                cpu1 = time.thread_time()
                threshold = min(p.floor for _, p in items)
                decoded = self._decode(model.manifest, outputs, metas, threshold)
                cpu2 = time.thread_time()
            except CudaFatalError:
                self.watchdog.run_finished(gen, ok=False, worker=worker)
                raise  # to run_inference, which stops: no retry, no reload
            except Exception as exc:
                error = exc
        if not self.watchdog.run_finished(gen, ok=error is None, worker=worker):
            return  # the watchdog gave up on this run and restarted; whatever it returned is stale
        if error is not None:
            for f, _ in items:
                if f.camera in stats:
                    stats[f.camera].errors += 1
            if isinstance(error, ProviderFallback):
                # The batch is lost, the backend goes on (on error.provider): report, run the next one.
                log.warning("inference on %s: %s", model.key, error)
                self._provider_fallback(model, error)
            else:
                self._log_error("inference on %s failed: %s", model.key, error)
            return
        ms = (time.perf_counter() - t0) * 1000.0
        done = time.monotonic()
        done_at = time.time()
        run_ms = (t1 - t0) * 1000.0
        # On the CPU provider the run keeps its intra-op threads busy, not only this one; elsewhere the
        # run's CPU cost is this thread's (launching, copying, waiting on the device).
        threads = host_threads(backend)
        run_cpu_ms = run_ms * threads if threads else (cpu1 - cpu0) * 1000.0
        cpu_ms = prepared.cpu_ms + run_cpu_ms + (cpu2 - cpu1) * 1000.0
        variant = model.variant
        with self._lock:
            model.cost.add(len(items), run_ms, cpu_ms)
            self._lane_ms[variant] = self._lane_ms.get(variant, 0.0) + run_ms
        labels = model.manifest.labels
        with self._lock:
            tracking = self._tracking
        for (frame, params), raws, meta in zip(items, decoded, metas, strict=True):
            area = float(meta.width) * float(meta.height)
            floor = params.floor
            dets = [
                d
                for d in (_detection(r, labels) for r in raws if r.score >= floor)
                if d is not None and params.keeps(d, area)
            ][:1000]
            tracks = tracking.get(frame.camera)
            if tracks is not None:
                tracks = self._tracks_for(frame, tracks)
            if tracks is not None:
                dets = tracks.update(dets, frame.captured_at, frame.clock)
                self._count_zones(frame.camera, params, tracks, frame.captured_at, meta)
            result = FrameDetections(
                camera=frame.camera,
                frame=frame.index,
                captured_at=frame.captured_at,
                width=int(meta.width),
                height=int(meta.height),
                model=model.key,
                inference_ms=round(ms, 3),
                detections=dets,
            )
            st = stats.get(frame.camera)
            if st is None:
                continue  # the camera was removed while its frame was inferred
            with self._lock:
                st.inferred += 1
                st.tracked_at = frame.clock
                st.confirming = tracks is not None and any(d.track_id is None for d in dets)
                # A batch prepared for the old model that finishes after the swap is still published
                # (no gap in detections) but kept out of the new model's window.
                if st.window.model is model:
                    st.window.inference_ms.append(ms)
                    st.window.times.append(done)
                st.last = result
                st.inferred_at = done_at
            self.out.put(result)

    def _provider_fallback(self, model: LoadedModel, fallback: ProviderFallback) -> None:
        callback = self.on_provider_fallback
        if callback is None:
            return
        try:
            callback(model, fallback)
        except Exception:
            log.exception("provider-fallback callback failed")

    # ------------------------------------------------------------------ watchdog host

    def reload(self, model: LoadedModel) -> str | None:
        """A fresh backend for ``model`` (its old one is stuck in a hung run) if it still serves a
        camera; why not, or None."""
        with self._lock:
            serving = any(m is model for m, _ in self._slots.values())
        if not serving:
            return None
        if model.path is None:
            return f"no model file to reload {model.key} from"
        try:
            backend = self._backend_factory(model.path, model.manifest)
        except CudaFatalError:
            raise  # never a reload failure to retry: the watchdog stops the agent
        except Exception as exc:
            return f"reloading {model.key} failed: {exc}"
        with self._lock:
            model.backend = backend
        log.info("watchdog: %s reloaded on %s", model.key, backend.provider)
        return None

    def backends_in_use(self) -> list[InferenceBackend]:
        with self._lock:
            return [m.backend for m, _ in self._slots.values()]

    def drop_prepared(self) -> None:
        """What was prepared before a hang may be old by now: newer frames are waiting upstream."""
        dropped = [p for q in self._prepared for p in q.drain()]
        with self._lock:
            for p in dropped:
                for f, _ in p.items:
                    if f.camera in self._stats:
                        self._stats[f.camera].skipped += 1

    def count_errors(self, cameras: Sequence[str]) -> None:
        with self._lock:
            stats = self._stats
        for camera in cameras:
            if camera in stats:
                stats[camera].errors += 1

    def cameras_of(self, model: LoadedModel | None) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(c for c, (m, _) in self._slots.items() if m is model))

    # ------------------------------------------------------------------ helpers and accessors

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


def _prepared_for(spec: InputSpec, frames: Sequence[Frame]) -> tuple[np.ndarray, list[Any], float] | None:
    """The batch of ``frames`` from the inputs their capture threads made, and the CPU ms they took,
    if every one was made for ``spec`` (else None: a frame captured before a swap to a model with
    another input, or one whose preprocessing failed there, is preprocessed here)."""
    ready = [f.prepared for f in frames]
    if not all(p is not None and (p.spec is spec or p.spec == spec) for p in ready):
        return None
    tensors = [p.tensor for p in ready if p is not None]
    metas = [p.meta for p in ready if p is not None]
    cpu_ms = sum(p.cpu_ms for p in ready if p is not None)
    batch = tensors[0][None] if len(tensors) == 1 else np.stack(tensors)
    return batch, metas, cpu_ms


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
