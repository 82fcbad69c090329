"""The agent: builds the parts from the settings (:meth:`Agent.from_settings`), starts and stops them.

Threads (all named, all stopped by ONE event, joined with timeouts):
  capture-<camera>  one per camera, newest frame only (LatestSlot, replace + count)
  prepare           newest frame of each camera, batched per model, preprocessed -> one-item hand-off
  inference         runs the model, decodes -> DropOldestQueue -> publisher
  publisher         DetectionBatch -> outbox (disk) -> MQTT; resends what is due
  twin              applies desired states (LatestSlot: a newer desired replaces a pending one)
  commands          runs commands (bounded queue; when full the command is refused with "busy")
  heartbeat         health every heartbeat_interval_s (QoS 0)
  reach             probes the sources of pool cameras the device could be given (probe_interval_s)
  watchdog          abandons an inference that hangs, restarts it (rate-limited), reports each step
  local-page        the local status page and API (edge_agent/local/), when enabled; its request
                    threads bounded by local_page.max_clients
  + paho's network thread inside MqttLink.

Desired state lives in :mod:`edge_agent.control.twin`, commands in :mod:`edge_agent.control.commands`, the heartbeat
in :mod:`edge_agent.control.heartbeat`. What stays here ties the parts to the link and to each other: the
birth message, the stop on a link that failed for good, and the events of camera and watchdog steps.

Backend faults: a sticky CUDA error (:class:`~edge_agent.inference.backend.CudaFatalError`) anywhere on the
inference path publishes a final ERROR event, sets the stop event and makes :meth:`Agent.run` return
``exc.exit_code`` (4), so systemd/Docker restart the process (the GPU context cannot be recovered in
it). A provider that ORT silently left at run time (:class:`~edge_agent.inference.backend.ProviderFallback`)
is a MODEL_BUILD event of phase ``fallback`` (like the fallback of a load), and inference goes on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from edge_agent import __version__
from edge_agent.control.commands import CommandRunner
from edge_agent.control.heartbeat import HeartbeatSender
from edge_agent.control.pool import PoolCameras, SecretFiles
from edge_agent.control.reach import ReachProbes
from edge_agent.control.twin import EngineBuilds, Twin
from edge_agent.core import logring
from edge_agent.core.disk_guard import Reserve
from edge_agent.core.files import atomic_write
from edge_agent.core.queues import DropOldestQueue
from edge_agent.core.restart_policy import RestartLimiter, WatchdogAction, WatchdogNote
from edge_agent.core.settings import AgentSettings, CameraConfig
from edge_agent.device.health import Health
from edge_agent.inference.backend import BackendFactory, CudaFatalError, ProviderFallback
from edge_agent.inference.factory import AutoBackendFactory
from edge_agent.inference.tensorrt.runtime import TrtRuntime
from edge_agent.local.server import LocalPage, open_local_page
from edge_agent.local.status import StatusParts, StatusReader
from edge_agent.update.install import PackageFetcher
from edge_agent.update.slots import EXIT_RESTART, EXIT_UPDATE
from edge_agent.update.updater import AgentUpdater
from edge_agent.uplink.artifacts import ArtifactFetcher
from edge_agent.uplink.link import MqttLink, Transport
from edge_agent.uplink.outbox import Outbox
from edge_agent.uplink.publisher import Publisher
from edge_agent.vision.capture import CameraWorker, SourceOpener
from edge_agent.vision.pipeline import OUT_QUEUE_SIZE, DecodeFn, LoadedModel, Pipeline, PreprocessorFactory
from edge_agent.vision.tracking import id_allocator, tracker_factory
from fleet_protocol.codec import encode
from fleet_protocol.messages import (
    Ack,
    ArtifactRequest,
    Availability,
    CameraState,
    Capabilities,
    EventKind,
    FrameDetections,
    LineCrossing,
    Message,
    Severity,
    TrackSighting,
    ZoneTransit,
)
from fleet_protocol.signing import key_id, load_public_key
from fleet_protocol.topics import TopicKind, Topics

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FATAL_LINK = 3
# Written by a restart on command, read and removed by the next start: why the agent restarted.
RESTART_MARKER = "restart.json"
_JOIN_S = 5.0


class CameraEvents:
    """CAMERA_UP and CAMERA_DOWN events from the capture threads' state changes, for the workers it
    tracks (the configured cameras, and pool cameras while they run)."""

    def __init__(self, publisher: Publisher, stop: threading.Event) -> None:
        self._publisher = publisher
        # Replaced whole, never changed in place: the capture threads read it without a lock.
        self._workers: Mapping[str, CameraWorker] = {}
        self._stop = stop

    def track(self, worker: CameraWorker) -> None:
        self._workers = {**self._workers, worker.id: worker}

    def forget(self, camera: str) -> None:
        self._workers = {c: w for c, w in self._workers.items() if c != camera}

    def on_state(self, camera: str, state: CameraState, reason: str) -> None:
        # Called on the camera's capture thread, which has set these before the transition.
        worker = self._workers.get(camera)
        data: dict[str, Any] = {"reason": reason}
        if state == CameraState.UP:
            if worker is not None and worker.down_since is not None:
                data["down_s"] = round(time.monotonic() - worker.down_since, 3)
                data["attempts"] = worker.failures
            self._publisher.emit_event(EventKind.CAMERA_UP, camera=camera, message=reason, data=data)
        elif state == CameraState.DOWN or (state == CameraState.STOPPED and not self._stop.is_set()):
            if state == CameraState.DOWN and worker is not None and worker.next_retry_s is not None:
                data["retry_in_s"] = round(worker.next_retry_s, 3)
            self._publisher.emit_event(
                EventKind.CAMERA_DOWN, camera=camera, severity=Severity.WARNING, message=reason, data=data
            )


class WatchdogReports:
    """Reports each step of the inference watchdog: an event, and cameras marked failed (or running
    again) in the reported state."""

    def __init__(
        self, *, publisher: Publisher, twin: Twin, pipeline: Pipeline, hang_timeout_s: float | None
    ) -> None:
        self._publisher = publisher
        self._twin = twin
        self._pipeline = pipeline
        self._hang_timeout_s = hang_timeout_s
        self._failed: set[str] = set()  # cameras reported failed by the watchdog

    def __call__(self, note: WatchdogNote) -> None:
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
            "hang_timeout_s": self._hang_timeout_s,
        }
        if note.stuck_s is not None:
            data["stuck_s"] = note.stuck_s
        if note.retry_in_s is not None:
            data["retry_in_s"] = round(note.retry_in_s, 3)
        message = f"{note.action.value}: {note.reason}"
        if note.retry_in_s is not None:
            message += f"; next try in {note.retry_in_s:g} s"
        self._publisher.emit_event(
            EventKind.WATCHDOG_RESTART, severity=severity, message=message[:4096], data=data
        )
        if note.action == WatchdogAction.FAILED:
            for cam in note.cameras:
                model = self._pipeline.model_of(cam)
                self._failed.add(cam)
                self._twin.report_failed(cam, model, message, publish=False)
            self._twin.report()
        elif note.action == WatchdogAction.RECOVERED:
            for cam in sorted(self._failed):
                model = self._pipeline.model_of(cam)
                if model is not None:
                    self._twin.set_reported(cam, self._twin.running_report(cam, model), publish=False)
            self._failed.clear()
            self._twin.report()


class Agent:
    """Starts the parts, ties them to the link, and stops them with one event."""

    @classmethod
    def from_settings(
        cls,
        settings: AgentSettings,
        *,
        transport: Transport | None = None,
        source_opener: SourceOpener | None = None,
        backend_factory: BackendFactory | None = None,
        preprocessor_factory: PreprocessorFactory | None = None,
        decode_fn: DecodeFn | None = None,
        trt_runtime: TrtRuntime | None = None,
    ) -> Agent:
        """Build every part from ``settings``. The keyword arguments replace real parts (tests, bench):
        a ``backend_factory`` passed in is used as is, so its loads report no engine-build steps."""
        stop = threading.Event()
        data_dir = settings.data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        # The recent log for the remote ``logs`` command, redacted as lines are recorded.
        logs = logring.install()
        password = settings.mqtt_url.password
        if password is not None:
            logs.add_secrets([password.get_secret_value()])
        outbox = Outbox(data_dir / "outbox.db", max_messages=settings.outbox.max_messages)
        health = Health(data_dir)
        link: Transport = transport or MqttLink(
            settings.mqtt_url,
            device_id=settings.device_id,
            topics=Topics(settings.topic_prefix),
            reconnect_min_s=settings.mqtt_reconnect_min_s,
            reconnect_max_s=settings.mqtt_reconnect_max_s,
            keepalive_s=settings.mqtt_keepalive_s,
        )
        # The inference -> publisher queue exists before the pipeline that fills it, so the publisher
        # (and the camera events that go through it) can exist before the cameras.
        frames: DropOldestQueue[FrameDetections] = DropOldestQueue(OUT_QUEUE_SIZE)
        publisher = Publisher(
            outbox,
            frames,
            link.publish,
            settings.outbox,
            stop=stop,
            reserve=Reserve(data_dir / "storage.reserve"),
            # The transport calls on_connected after each CONNACK (Transport.set_callbacks).
            link_up=False,
        )
        wake = threading.Event()
        camera_events = CameraEvents(publisher, stop)

        def camera_worker(config: CameraConfig) -> CameraWorker:
            worker = CameraWorker(
                config, stop=stop, opener=source_opener, on_state=camera_events.on_state, wake=wake
            )
            camera_events.track(worker)
            return worker

        workers = [camera_worker(c) for c in settings.cameras]
        inf = settings.inference
        # Native TensorRT or onnxruntime, per inference.engine, unless a factory is passed in.
        builds: EngineBuilds | None = None
        if backend_factory is None:
            builds = EngineBuilds(
                AutoBackendFactory(
                    engine=inf.engine,
                    cache_dir=inf.trt_cache_dir or data_dir / "trt_cache",
                    cache_max_bytes=inf.trt_cache_max_mb * 2**20,
                    threads=inf.threads,
                    providers_preference=inf.providers,
                    spin=inf.spin,
                    max_batch=inf.max_batch,
                    precision=inf.trt_precision,
                    build_timeout_s=inf.trt_build_timeout_s,
                    workspace_mb=inf.trt_workspace_mb,
                    calibration_frames=inf.trt_calibration_frames,
                    runtime=trt_runtime,
                    preprocessor_factory=preprocessor_factory,
                )
            )
            backend_factory = builds
        pipeline = Pipeline(
            workers,
            stop=stop,
            wake=wake,
            backend_factory=backend_factory,
            max_batch=inf.max_batch,
            workers=inf.workers,
            out=frames,
            preprocessor_factory=preprocessor_factory,
            decode_fn=decode_fn,
            hang_timeout_s=inf.hang_timeout_s,
            restart_limiter=RestartLimiter(
                max_restarts=inf.max_restarts,
                window_s=inf.restart_window_s,
                backoff_min_s=inf.restart_backoff_min_s,
                backoff_max_s=inf.restart_backoff_max_s,
            ),
            tracker_factory=tracker_factory(settings.tracking, id_allocator()),
            track_events_per_minute=settings.tracking.events_per_minute,
        )

        def request_chunks(req: ArtifactRequest) -> bool:
            return link.publish(TopicKind.ARTIFACT_REQUEST, encode(req))

        art = settings.artifacts
        key = load_public_key(settings.artifact_public_key) if settings.artifact_public_key else None
        upd = settings.update
        fetch_options: dict[str, Any] = {
            "window": art.window,
            "window_bytes": art.window_bytes,
            "request_timeout_s": art.request_timeout_s,
            "max_retries": art.max_retries,
            "unused_grace_s": art.unused_grace_s,
            "partial_grace_s": art.partial_grace_s,
            "collect_interval_s": art.collect_interval_s,
        }
        updater = AgentUpdater(
            data_dir=data_dir,
            request=request_chunks,
            emit=publisher.emit_event,
            stop=stop,
            key=key,
            require_signed=settings.require_signed_artifacts,
            running_slot=AgentUpdater.running_slot_from_env(),
            install_timeout_s=upd.install_timeout_s,
            retry_min_s=upd.retry_min_s,
            retry_max_s=upd.retry_max_s,
            fetcher=PackageFetcher(data_dir, request_chunks, **fetch_options),
        )
        fetcher = ArtifactFetcher(data_dir / "models", request_chunks, **fetch_options)
        reach = ReachProbes(stop=stop, interval_s=settings.probe_interval_s)
        twin = Twin(
            pipeline=pipeline,
            publisher=publisher,
            fetcher=fetcher,
            publish=link.publish,
            data_dir=data_dir,
            device_id=settings.device_id,
            artifact_key=key,
            require_signed=settings.require_signed_artifacts,
            stop=stop,
            builds=builds,
            agent_update=updater,
            pool=PoolCameras(
                make_worker=camera_worker,
                read_secret=SecretFiles(
                    settings.secrets_dir or data_dir / "secrets", on_read=lambda t: logs.add_secrets([t])
                ),
                removed=camera_events.forget,
            ),
            probes=reach.set_probes,
            pool_retry_s=settings.pool_retry_s,
        )
        updater.report = twin.report
        fetcher.keep = twin.needed_models  # the models' store is collected on the twin thread
        # Wired last: a watchdog step changes the twin's reported state, and the twin needs the pipeline.
        pipeline.watchdog.on_note = WatchdogReports(
            publisher=publisher, twin=twin, pipeline=pipeline, hang_timeout_s=inf.hang_timeout_s
        )
        commands = CommandRunner(
            device_id=settings.device_id,
            pipeline=pipeline,
            publisher=publisher,
            transport=link,
            outbox=outbox,
            fetcher=fetcher,
            health=health,
            applied_version=lambda: twin.applied_version,
            stop=stop,
            settings=settings,
            logs=logs,
        )
        heartbeats = HeartbeatSender(
            health=health,
            pipeline=pipeline,
            outbox=outbox,
            publish=link.publish,
            interval_s=settings.heartbeat_interval_s,
            stop=stop,
            reach=reach.reach,
        )
        return cls(
            settings,
            stop=stop,
            outbox=outbox,
            health=health,
            transport=link,
            publisher=publisher,
            pipeline=pipeline,
            fetcher=fetcher,
            twin=twin,
            commands=commands,
            heartbeats=heartbeats,
            backends=builds.backends if builds is not None else backend_factory,
            updater=updater,
            reach=reach,
        )

    def __init__(
        self,
        settings: AgentSettings,
        *,
        stop: threading.Event,
        outbox: Outbox,
        health: Health,
        transport: Transport,
        publisher: Publisher,
        pipeline: Pipeline,
        fetcher: ArtifactFetcher,
        twin: Twin,
        commands: CommandRunner,
        heartbeats: HeartbeatSender,
        backends: object | None = None,
        updater: AgentUpdater | None = None,
        reach: ReachProbes | None = None,
    ) -> None:
        """Takes built parts (see :meth:`from_settings`) that share ``stop``, and ties them to the link.

        ``backends``: the backend factory, stopped at shutdown through its ``cancel_all()`` and
        ``close()`` where it has them (AutoBackendFactory: engine builds in progress)."""
        self.settings = settings
        self.device_id = settings.device_id
        self.data_dir = settings.data_dir
        self.stop_event = stop
        self.exit_code = EXIT_OK
        self.outbox = outbox
        self.health = health
        self.transport = transport
        self.publisher = publisher
        self.pipeline = pipeline
        self.fetcher = fetcher
        self.twin = twin
        self.commands = commands
        self.heartbeats = heartbeats
        self.backends = backends
        self.updater = updater
        self.reach = reach
        self._capabilities: Capabilities | None = None
        self.local_page: LocalPage | None = None
        # Backend faults on the inference path (see the module docstring).
        pipeline.watchdog.on_fatal = self._on_cuda_fatal
        pipeline.on_provider_fallback = self._on_provider_fallback
        pipeline.on_track_event = self._on_track_event
        pipeline.on_zone_event = self._on_zone_event

        commands.restart_agent = self._restart_on_command
        transport.set_callbacks(birth=self._birth, on_connected=self._on_connected, on_fatal=self._on_fatal)
        transport.on_message(TopicKind.TWIN_DESIRED, twin.on_message)
        if isinstance(transport, MqttLink):
            transport.on_undecodable = self._on_undecodable
        transport.on_message(TopicKind.COMMANDS, commands.on_message)
        transport.on_message(TopicKind.ACKS, self._on_ack_msg)
        if updater is None:
            transport.on_chunk(fetcher.on_chunk)
        else:
            # Each fetcher takes the chunks of its own transfers (by sha256) and ignores the rest.
            def on_chunk(payload: bytes, upd: AgentUpdater = updater) -> None:
                fetcher.on_chunk(payload)
                upd.on_chunk(payload)

            transport.on_chunk(on_chunk)

        self._threads = [
            threading.Thread(target=twin.run, name="twin", daemon=True),
            threading.Thread(target=commands.run, name="commands", daemon=True),
            threading.Thread(target=heartbeats.run, name="heartbeat", daemon=True),
        ]
        if updater is not None:
            self._threads.append(threading.Thread(target=updater.run, name="agent-update", daemon=True))
        if reach is not None:
            self._threads.append(threading.Thread(target=reach.run, name="reach", daemon=True))
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._started = True
        key = self.twin.artifact_key
        if key is not None:
            log.info("artifacts must be signed by key %s", key_id(key))
        elif self.settings.require_signed_artifacts:
            log.error(
                "no artifact_public_key configured: every model will be refused until it is set "
                "(the controller's key is in the enrollment answer and at GET /api/v1/keys/artifacts)"
            )
        else:
            log.warning("require_signed_artifacts is off and no key is set: models run UNVERIFIED")
        persisted = self.twin.load_persisted()
        applied = self.twin.load_applied() if persisted is not None else None
        if persisted is not None and applied is not None:
            self.twin.serve_first(applied, persisted)
        restart = self._restart_reason()
        why = f" (restarted on command {restart.get('command')} of {restart.get('by') or 'an operator'})"
        self.publisher.emit_event(
            EventKind.AGENT_STARTED,
            message=f"agent {__version__} started{why if restart else ''}",
            data={
                "agent_version": __version__,
                "cameras": [c.id for c in self.settings.cameras],
                **({"restart": restart} if restart else {}),
            },
        )
        if self.updater is not None:
            self.updater.start()  # how the last agent update ended, once
        self.pipeline.start()
        self.publisher.start()
        for t in self._threads:
            t.start()
        if persisted is not None:
            log.info("re-applying persisted desired state version %s", persisted.version)
            self.twin.accept(persisted, persist=False)
        self.transport.start()
        self.local_page = open_local_page(
            self.settings.local_page,
            self.data_dir,
            status=StatusReader(self._status_parts()),
            frame_of=self._image_of,
        )

    def _status_parts(self) -> StatusParts:
        updater = self.updater
        return StatusParts(
            device_id=self.device_id,
            link=self.transport,
            outbox=self.outbox,
            pipeline=self.pipeline,
            twin=self.twin,
            health=self.health,
            updater=updater,
            camera_errors=lambda: {
                c: w.retries[-1].reason if w.retries else None for c, w in self.pipeline.cameras.items()
            },
            slot_state=lambda: updater.store.load().to_json() if updater is not None else None,
        )

    def _image_of(self, camera: str) -> Any:
        frame = self.pipeline.latest_frame(camera)
        return frame.image if frame is not None else None

    def request_stop(self) -> None:
        self.stop_event.set()

    def _restart_on_command(self, why: dict[str, Any]) -> None:
        """The ``restart_agent`` command: say why for the next start, then stop with EXIT_RESTART (the
        supervisor starts the agent again at once; systemd's ``Restart=always`` does too)."""
        try:
            atomic_write(self.data_dir / RESTART_MARKER, json.dumps(why).encode())
        except OSError as exc:
            log.warning("restart on command: the reason is not kept (%s)", exc)
        log.warning("restarting on command %s of %s", why.get("command"), why.get("by") or "an operator")
        self.exit_code = EXIT_RESTART
        self.stop_event.set()

    def _restart_reason(self) -> dict[str, Any]:
        """Why the last run ended on command ({}: it did not), read once."""
        path = self.data_dir / RESTART_MARKER
        try:
            why = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("%s unreadable (%s): ignored", path, exc)
            why = {}
        path.unlink(missing_ok=True)
        return {k: why[k] for k in ("command", "by", "at") if k in why} if isinstance(why, dict) else {}

    def run(self) -> int:
        """Start, block until stopped (signal, fatal link error), shut down; returns the exit code."""
        self.start()
        try:
            while not self.stop_event.wait(0.5):
                pass
        finally:
            self.shutdown()
        if self.updater is not None and self.updater.restart_requested and self.exit_code == EXIT_OK:
            return EXIT_UPDATE  # the supervisor starts the version just installed
        return self.exit_code

    def shutdown(self) -> None:
        self.stop_event.set()
        if not self._started:
            self._close_backends()
            self._close_health()
            self.outbox.close()
            return
        if self.local_page is not None:
            self.local_page.close()
        # Before the joins: the twin thread may be waiting on an engine build.
        self._close_backends()
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
        self._close_health()
        self.outbox.close()
        log.info("agent stopped")

    def _close_backends(self) -> None:
        """Stop what the backend factory runs beside the agent (engine builds). Duck-typed: only
        AutoBackendFactory has ``cancel_all`` (and a factory may grow ``close``); a plain function
        passed in as the factory (tests, bench) has neither."""
        backends = self.backends
        if backends is None:
            return
        for name in ("cancel_all", "close"):  # builds first, then whatever the factory holds
            method = getattr(backends, name, None)
            if not callable(method):
                continue
            try:
                method()
            except Exception:
                log.exception("backend factory %s() failed at shutdown", name)
        self.backends = None  # once

    def _close_health(self) -> None:
        try:
            self.health.close()  # stops the Jetson sampling thread
        except Exception:
            log.exception("closing health sampling failed")

    # ------------------------------------------------------------------ backend faults

    def _on_cuda_fatal(self, exc: CudaFatalError, where: str) -> None:
        """A sticky CUDA error: a final event, then stop; :meth:`run` returns ``exc.exit_code``.
        Called once, on the thread that met the error (the watchdog sets the stop event too)."""
        self.exit_code = exc.exit_code
        try:
            self.publisher.emit_event(
                EventKind.ERROR,
                severity=Severity.ERROR,
                message=(
                    f"sticky CUDA error during {where}: {exc}; the GPU context is unusable, "
                    f"the agent exits with {exc.exit_code} to be restarted"
                )[:4096],
                data={
                    "error": "cuda_fatal",
                    "where": where,
                    "reason": str(exc)[:1000],
                    "exit_code": exc.exit_code,
                    "providers": self.pipeline.providers(),
                },
            )
        finally:
            self.stop_event.set()

    def _on_track_event(self, kind: EventKind, camera: str, sighting: TrackSighting) -> None:
        what = "started" if kind == EventKind.TRACK_STARTED else "ended"
        self.publisher.emit_event(
            kind,
            camera=camera,
            message=f"{sighting.label} track {sighting.track_id} {what}",
            data=sighting.model_dump(mode="json"),
        )

    def _on_zone_event(self, kind: EventKind, camera: str, data: ZoneTransit | LineCrossing) -> None:
        if isinstance(data, LineCrossing):
            message = f"{data.label} track {data.track_id} crossed {data.line} ({data.direction.value})"
        else:
            what = "entered" if kind == EventKind.ZONE_ENTERED else "left"
            message = f"{data.label} track {data.track_id} {what} {data.zone}"
        self.publisher.emit_event(kind, camera=camera, message=message, data=data.model_dump(mode="json"))

    def _on_provider_fallback(self, model: LoadedModel, fb: ProviderFallback) -> None:
        """ORT moved ``model``'s session to another provider during a run: one batch lost, the
        backend goes on. Reported like a load's fallback (MODEL_BUILD, phase ``fallback``)."""
        cameras = self.pipeline.cameras_of(model)
        self.publisher.emit_event(
            EventKind.MODEL_BUILD,
            camera=cameras[0] if len(cameras) == 1 else None,
            severity=Severity.WARNING,
            message=(
                f"{model.key}: {fb.previous} failed at run time, now running on {fb.provider}: {fb.reason}"
            )[:4096],
            data={
                "model": model.key,
                "sha256": model.sha256,
                "phase": "fallback",
                "previous": fb.previous,
                "provider": fb.provider,
                "reason": fb.reason[:1000],
                "cameras": list(cameras),
            },
        )

    # ------------------------------------------------------------------ link callbacks

    def _birth(self) -> Availability:
        if self._capabilities is None:
            self._capabilities = self.health.capabilities([c.id for c in self.settings.cameras])
        return Availability(
            state="online",
            ts=time.time(),
            agent_version=__version__,
            capabilities=self._capabilities,
            incarnation=self.outbox.incarnation,
        )

    def _on_connected(self) -> None:
        self.publisher.on_connected()
        self.commands.on_connected()
        self.twin.report()
        if self.updater is not None:
            self.updater.on_connected()  # the healthy marker: this version works

    def _on_fatal(self, reason: str) -> None:
        log.error("link failed for good: %s; stopping", reason)
        self.exit_code = EXIT_FATAL_LINK
        self.stop_event.set()

    def _on_ack_msg(self, msg: Message) -> None:
        if isinstance(msg, Ack):
            self.publisher.on_ack(msg)

    def _on_undecodable(self, kind: TopicKind, why: str) -> None:
        if kind == TopicKind.TWIN_DESIRED:
            self.twin.refuse_undecodable(why)


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
