"""The agent: wires capture, pipeline, outbox/publisher, link, fetcher and health together.

Threads (all named, all stopped by ONE event, joined with timeouts):
  capture-<camera>  one per camera, newest frame only (LatestSlot, replace + count)
  inference         batches frames of cameras sharing a model -> DropOldestQueue -> publisher
  publisher         DetectionBatch -> outbox (disk) -> MQTT; resends what is due
  twin              applies desired states (LatestSlot: a newer desired replaces a pending one)
  commands          runs commands (bounded queue; when full the command is refused with "busy")
  heartbeat         health every heartbeat_interval_s (QoS 0)
  watchdog          abandons an inference that hangs, restarts it (rate-limited), reports each step
  + paho's network thread inside MqttLink.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent import __version__
from edge_agent.artifacts import ArtifactFetcher, FetchCancelled, FetchError, file_sha256
from edge_agent.backends import (
    AutoBackendFactory,
    BackendFactory,
    BuildNote,
    InferenceBackend,
    LoadRequest,
)
from edge_agent.capture import CameraWorker, SourceOpener
from edge_agent.health import Health
from edge_agent.link import MqttLink, Transport
from edge_agent.outbox import Outbox
from edge_agent.pipeline import (
    CameraParams,
    DecodeFn,
    LoadedModel,
    ModelLoadError,
    Pipeline,
    PreprocessorFactory,
)
from edge_agent.publisher import Publisher
from edge_agent.queues import LatestSlot
from edge_agent.settings import AgentSettings
from edge_agent.trt import TrtRuntime
from edge_agent.watchdog import RestartLimiter, WatchdogAction, WatchdogNote
from fleet_protocol.codec import ProtocolError, decode_as, encode
from fleet_protocol.messages import (
    Ack,
    ArtifactRef,
    ArtifactRequest,
    Availability,
    CameraDesired,
    CameraReported,
    CameraState,
    Command,
    CommandName,
    CommandResult,
    DesiredState,
    EventKind,
    Heartbeat,
    Message,
    ModelManifest,
    ReportedState,
    Severity,
)
from fleet_protocol.signing import SignatureError, key_id, load_public_key, verify
from fleet_protocol.topics import TopicKind, Topics

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FATAL_LINK = 3
_JOIN_S = 5.0
_SNAPSHOT_MAX_B64 = 400 * 1024
_CALIBRATION_WAIT_S = 30.0


@dataclass
class _BuildCtx:
    """The load in progress on the twin thread (the only thread that loads models)."""

    camera: str
    model: str
    sha256: str
    variant: str
    last_step: int = -1


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        *,
        transport: Transport | None = None,
        source_opener: SourceOpener | None = None,
        backend_factory: BackendFactory | None = None,
        preprocessor_factory: PreprocessorFactory | None = None,
        decode_fn: DecodeFn | None = None,
        trt_runtime: TrtRuntime | None = None,
    ) -> None:
        self.settings = settings
        self.device_id = settings.device_id
        self.stop_event = threading.Event()
        self.exit_code = EXIT_OK
        self.data_dir = settings.data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.topics = Topics(settings.topic_prefix)
        self.outbox = Outbox(self.data_dir / "outbox.db", max_messages=settings.outbox.max_messages)
        self.health = Health(self.data_dir)
        self._capabilities: Any = None

        wake = threading.Event()
        cameras = [
            CameraWorker(
                c, stop=self.stop_event, opener=source_opener, on_state=self._on_camera_state, wake=wake
            )
            for c in settings.cameras
        ]
        # Native TensorRT or onnxruntime, per inference.engine; None when a factory is passed in.
        self.backends: AutoBackendFactory | None = None
        self._build_ctx: _BuildCtx | None = None
        if backend_factory is None:
            inf = settings.inference
            self.backends = AutoBackendFactory(
                engine=inf.engine,
                cache_dir=inf.trt_cache_dir or self.data_dir / "trt_cache",
                cache_max_bytes=inf.trt_cache_max_mb * 2**20,
                threads=inf.threads,
                providers_preference=inf.providers,
                spin=inf.spin,
                max_batch=inf.max_batch,
                precision=inf.trt_precision,
                workspace_mb=inf.trt_workspace_mb,
                calibration_frames=inf.trt_calibration_frames,
                runtime=trt_runtime,
                preprocessor_factory=preprocessor_factory,
            )
            backend_factory = self._make_backend
        self.pipeline = Pipeline(
            cameras,
            stop=self.stop_event,
            wake=wake,
            backend_factory=backend_factory,
            max_batch=settings.inference.max_batch,
            preprocessor_factory=preprocessor_factory,
            decode_fn=decode_fn,
            hang_timeout_s=settings.inference.hang_timeout_s,
            restart_limiter=RestartLimiter(
                max_restarts=settings.inference.max_restarts,
                window_s=settings.inference.restart_window_s,
                backoff_min_s=settings.inference.restart_backoff_min_s,
                backoff_max_s=settings.inference.restart_backoff_max_s,
            ),
            on_watchdog=self._on_watchdog,
        )
        self._watchdog_failed: set[str] = set()  # cameras reported failed by the watchdog
        self.transport: Transport = transport or MqttLink(
            settings.mqtt_url,
            device_id=self.device_id,
            topics=self.topics,
            reconnect_min_s=settings.mqtt_reconnect_min_s,
            reconnect_max_s=settings.mqtt_reconnect_max_s,
            keepalive_s=settings.mqtt_keepalive_s,
        )
        self.publisher = Publisher(
            self.outbox, self.pipeline.out, self.transport.publish, settings.outbox, stop=self.stop_event
        )
        self._artifact_key: Ed25519PublicKey | None = (
            load_public_key(settings.artifact_public_key) if settings.artifact_public_key else None
        )
        art = settings.artifacts
        self.fetcher = ArtifactFetcher(
            self.data_dir / "models",
            self._send_artifact_request,
            window=art.window,
            window_bytes=art.window_bytes,
            request_timeout_s=art.request_timeout_s,
            max_retries=art.max_retries,
        )

        # Twin state. ``_received_version`` guards ordering; ``applied_version`` is what we report.
        self._twin_lock = threading.Lock()
        self.applied_version = -1
        self._received_version = -1
        self._reported: dict[str, CameraReported] = {c.id: CameraReported() for c in settings.cameras}
        self._desired_slot: LatestSlot[DesiredState] = LatestSlot()
        self._twin_wake = threading.Event()
        self._commands: queue.Queue[Command] = queue.Queue(maxsize=16)

        self.transport.set_callbacks(
            birth=self._birth, on_connected=self._on_connected, on_fatal=self._on_fatal
        )
        self.transport.on_message(TopicKind.TWIN_DESIRED, self._on_desired_msg)
        self.transport.on_message(TopicKind.COMMANDS, self._on_command_msg)
        self.transport.on_message(TopicKind.ACKS, self._on_ack_msg)
        self.transport.on_chunk(self.fetcher.on_chunk)

        self._threads = [
            threading.Thread(target=self._twin_loop, name="twin", daemon=True),
            threading.Thread(target=self._command_loop, name="commands", daemon=True),
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
        ]
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._started = True
        if self._artifact_key is not None:
            log.info("artifacts must be signed by key %s", key_id(self._artifact_key))
        elif self.settings.require_signed_artifacts:
            log.error(
                "no artifact_public_key configured: every model will be refused until it is set "
                "(the controller's key is in the enrollment answer and at GET /api/v1/keys/artifacts)"
            )
        else:
            log.warning("require_signed_artifacts is off and no key is set: models run UNVERIFIED")
        persisted = self._load_desired()
        self.publisher.emit_event(
            EventKind.AGENT_STARTED,
            message=f"agent {__version__} started",
            data={"agent_version": __version__, "cameras": [c.id for c in self.settings.cameras]},
        )
        self.pipeline.start()
        self.publisher.start()
        for t in self._threads:
            t.start()
        if persisted is not None:
            log.info("re-applying persisted desired state version %s", persisted.version)
            self._accept_desired(persisted, persist=False)
        self.transport.start()

    def request_stop(self) -> None:
        self.stop_event.set()

    def run(self) -> int:
        """Start, block until stopped (signal, fatal link error), shut down; returns the exit code."""
        self.start()
        try:
            while not self.stop_event.wait(0.5):
                pass
        finally:
            self.shutdown()
        return self.exit_code

    def shutdown(self) -> None:
        self.stop_event.set()
        if not self._started:
            self.outbox.close()
            return
        self.pipeline.join(_JOIN_S)
        for t in self._threads:
            t.join(_JOIN_S)
            if t.is_alive():
                log.warning("thread %s did not stop in time", t.name)
        if not self.publisher.join(_JOIN_S):
            log.warning("publisher did not stop in time")
        try:
            self.transport.stop()
        except Exception:
            log.exception("link stop failed")
        self.outbox.close()
        log.info("agent stopped")

    # ------------------------------------------------------------------ link callbacks

    def _birth(self) -> Availability:
        if self._capabilities is None:
            self._capabilities = self.health.capabilities([c.id for c in self.settings.cameras])
        return Availability(
            state="online", ts=time.time(), agent_version=__version__, capabilities=self._capabilities
        )

    def _on_connected(self) -> None:
        self.publisher.on_connected()
        self._report()

    def _on_fatal(self, reason: str) -> None:
        log.error("link failed for good: %s; stopping", reason)
        self.exit_code = EXIT_FATAL_LINK
        self.stop_event.set()

    def _on_ack_msg(self, msg: Message) -> None:
        if isinstance(msg, Ack):
            self.publisher.on_ack(msg)

    def _send_artifact_request(self, req: ArtifactRequest) -> bool:
        return self.transport.publish(TopicKind.ARTIFACT_REQUEST, encode(req))

    def _on_camera_state(self, camera: str, state: CameraState, reason: str) -> None:
        # Called on the camera's capture thread, which has set these before the transition.
        worker = self.pipeline.cameras.get(camera)
        data: dict[str, Any] = {"reason": reason}
        if state == CameraState.UP:
            if worker is not None and worker.down_since is not None:
                data["down_s"] = round(time.monotonic() - worker.down_since, 3)
                data["attempts"] = worker.failures
            self.publisher.emit_event(EventKind.CAMERA_UP, camera=camera, message=reason, data=data)
        elif state == CameraState.DOWN or (state == CameraState.STOPPED and not self.stop_event.is_set()):
            if state == CameraState.DOWN and worker is not None and worker.next_retry_s is not None:
                data["retry_in_s"] = round(worker.next_retry_s, 3)
            self.publisher.emit_event(
                EventKind.CAMERA_DOWN, camera=camera, severity=Severity.WARNING, message=reason, data=data
            )

    def _on_watchdog(self, note: WatchdogNote) -> None:
        """Report a watchdog step: an event, and cameras marked failed (or running again)."""
        severity = {
            WatchdogAction.RESTARTED: Severity.WARNING,
            WatchdogAction.FAILED: Severity.ERROR,
        }.get(note.action, Severity.INFO)
        data: dict[str, Any] = {
            "action": note.action.value,
            "reason": note.reason[:1000],
            "model": note.model,
            "cameras": list(note.cameras),
            "restarts_in_window": note.restarts_in_window,
            "max_restarts": note.max_restarts,
            "window_s": note.window_s,
            "hang_timeout_s": self.settings.inference.hang_timeout_s,
        }
        if note.stuck_s is not None:
            data["stuck_s"] = note.stuck_s
        if note.retry_in_s is not None:
            data["retry_in_s"] = round(note.retry_in_s, 3)
        message = f"{note.action.value}: {note.reason}"
        if note.retry_in_s is not None:
            message += f"; next try in {note.retry_in_s:g} s"
        self.publisher.emit_event(
            EventKind.WATCHDOG_RESTART, severity=severity, message=message[:4096], data=data
        )
        if note.action == WatchdogAction.FAILED:
            for cam in note.cameras:
                model = self.pipeline.model_of(cam)
                self._watchdog_failed.add(cam)
                self._report_failed(cam, model, message, publish=False)
            self._report()
        elif note.action == WatchdogAction.RECOVERED:
            for cam in sorted(self._watchdog_failed):
                model = self.pipeline.model_of(cam)
                if model is not None:
                    rep = CameraReported(model=model.key, sha256=model.sha256, state="running")
                    self._set_reported(cam, rep, publish=False)
            self._watchdog_failed.clear()
            self._report()

    # ------------------------------------------------------------------ twin

    def _on_desired_msg(self, msg: Message) -> None:
        if isinstance(msg, DesiredState):
            self._accept_desired(msg, persist=True)

    def _accept_desired(self, desired: DesiredState, *, persist: bool) -> bool:
        with self._twin_lock:
            newest = max(self.applied_version, self._received_version)
            if desired.version <= newest:
                log.debug("ignoring desired version %s (have %s)", desired.version, newest)
                return False
            self._received_version = desired.version
        if persist:
            self._save_desired(desired)
        self._desired_slot.put(desired)
        self._twin_wake.set()
        return True

    def _desired_path(self) -> Path:
        return self.data_dir / "desired.json"

    def _save_desired(self, desired: DesiredState) -> None:
        # Written before it is applied: an agent restarted offline runs its last desired state.
        path = self._desired_path()
        tmp = path.with_suffix(".json.tmp")
        with tmp.open("wb") as f:
            f.write(encode(desired))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _load_desired(self) -> DesiredState | None:
        path = self._desired_path()
        if not path.exists():
            return None
        try:
            return decode_as(DesiredState, path.read_bytes())
        except (OSError, ProtocolError) as exc:
            log.warning("ignoring unreadable %s: %s", path, exc)
            return None

    def _twin_loop(self) -> None:
        while not self.stop_event.is_set():
            self._twin_wake.wait(0.5)
            self._twin_wake.clear()
            desired = self._desired_slot.take()
            if desired is None:
                continue
            try:
                self._apply(desired)
            except Exception:
                log.exception("applying desired version %s failed", desired.version)

    def _apply(self, desired: DesiredState) -> None:
        log.info("applying desired state version %s", desired.version)
        for cam_id in self.pipeline.cameras:
            if self.stop_event.is_set():
                return
            self._apply_camera(cam_id, desired.cameras.get(cam_id))
        with self._twin_lock:
            for cam_id in desired.cameras:
                if cam_id not in self.pipeline.cameras:
                    self._reported[cam_id] = CameraReported(
                        state="failed", error="camera is not configured on this device"
                    )
            self.applied_version = max(self.applied_version, desired.version)
        self._report()

    def _report_failed(
        self, camera: str, model: LoadedModel | None, reason: str, *, publish: bool = True
    ) -> None:
        """The camera is failed, still naming the model it has (None: none)."""
        rep = CameraReported(
            model=model.key if model else None,
            sha256=model.sha256 if model else None,
            state="failed",
            error=reason[:1000],
        )
        self._set_reported(camera, rep, publish=publish)

    def _set_reported(self, camera: str, rep: CameraReported, *, publish: bool = True) -> None:
        with self._twin_lock:
            self._reported[camera] = rep
        if publish:
            self._report()

    def _apply_camera(self, cam: str, cd: CameraDesired | None) -> None:
        current = self.pipeline.model_of(cam)
        if cd is None or cd.model is None:
            if current is not None:
                self.pipeline.clear(cam)
                log.info("camera %s: no model desired; stopped inference", cam)
            self._set_reported(cam, CameraReported(state="idle"), publish=False)
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
            self._set_reported(
                cam, CameraReported(model=key, sha256=manifest.sha256, state="running"), publish=False
            )
            return
        try:
            model = self.pipeline.loaded(manifest.sha256)
            if model is None or model.manifest != manifest:
                path = self._obtain(cam, ref)
                self._set_reported(cam, CameraReported(model=key, sha256=manifest.sha256, state="loading"))
                # The load (a TensorRT engine build can take minutes) runs here, on the twin thread,
                # while the inference thread keeps serving the old model; the swap comes after.
                self._build_ctx = _BuildCtx(cam, key, manifest.sha256, ref.variant)
                try:
                    model = self.pipeline.load(path, manifest)
                finally:
                    self._build_ctx = None
            swap_start = time.perf_counter()
            self.pipeline.activate(cam, model, params)
            swap_ms = (time.perf_counter() - swap_start) * 1000.0
        except FetchCancelled:
            return
        except (FetchError, ModelLoadError, OSError) as exc:
            if self.stop_event.is_set():
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
        self._set_reported(cam, CameraReported(model=key, sha256=manifest.sha256, state="running"))

    # ------------------------------------------------------------------ engine builds

    def _make_backend(self, path: Path, manifest: ModelManifest) -> InferenceBackend:
        assert self.backends is not None
        ctx = self._build_ctx
        if ctx is None or ctx.sha256 != manifest.sha256:
            return self.backends(path, manifest)
        return self.backends.make(
            path,
            manifest,
            LoadRequest(
                variant=ctx.variant,
                notify=lambda note: self._on_build_note(ctx, note),
                cancel=self.stop_event,
                calibration_frames=lambda n: self._camera_frames(ctx.camera, n),
            ),
        )

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
            self._set_reported(
                ctx.camera,
                CameraReported(model=ctx.model, sha256=ctx.sha256, state="loading", progress_pct=pct),
            )

    def _camera_frames(self, camera: str, n: int) -> list[np.ndarray]:
        """Up to ``n`` distinct live frames of ``camera`` (INT8 calibration); waits at most 30 s."""
        frames: list[np.ndarray] = []
        last = None
        deadline = time.monotonic() + _CALIBRATION_WAIT_S
        while len(frames) < n and time.monotonic() < deadline and not self.stop_event.is_set():
            frame = self.pipeline.latest_frame(camera)
            if frame is not None and frame.index != last:
                last = frame.index
                frames.append(frame.image.copy())
            self.stop_event.wait(0.05)
        return frames

    def _signature_problem(self, ref: ArtifactRef) -> str | None:
        """Why ``ref`` must be refused (its signature, or no key to check it with), or None."""
        if self._artifact_key is None:
            if self.settings.require_signed_artifacts:
                return (
                    "no artifact public key configured, so no model can be trusted: set "
                    "artifact_public_key (or EDGEFLEET_ARTIFACT_PUBLIC_KEY) to the controller's key from "
                    "enrollment or GET /api/v1/keys/artifacts"
                )
            return None
        try:
            verify(ref, self._artifact_key)
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
        self._report_failed(cam, current, reason)

    def _obtain(self, cam: str, ref: ArtifactRef) -> Path:
        """The verified model file: from the store, or fetched over the link."""
        manifest = ref.manifest
        sha, key = manifest.sha256, f"{manifest.name}:{manifest.version}"
        path = self.fetcher.path_for(sha)
        if path.exists():
            self._set_reported(cam, CameraReported(model=key, sha256=sha, state="verifying"))
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
            self._set_reported(
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

        path = self.fetcher.fetch(ref, self.stop_event, progress)
        self._set_reported(cam, CameraReported(model=key, sha256=sha, state="verifying"))
        self.publisher.emit_event(
            EventKind.MODEL_VERIFY, camera=cam, message=f"{key}: sha256 verified", data={"sha256": sha}
        )
        return path

    def reported_state(self) -> ReportedState:
        with self._twin_lock:
            return ReportedState(
                ts=time.time(),
                desired_version=max(0, self.applied_version),
                cameras=dict(self._reported),
                agent_version=__version__,
            )

    def _report(self) -> None:
        self.transport.publish(TopicKind.TWIN_REPORTED, encode(self.reported_state()))

    # ------------------------------------------------------------------ commands

    def _on_command_msg(self, msg: Message) -> None:
        if not isinstance(msg, Command):
            return
        try:
            self._commands.put_nowait(msg)
        except queue.Full:
            self._answer(CommandResult(id=msg.id, ok=False, error="busy: too many commands queued"))

    def _answer(self, result: CommandResult) -> None:
        try:
            payload = encode(result)
        except ProtocolError as exc:
            payload = encode(CommandResult(id=result.id, ok=False, error=f"result too large: {exc}"))
        self.transport.publish(TopicKind.COMMAND_RESULT, payload)

    def _command_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                cmd = self._commands.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                result = self.execute(cmd)
            except Exception as exc:
                log.exception("command %s failed", cmd.name)
                result = CommandResult(id=cmd.id, ok=False, error=f"{type(exc).__name__}: {exc}")
            self._answer(result)

    def execute(self, cmd: Command) -> CommandResult:
        if cmd.name == CommandName.DIAGNOSTICS:
            return CommandResult(id=cmd.id, ok=True, result=self.diagnostics())
        if cmd.name == CommandName.RESTART_PIPELINE:
            self.pipeline.restart()
            self.publisher.emit_event(
                EventKind.WATCHDOG_RESTART,
                message="pipeline restarted by command",
                data={"action": "command", "reason": "restart_pipeline command"},
            )
            return CommandResult(id=cmd.id, ok=True, result={"restarted": list(self.pipeline.cameras)})
        if cmd.name == CommandName.SNAPSHOT:
            camera = cmd.args.get("camera")
            if not isinstance(camera, str) or camera not in self.pipeline.cameras:
                return CommandResult(id=cmd.id, ok=False, error=f"unknown camera {camera!r}")
            snap = self.snapshot(camera, boxes=bool(cmd.args.get("boxes", False)))
            if snap is None:
                return CommandResult(id=cmd.id, ok=False, error=f"camera {camera} has no frame yet")
            return CommandResult(id=cmd.id, ok=True, result=snap)
        return CommandResult(id=cmd.id, ok=False, error=f"unsupported command {cmd.name}")

    def diagnostics(self) -> dict[str, Any]:
        link_errors = getattr(self.transport, "protocol_errors", {})
        return {
            "device_id": self.device_id,
            "agent_version": __version__,
            "desired_version": max(0, self.applied_version),
            "connected": self.transport.connected,
            "cameras": [s.model_dump(mode="json") for s in self.pipeline.stats()],
            "providers": self.pipeline.providers(),
            "outbox": {
                "pending": self.outbox.pending(),
                "dropped": self.outbox.dropped,
                "next_seq": self.outbox.next_seq,
            },
            "queue_dropped": self.pipeline.out.dropped,
            "inference_errors": self.pipeline.inference_errors,
            "watchdog": self.pipeline.watchdog_status(),
            "protocol_errors": dict(link_errors),
            "bad_chunks": self.fetcher.bad_chunks,
            "system": {k: v for k, v in self.health.system().items() if k != "gpus"},
        }

    def snapshot(self, camera: str, *, boxes: bool) -> dict[str, Any] | None:
        import cv2

        frame = self.pipeline.latest_frame(camera)
        if frame is None:
            return None
        img = frame.image
        drawn = 0
        if boxes:
            img = img.copy()
            last = self.pipeline.last_result(camera)
            for d in last.detections if last else []:
                p0 = (int(d.box.x0), int(d.box.y0))
                cv2.rectangle(img, p0, (int(d.box.x1), int(d.box.y1)), (0, 255, 0), 2)
                cv2.putText(
                    img,
                    f"{d.label} {d.score:.2f}",
                    (p0[0], max(12, p0[1] - 4)),
                    cv2.FONT_HERSHEY_SIMPLEX,
                    0.5,
                    (0, 255, 0),
                    1,
                )
                drawn += 1
        quality = 85
        while True:
            ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, quality])
            if not ok:
                raise RuntimeError("JPEG encoding failed")
            b64 = base64.b64encode(buf.tobytes()).decode()
            if len(b64) <= _SNAPSHOT_MAX_B64 or img.shape[1] < 64:
                break
            # Too big for one MQTT payload: shrink rather than fail.
            img = cv2.resize(img, (img.shape[1] // 2, img.shape[0] // 2))
            quality = 75
        return {
            "camera": camera,
            "frame": frame.index,
            "captured_at": frame.captured_at,
            "width": int(img.shape[1]),
            "height": int(img.shape[0]),
            "boxes": drawn,
            "jpeg_base64": b64,
        }

    # ------------------------------------------------------------------ heartbeat

    def heartbeat(self) -> Heartbeat:
        sysinfo = self.health.system()
        cams = self.pipeline.stats()
        ms = [c.inference_ms for c in cams if c.inference_ms is not None]
        p99 = [c.inference_p99_ms for c in cams if c.inference_p99_ms is not None]
        return Heartbeat(
            ts=time.time(),
            uptime_s=sysinfo.get("uptime_s", 0.0),
            cpu_pct=sysinfo.get("cpu_pct"),
            memory_pct=sysinfo.get("memory_pct"),
            memory_used_mb=sysinfo.get("memory_used_mb"),
            disk_free_mb=sysinfo.get("disk_free_mb"),
            disk_pct=sysinfo.get("disk_pct"),
            gpus=sysinfo.get("gpus", []),
            cameras=cams,
            inference_ms=round(max(ms), 2) if ms else None,
            cpu_energy_j=sysinfo.get("cpu_energy_j"),
            outbox_pending=self.outbox.pending(),
            outbox_dropped=self.outbox.dropped,
            queue_dropped=self.pipeline.out.dropped,
            inference_p99_ms=round(max(p99), 2) if p99 else None,
        )

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.wait(self.settings.heartbeat_interval_s):
            try:
                self.transport.publish(TopicKind.HEARTBEAT, encode(self.heartbeat()))
            except Exception:
                log.exception("heartbeat failed")


def describe(settings: AgentSettings) -> str:
    """One line for the log: what this agent is configured to do (no secrets)."""
    return json.dumps(
        {
            "device_id": settings.device_id,
            "mqtt": str(settings.mqtt_url),
            "cameras": [c.id for c in settings.cameras],
            "data_dir": str(settings.data_dir),
        }
    )
