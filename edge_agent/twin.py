"""The twin: the controller's desired state in, what the device actually runs out (reported state).

A desired state is the controller's whole word for this device (retained on the broker, signed). Only
a version newer than any seen is taken, and it is written to disk before it is applied, so an agent
restarted offline converges on its last desired state without the broker. Applying runs on the twin
thread, the only thread that loads models, one camera after another:

- each model reference is checked against the artifact key first, even for the model already running:
  nothing of a refused state is fetched, loaded or applied;
- a new threshold, FPS cap or label filter for the running model applies without a reload;
- otherwise the file comes from the store or over the link (verified), is loaded and warmed up while
  the old model keeps serving (a TensorRT engine build can take minutes; its steps are reported through
  :class:`EngineBuilds`), and only then swapped in. A failure keeps the old model and is reported.

The reported state names, per camera, the model and its state, and the desired version last applied.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent import __version__
from edge_agent.artifacts import ArtifactFetcher, FetchCancelled, FetchError, file_sha256
from edge_agent.backends import (
    AutoBackendFactory,
    BuildNote,
    CudaFatalError,
    InferenceBackend,
    LoadRequest,
)
from edge_agent.pipeline import CameraParams, LoadedModel, ModelLoadError, Pipeline
from edge_agent.publisher import Publisher, PublishFn
from edge_agent.queues import LatestSlot
from fleet_protocol.codec import ProtocolError, decode_as, encode
from fleet_protocol.messages import (
    ArtifactRef,
    CameraDesired,
    CameraReported,
    DesiredState,
    EventKind,
    Message,
    ModelManifest,
    ReportedState,
    Severity,
)
from fleet_protocol.signing import SignatureError, verify
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)

_CALIBRATION_WAIT_S = 30.0


@dataclass
class _BuildCtx:
    """The load in progress on the twin thread (the only thread that loads models)."""

    camera: str
    model: str
    sha256: str
    variant: str
    last_step: int = -1


class EngineBuilds:
    """The pipeline's backend factory when the agent chooses backends itself (AutoBackendFactory).

    The twin announces the load it is about to run; a backend made for that model gets the load's
    :class:`LoadRequest` (the variant, where build steps are reported, the camera's frames for INT8
    calibration, the stop event that abandons a build). A later load of the same model without an
    announcement, such as the watchdog reloading a hung model, repeats that request (G7: the same
    variant, so the same precision and the same engine cache key, which the cache holds since the
    first load), without calibration frames: a reload never calibrates in the watchdog's thread.
    A model never announced is a plain load.
    """

    # Requests remembered, newest last: far more than the models one device runs at once.
    REMEMBERED = 16

    def __init__(self, backends: AutoBackendFactory) -> None:
        self.backends = backends
        self._announced: tuple[str, LoadRequest] | None = None
        self._requests: dict[str, LoadRequest] = {}

    @contextmanager
    def announce(self, sha256: str, request: LoadRequest) -> Iterator[None]:
        self._announced = (sha256, request)
        try:
            yield
        finally:
            self._announced = None

    def __call__(self, path: Path, manifest: ModelManifest) -> InferenceBackend:
        announced = self._announced
        if announced is not None and announced[0] == manifest.sha256:
            self._requests.pop(manifest.sha256, None)
            self._requests[manifest.sha256] = announced[1]
            while len(self._requests) > self.REMEMBERED:
                del self._requests[next(iter(self._requests))]
            return self.backends.make(path, manifest, announced[1])
        earlier = self._requests.get(manifest.sha256)
        if earlier is None:
            return self.backends(path, manifest)
        return self.backends.make(path, manifest, replace(earlier, calibration_frames=None))


class Twin:
    """Takes desired states (link thread), applies them (twin thread, :meth:`run`), reports."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        publisher: Publisher,
        fetcher: ArtifactFetcher,
        publish: PublishFn,
        data_dir: Path,
        artifact_key: Ed25519PublicKey | None,
        require_signed: bool,
        stop: threading.Event,
        builds: EngineBuilds | None = None,
    ) -> None:
        """``builds`` None: the pipeline's backends come from elsewhere and report no build steps."""
        self.pipeline = pipeline
        self.publisher = publisher
        self.fetcher = fetcher
        self._publish = publish
        self._path = data_dir / "desired.json"
        self.artifact_key = artifact_key
        self._require_signed = require_signed
        self._stop = stop
        self._builds = builds
        # ``_received_version`` guards ordering; ``applied_version`` is what we report.
        self._lock = threading.Lock()
        self.applied_version = -1
        self._received_version = -1
        self._reported: dict[str, CameraReported] = {c: CameraReported() for c in pipeline.cameras}
        self._slot: LatestSlot[DesiredState] = LatestSlot()
        self._wake = threading.Event()

    # ------------------------------------------------------------------ desired state in

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, DesiredState):
            self.accept(msg, persist=True)

    def accept(self, desired: DesiredState, *, persist: bool) -> bool:
        """Queue ``desired`` for the twin thread if it is newer than any seen (a newer one replaces a
        pending one); ``persist``: write it to disk first."""
        with self._lock:
            newest = max(self.applied_version, self._received_version)
            if desired.version <= newest:
                log.debug("ignoring desired version %s (have %s)", desired.version, newest)
                return False
            self._received_version = desired.version
        if persist:
            self._save(desired)
        self._slot.put(desired)
        self._wake.set()
        return True

    def _save(self, desired: DesiredState) -> None:
        # Written before it is applied: an agent restarted offline runs its last desired state.
        tmp = self._path.with_suffix(".json.tmp")
        with tmp.open("wb") as f:
            f.write(encode(desired))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)

    def load_persisted(self) -> DesiredState | None:
        path = self._path
        if not path.exists():
            return None
        try:
            return decode_as(DesiredState, path.read_bytes())
        except (OSError, ProtocolError) as exc:
            log.warning("ignoring unreadable %s: %s", path, exc)
            return None

    # ------------------------------------------------------------------ the twin thread

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            desired = self._slot.take()
            if desired is None:
                continue
            try:
                self._apply(desired)
            except CudaFatalError:
                # Reported by the pipeline (final event, stop, exit code); the desired state is
                # persisted and applied again by the restarted process.
                log.error("applying desired version %s stopped by a sticky CUDA error", desired.version)
                return
            except Exception:
                log.exception("applying desired version %s failed", desired.version)

    def _apply(self, desired: DesiredState) -> None:
        log.info("applying desired state version %s", desired.version)
        for cam_id in self.pipeline.cameras:
            if self._stop.is_set():
                return
            self._apply_camera(cam_id, desired.cameras.get(cam_id))
        with self._lock:
            for cam_id in desired.cameras:
                if cam_id not in self.pipeline.cameras:
                    self._reported[cam_id] = CameraReported(
                        state="failed", error="camera is not configured on this device"
                    )
            self.applied_version = max(self.applied_version, desired.version)
        self.report()

    def _apply_camera(self, cam: str, cd: CameraDesired | None) -> None:
        current = self.pipeline.model_of(cam)
        if cd is None or cd.model is None:
            if current is not None:
                self.pipeline.clear(cam)
                log.info("camera %s: no model desired; stopped inference", cam)
            self.set_reported(cam, CameraReported(state="idle"), publish=False)
            return
        ref = cd.model
        manifest = ref.manifest
        key = f"{manifest.name}:{manifest.version}"
        params = CameraParams(
            threshold=cd.threshold if cd.threshold is not None else manifest.default_threshold,
            max_fps=cd.max_fps,
            labels=frozenset(cd.labels) if cd.labels is not None else None,
        )
        # Before anything else, even for the model already running: a ref that does not check out
        # is not the controller's word, so nothing of it is fetched, loaded or applied.
        refused = self._signature_problem(ref)
        if refused is not None:
            self._model_failed(cam, key, manifest.sha256, current, refused, check="signature")
            return
        if current is not None and current.sha256 == manifest.sha256 and current.manifest == manifest:
            self.pipeline.set_params(cam, params)
            self.set_reported(
                cam, CameraReported(model=key, sha256=manifest.sha256, state="running"), publish=False
            )
            return
        try:
            model = self.pipeline.loaded(manifest.sha256)
            if model is None or model.manifest != manifest:
                path = self._obtain(cam, ref)
                self.set_reported(cam, CameraReported(model=key, sha256=manifest.sha256, state="loading"))
                # The load (a TensorRT engine build can take minutes) runs here, on the twin thread,
                # while the inference thread keeps serving the old model; the swap comes after.
                with self._building(_BuildCtx(cam, key, manifest.sha256, ref.variant)):
                    model = self.pipeline.load(path, manifest)
            swap_start = time.perf_counter()
            self.pipeline.activate(cam, model, params)
            swap_ms = (time.perf_counter() - swap_start) * 1000.0
        except FetchCancelled:
            return
        except (FetchError, ModelLoadError, OSError) as exc:
            if self._stop.is_set():
                return  # a build abandoned because the agent stops is not a model failure
            self._model_failed(cam, key, manifest.sha256, current, str(exc))
            return
        activate: dict[str, Any] = {
            "model": key,
            "sha256": manifest.sha256,
            "provider": model.backend.provider,
            "swap_ms": round(swap_ms, 3),
        }
        precision = getattr(model.backend, "precision", None)
        if precision is not None:
            activate["precision"] = precision
        self.publisher.emit_event(
            EventKind.MODEL_ACTIVATE,
            camera=cam,
            message=f"{key} active on {model.backend.provider}",
            data=activate,
        )
        self.set_reported(cam, CameraReported(model=key, sha256=manifest.sha256, state="running"))

    def _signature_problem(self, ref: ArtifactRef) -> str | None:
        """Why ``ref`` must be refused (its signature, or no key to check it with), or None."""
        if self.artifact_key is None:
            if self._require_signed:
                return (
                    "no artifact public key configured, so no model can be trusted: set "
                    "artifact_public_key (or EDGEFLEET_ARTIFACT_PUBLIC_KEY) to the controller's key from "
                    "enrollment or GET /api/v1/keys/artifacts"
                )
            return None
        try:
            verify(ref, self.artifact_key)
        except SignatureError as exc:
            return f"refused {ref.manifest.name}:{ref.manifest.version}: {exc}"
        return None

    def _model_failed(
        self,
        cam: str,
        key: str,
        sha256: str,
        current: LoadedModel | None,
        reason: str,
        *,
        check: str | None = None,
    ) -> None:
        """Report a model that will not run on ``cam``: event + reported state; ``current`` stays."""
        log.error("camera %s: model %s failed: %s", cam, key, reason)
        data: dict[str, Any] = {"model": key, "sha256": sha256, "kept": current.key if current else None}
        if check is not None:
            data["check"] = check
        self.publisher.emit_event(
            EventKind.MODEL_FAILED, camera=cam, severity=Severity.ERROR, message=reason, data=data
        )
        self.report_failed(cam, current, reason)

    def _obtain(self, cam: str, ref: ArtifactRef) -> Path:
        """The verified model file: from the store, or fetched over the link."""
        manifest = ref.manifest
        sha, key = manifest.sha256, f"{manifest.name}:{manifest.version}"
        path = self.fetcher.path_for(sha)
        if path.exists():
            self.set_reported(cam, CameraReported(model=key, sha256=sha, state="verifying"))
            if file_sha256(path) == sha:
                return path
            log.warning("stored %s is corrupt; fetching it again", path.name)
            path.unlink(missing_ok=True)
        last_step = -1

        def progress(done: int, pct: float) -> None:
            nonlocal last_step
            step = int(pct // 10)
            if step == last_step:
                return  # rate limit: one report and one event per 10 %
            last_step = step
            self.set_reported(
                cam, CameraReported(model=key, sha256=sha, state="fetching", progress_pct=round(pct, 1))
            )
            self.publisher.emit_event(
                EventKind.MODEL_DOWNLOAD,
                camera=cam,
                message=f"{key}: {pct:.0f} %",
                data={
                    "model": key,
                    "sha256": sha,
                    "bytes": done,
                    "size": manifest.size,
                    "pct": round(pct, 1),
                },
            )

        path = self.fetcher.fetch(ref, self._stop, progress)
        self.set_reported(cam, CameraReported(model=key, sha256=sha, state="verifying"))
        self.publisher.emit_event(
            EventKind.MODEL_VERIFY, camera=cam, message=f"{key}: sha256 verified", data={"sha256": sha}
        )
        return path

    # ------------------------------------------------------------------ engine builds

    def _building(self, ctx: _BuildCtx) -> AbstractContextManager[None]:
        """Announce the load of ``ctx`` to the backend factory, so its build steps are reported."""
        if self._builds is None:
            return nullcontext()
        request = LoadRequest(
            variant=ctx.variant,
            notify=lambda note: self._on_build_note(ctx, note),
            cancel=self._stop,
            calibration_frames=lambda n: self._camera_frames(ctx.camera, n),
        )
        return self._builds.announce(ctx.sha256, request)

    def _on_build_note(self, ctx: _BuildCtx, note: BuildNote) -> None:
        """A step of an engine build: a MODEL_BUILD event, and progress in the reported state."""
        if note.phase == "progress":
            step = int((note.pct or 0.0) // 10)
            if step == ctx.last_step:
                return  # rate limit: one event and one report per 10 %
            ctx.last_step = step
        data: dict[str, Any] = {
            "model": ctx.model,
            "sha256": ctx.sha256,
            "phase": note.phase,
            "engine": note.engine,
        }
        for name in ("pct", "duration_s", "engine_file", "precision", "provider"):
            value = getattr(note, name)
            if value is not None:
                data[name] = round(value, 2) if isinstance(value, float) else value
        if note.reason:
            data["reason"] = note.reason[:1000]
        what = "TensorRT engine" if note.engine == "tensorrt" else f"onnxruntime ({note.provider})"
        message = {
            "started": f"{ctx.model}: {what} build started",
            "progress": f"{ctx.model}: {what} build {note.pct or 0.0:.0f} %",
            "cached": f"{ctx.model}: {what} loaded from the cache",
            "evicted": f"{ctx.model}: cached engine evicted: {note.reason}",
            "finished": f"{ctx.model}: {what} built in {note.duration_s or 0.0:.1f} s",
            "failed": f"{ctx.model}: {what} failed: {note.reason}",
            "fallback": f"{ctx.model}: running on {note.provider}: {note.reason}",
        }[note.phase]
        bad = note.phase in ("failed", "evicted", "fallback")
        self.publisher.emit_event(
            EventKind.MODEL_BUILD,
            camera=ctx.camera,
            severity=Severity.WARNING if bad else Severity.INFO,
            message=message[:4096],
            data=data,
        )
        if note.phase in ("started", "progress"):
            pct = round(note.pct, 1) if note.pct is not None else 0.0
            self.set_reported(
                ctx.camera,
                CameraReported(model=ctx.model, sha256=ctx.sha256, state="loading", progress_pct=pct),
            )

    def _camera_frames(self, camera: str, n: int) -> list[np.ndarray]:
        """Up to ``n`` distinct live frames of ``camera`` (INT8 calibration); waits at most 30 s."""
        frames: list[np.ndarray] = []
        last = None
        deadline = time.monotonic() + _CALIBRATION_WAIT_S
        while len(frames) < n and time.monotonic() < deadline and not self._stop.is_set():
            frame = self.pipeline.latest_frame(camera)
            if frame is not None and frame.index != last:
                last = frame.index
                frames.append(frame.image.copy())
            self._stop.wait(0.05)
        return frames

    # ------------------------------------------------------------------ reported state out

    def reported_state(self) -> ReportedState:
        with self._lock:
            return ReportedState(
                ts=time.time(),
                desired_version=max(0, self.applied_version),
                cameras=dict(self._reported),
                agent_version=__version__,
            )

    def report(self) -> None:
        self._publish(TopicKind.TWIN_REPORTED, encode(self.reported_state()))

    def report_failed(
        self, camera: str, model: LoadedModel | None, reason: str, *, publish: bool = True
    ) -> None:
        """The camera is failed, still naming the model it has (None: none)."""
        rep = CameraReported(
            model=model.key if model else None,
            sha256=model.sha256 if model else None,
            state="failed",
            error=reason[:1000],
        )
        self.set_reported(camera, rep, publish=publish)

    def set_reported(self, camera: str, rep: CameraReported, *, publish: bool = True) -> None:
        with self._lock:
            self._reported[camera] = rep
        if publish:
            self.report()
