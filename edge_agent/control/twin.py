"""The twin: the controller's desired state in, what the device actually runs out (reported state).

A desired state is the controller's whole word for this device (retained on the broker, signed as a
whole). Before anything is compared or stored, an agent with the controller's key checks the state's
signature and that it names this device; then only a version newer than the one it has is taken (the
same version again is the retained copy, ignored when identical and refused when not), never one issued
before it. A state refused for any of these reasons is refused as a whole, with an event saying why, and
the agent keeps running what it has. A taken state is written to disk before it is applied (after the
checks: a refused one is never persisted), so an agent restarted offline converges on its last desired
state without the broker; the file is checked again when it is read back. Applying runs on the twin
thread, the only thread that loads models, one camera after another:

- each model reference is checked against the artifact key first, even for the model already running:
  nothing of a refused state is fetched, loaded or applied;
- a new threshold, FPS cap, label filter, per-label thresholds or minimum box area for the running
  model applies without a reload;
- otherwise the file comes from the store or over the link (verified), is loaded and warmed up while
  the old model keeps serving (a TensorRT engine build can take minutes; its steps are reported through
  :class:`EngineBuilds`), and only then swapped in. A failure keeps the old model and is reported.

A newer desired state that no longer names the model being fetched cancels that fetch (its chunks stay
on disk, so a later state naming it again resumes it) and is applied at once: going back to a model in
the store never waits behind a large download. Within a state, the cameras whose model needs no
download are applied first.

The models' store is collected (:meth:`ArtifactFetcher.collect`, on the twin thread): what the twin
needs (:meth:`Twin.needed_models`) stays, that is the models of the desired state, of the state being
applied, of the last state fully in effect (``applied.json``) and of the one before it whose models
differ (``previous.json``: what a rollback goes back to), and every model running.

Pool cameras (a desired camera with a ``source``, PROTOCOL.md "Pool cameras") are started before the
models are applied, through :class:`~edge_agent.control.pool.PoolCameras`, and their models then
applied like any camera's; one a state no longer names, or names with another source, is stopped (its
model cleared, its capture closed) and leaves the reported state, or restarts from the new source. One
that cannot run (its id is a configured camera, a secret it names is missing, a source the device
cannot open) is reported failed and the rest of the state applies. The cameras a state keeps are not
touched. The twin remembers which cameras are pool cameras: the configured ones are never stopped.
The sources a state asks the device to probe (``probe``) are handed to the probe thread as the state's
apply begins (:mod:`edge_agent.control.reach`).

The reported state names, per camera, the model and its state, and the desired version last applied.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent import __version__
from edge_agent.control.pool import PoolCameraError, PoolCameras
from edge_agent.core.files import atomic_write
from edge_agent.core.queues import LatestSlot
from edge_agent.inference.backend import CudaFatalError, InferenceBackend
from edge_agent.inference.factory import AutoBackendFactory, BuildNote, LoadRequest
from edge_agent.uplink.artifacts import ArtifactFetcher, FetchCancelled, FetchError, file_sha256
from edge_agent.uplink.publisher import Publisher, PublishFn
from edge_agent.vision.pipeline import CameraParams, LoadedModel, ModelLoadError, Pipeline
from fleet_protocol.codec import ProtocolError, decode_as, encode
from fleet_protocol.desired import (
    REFUSED_DEVICE,
    REFUSED_SIGNATURE,
    REFUSED_UNDECODABLE,
    order_problem,
    trust_problem,
)
from fleet_protocol.messages import (
    AgentPackageRef,
    AgentReported,
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
from fleet_protocol.signing import SignatureError, desired_canonical_bytes, verify
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)

_CALIBRATION_WAIT_S = 30.0
# The same refusal (same reason, same state) is reported by an event at most once in this many seconds:
# a refused retained state comes back on every reconnect. And at most _REFUSAL_EVENTS_MAX refusal events
# in that window whatever they are: a flood of forged states must not fill the outbox (bounded, it
# drops the oldest) and push out detections. Every refusal is logged and counted in ``Twin.refused``.
_REFUSAL_REPEAT_S = 60.0
_REFUSAL_EVENTS_MAX = 20
# How long the twin thread waits for a stopped pool camera's capture thread (one blocked in a network
# read ends by itself when the read times out; the camera is gone from the pipeline either way).
_POOL_STOP_S = 5.0
NOT_CONFIGURED = "camera is not configured on this device"

# Why a desired state is refused as a whole (Event data["reason"]; PROTOCOL.md "What is signed").
# The part name in storage events (edge_agent.core.disk_guard) when desired.json cannot be written.
DESIRED_STATE = "desired_state"


class _Superseded(Exception):
    """A newer desired state took over while this one was applied (its fetch was cancelled)."""


def _read_state(path: Path) -> DesiredState | None:
    """A state file as written, unchecked (for what the store keeps only), or None."""
    try:
        return decode_as(DesiredState, path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ProtocolError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return None


def _models_of(desired: DesiredState | None) -> set[str]:
    """The sha256 of every model ``desired`` names."""
    if desired is None:
        return set()
    return {cd.model.manifest.sha256 for cd in desired.cameras.values() if cd.model is not None}


@dataclass
class _BuildCtx:
    """The load in progress on the twin thread (the only thread that loads models)."""

    camera: str
    model: str
    sha256: str
    variant: str
    last_step: int = -1


class AgentUpdateHooks(Protocol):
    """The twin's view of :class:`edge_agent.update.updater.AgentUpdater`."""

    def want(self, ref: AgentPackageRef | None) -> None: ...

    def reported(self) -> AgentReported: ...


class EngineBuilds:
    """The pipeline's backend factory when the agent chooses backends itself (AutoBackendFactory).

    The twin announces the load it is about to run; a backend made for that model gets the load's
    :class:`LoadRequest` (the variant, where build steps are reported, the camera's frames for INT8
    calibration, the stop event that abandons a build). A later load of the same model without an
    announcement, such as the watchdog reloading a hung model, repeats that request (the same
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
        device_id: str,
        artifact_key: Ed25519PublicKey | None,
        require_signed: bool,
        stop: threading.Event,
        builds: EngineBuilds | None = None,
        agent_update: AgentUpdateHooks | None = None,
        pool: PoolCameras | None = None,
        probes: Callable[[Mapping[str, str]], None] | None = None,
        pool_retry_s: float = 30.0,
    ) -> None:
        """``builds`` None: the pipeline's backends come from elsewhere and report no build steps.
        ``agent_update``: where a taken state's agent version goes, and what the reported state says of
        the agent (edge_agent/update/self_update.py); None: agent updates are not handled. ``pool``:
        how pool cameras are started; None: a desired camera with a source is not run (reported
        failed as a camera this device lacks). ``probes``: given the probe set of each state applied
        (:class:`~edge_agent.control.reach.ReachProbes`); None: no source is probed.
        ``pool_retry_s``: how soon the state in effect is applied again while a pool camera of it could
        not start (a secret added on the device meanwhile is then found). The pipeline's cameras when
        the twin is made are the device's configured ones."""
        self.pipeline = pipeline
        self._pool = pool
        self._probes = probes
        self._configured = frozenset(pipeline.cameras)
        # The pool cameras running: id -> the source the desired state gave (with its references).
        # Read and changed on the twin thread only.
        self._pool_sources: dict[str, str] = {}
        self._pool_retry_s = pool_retry_s
        # When to apply the state in effect again for its pool cameras that could not start; None: none.
        # Twin thread only.
        self._pool_retry_at: float | None = None
        self.publisher = publisher
        self.fetcher = fetcher
        self._publish = publish
        self._path = data_dir / "desired.json"
        # The last state fully in effect (every camera ran what it asked): what a restart serves from
        # the store while a newer desired state is still being fetched or loaded.
        self._applied_path = data_dir / "applied.json"
        # The last state fully in effect before the applied one whose models differ: the models a
        # rollback goes back to, kept in the store.
        self._previous_path = data_dir / "previous.json"
        self._warm: DesiredState | None = None
        self.device_id = device_id
        self.artifact_key = artifact_key
        self._require_signed = require_signed
        self._stop = stop
        self._builds = builds
        self._agent_update = agent_update
        # ``_received_version`` guards ordering; ``applied_version`` is what we report.
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # one writer of desired.json at a time (link thread, retry)
        self.applied_version = -1
        self._received_version = -1
        # The newest state taken (checked; maybe still being applied): what a new one is compared with.
        self._taken: DesiredState | None = None
        self._taken_bytes: bytes | None = None
        self._refusals: dict[tuple[str, bytes], float] = {}  # when each refusal was last reported
        self.refused: dict[str, int] = {}  # refusals per reason, for diagnostics and tests
        self._reported: dict[str, CameraReported] = {c: CameraReported() for c in pipeline.cameras}
        self._slot: LatestSlot[DesiredState] = LatestSlot()
        self._wake = threading.Event()
        # What the store must keep (needed_models), read by the twin thread's collection: the state
        # being applied, and the last two in effect (from disk, unchecked: they only keep files).
        self._applying: DesiredState | None = None
        self._applied: DesiredState | None = _read_state(self._applied_path)
        self._previous: DesiredState | None = _read_state(self._previous_path)
        # The fetch in progress on the twin thread: (sha256, its cancel event), under _lock.
        self._fetching: tuple[str, threading.Event] | None = None
        # report(): a thread publishing the reported state, and whether one more was asked for.
        self._report_lock = threading.Lock()
        self._reporting = False
        self._report_due = False

    # ------------------------------------------------------------------ desired state in

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, DesiredState):
            self.accept(msg, persist=True)

    def accept(self, desired: DesiredState, *, persist: bool) -> bool:
        """Queue ``desired`` for the twin thread if it is this controller's word for this device and
        newer than the state the agent has (a newer one replaces a pending one); ``persist``: write it
        to disk first, after the checks. A refused state changes nothing and is reported by an event."""
        problem = self._trust_problem(desired)
        if problem is not None:
            self._refuse(desired, *problem)
            return False
        try:
            content = desired_canonical_bytes(desired)
        except ValueError as exc:  # only reachable without a key: a signed state has a canonical form
            self._refuse(desired, REFUSED_SIGNATURE, str(exc))
            return False
        cancelled = False
        with self._lock:
            problem = self._order_problem(desired, content)
            if problem is None:
                self._taken, self._taken_bytes = desired, content
                self._received_version = desired.version
                cancelled = self._cancel_unwanted_fetch(desired)
        if problem is None and cancelled:
            self.fetcher.wake()
        if problem is not None:
            if problem[0]:
                self._refuse(desired, *problem)
            else:
                log.debug("ignoring desired version %s: %s", desired.version, problem[1])
            return False
        if persist:
            self._save(desired)
        self._slot.put(desired)
        self._wake.set()
        if self._agent_update is not None:
            # Checked with the whole state (signature, device, order); the package's own signature
            # is checked again by the updater before a byte of it is fetched.
            self._agent_update.want(desired.agent)
        return True

    def _cancel_unwanted_fetch(self, desired: DesiredState) -> bool:
        """Cancel the fetch in progress if ``desired`` (just taken) no longer names its model, so the
        twin thread applies ``desired`` now instead of after the download. Caller holds ``_lock``."""
        if self._fetching is None:
            return False
        sha, cancel = self._fetching
        if sha in _models_of(desired) or cancel.is_set():
            return False
        log.info(
            "desired v%s no longer names %s: its download stops (kept for a resume)",
            desired.version,
            sha[:12],
        )
        cancel.set()
        return True

    def needed_models(self) -> set[str]:
        """The sha256s the models' store must keep: desired, being applied, running, the last state in
        effect and the one before it (a rollback's)."""
        with self._lock:
            states = (self._taken, self._applying, self._warm, self._applied, self._previous)
        needed: set[str] = set()
        for state in states:
            needed |= _models_of(state)
        for cam in self.pipeline.cameras:
            model = self.pipeline.model_of(cam)
            if model is not None:
                needed.add(model.sha256)
        return needed

    def _trust_problem(self, desired: DesiredState) -> tuple[str, str] | None:
        """Why ``desired`` is not the controller's word for this device, as (reason, message), or None.

        With a key: the whole state must carry a valid signature by it and name this device. Without
        one (development; every model is refused anyway unless require_signed_artifacts is off) the
        signature cannot be checked, but a state naming another device is still not for this one.
        """
        return trust_problem(desired, self.artifact_key, self.device_id)

    def _order_problem(self, desired: DesiredState, content: bytes) -> tuple[str, str] | None:
        """Why ``desired`` does not follow the state taken (caller holds the lock), or None.

        (reason, message); reason "" for the state already taken coming again (the retained copy on
        every reconnect), which is ignored without an event.
        """
        return order_problem(desired, content, self._taken, self._taken_bytes, self.applied_version)

    def _refuse(self, desired: DesiredState | None, reason: str, why: str) -> None:
        """Report a desired state refused as a whole; nothing of it is stored or applied."""
        version = desired.version if desired is not None else None
        # The same payload again (a retained forgery on every reconnect) is reported once a minute; a
        # different payload is a new attack even when the reason reads the same.
        what = why.encode()
        if desired is not None:
            what = hashlib.sha256(encode(desired)).digest() + what
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
            have = self._taken.version if self._taken is not None else None
            now = time.monotonic()
            self._refusals = {k: t for k, t in self._refusals.items() if now - t < _REFUSAL_REPEAT_S}
            quiet = (reason, what) in self._refusals or len(self._refusals) >= _REFUSAL_EVENTS_MAX
            if not quiet:
                self._refusals[(reason, what)] = now
        shown = f"v{version}" if version is not None else "a desired state"
        message = f"refused desired state {shown}: {why}; keeps running v{have if have is not None else '-'}"
        if quiet:
            log.debug("%s (repeated)", message)
            return
        log.error("%s", message)
        data: dict[str, Any] = {"check": "desired_state", "reason": reason, "version": version, "have": have}
        if desired is not None:
            data["device_id"] = desired.device_id
            data["key_id"] = desired.key_id
        severity = Severity.ERROR if reason in (REFUSED_SIGNATURE, REFUSED_DEVICE) else Severity.WARNING
        self.publisher.emit_event(EventKind.ERROR, severity=severity, message=message[:4096], data=data)

    def refuse_undecodable(self, why: str) -> None:
        """A payload on the desired topic that is not a valid DesiredState (the link could not decode
        it: a version out of bounds, a malformed field): refused, reported, nothing changes."""
        self._refuse(None, REFUSED_UNDECODABLE, why[:1000])

    def _save(self, desired: DesiredState) -> None:
        # Written before it is applied: an agent restarted offline runs its last desired state. A disk
        # that refuses the write (full, read-only) does not stop this checked state from being applied
        # (the state would otherwise be silently ignored until the disk recovered): the
        # failure is reported by a storage event, and the newest state taken is written once the disk
        # takes writes again, so that a restart offline does not fall back to an older one.
        try:
            with self._save_lock:
                self._write_state(self._path, desired)
        except OSError as exc:
            self.publisher.storage.failed(DESIRED_STATE, self._path, exc, retry=self._save_taken)
        else:
            self.publisher.storage.cleared(DESIRED_STATE)

    def _save_taken(self) -> None:
        """The storage guard's retry: write the newest state taken (OSError while still refused)."""
        with self._save_lock:  # read under it: a save of a newer state cannot be overwritten by this one
            with self._lock:
                desired = self._taken
            if desired is not None:
                self._write_state(self._path, desired)

    def _write_state(self, path: Path, desired: DesiredState) -> None:
        atomic_write(path, encode(desired))

    def load_persisted(self) -> DesiredState | None:
        """The desired state saved on disk, if it still checks out (signature and device, as when it
        came in): a file altered on disk is refused with an event, and the agent waits for the
        controller's retained state instead."""
        return self._load_checked(self._path)

    def load_applied(self) -> DesiredState | None:
        """The last state that was fully in effect (``applied.json``), checked like the desired one."""
        return self._load_checked(self._applied_path)

    def serve_first(self, applied: DesiredState, desired: DesiredState) -> None:
        """Before ``desired`` (restarted mid-swap: fetched or loaded only in part), serve what
        ``applied`` ran from the models already in the store, so the cameras keep their old model
        until the new one is ready, as they did before the restart. Call before :meth:`run` starts."""
        if applied.version < desired.version:
            self._warm = applied

    def _load_checked(self, path: Path) -> DesiredState | None:
        if not path.exists():
            return None
        try:
            state = decode_as(DesiredState, path.read_bytes())
        except (OSError, ProtocolError) as exc:
            log.warning("ignoring unreadable %s: %s", path, exc)
            return None
        problem = self._trust_problem(state)
        if problem is not None:
            self._refuse(state, problem[0], f"{path.name} on disk: {problem[1]}")
            return None
        return state

    # ------------------------------------------------------------------ the twin thread

    def run(self) -> None:
        warm = self._warm
        if warm is not None:
            log.info("serving v%s from the store until the newer desired state is ready", warm.version)
            try:
                self._apply(warm, local_only=True)
            except CudaFatalError:
                return
            except Exception:
                log.exception("serving the last applied state v%s failed", warm.version)
            with self._lock:
                self._warm = None
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            desired = self._slot.take()
            if desired is None:
                desired = self._pool_retry_due()
            if desired is None:
                self._collect()
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

    def _pool_retry_due(self) -> DesiredState | None:
        """The state in effect, when its pool cameras that could not start are due to be tried again."""
        if self._pool_retry_at is None or time.monotonic() < self._pool_retry_at:
            return None
        self._pool_retry_at = None
        with self._lock:
            taken = self._taken
        if taken is None or taken.version != self.applied_version:
            return None  # a newer state is on its way: it is applied anyway
        log.info("trying the pool cameras of v%s that could not start again", taken.version)
        return taken

    def _collect(self) -> None:
        # Between states, on this thread: never while one of its own fetches or loads is under way.
        try:
            self.fetcher.collect_if_due()
        except Exception:
            log.exception("collecting the model store failed")

    def _apply(self, desired: DesiredState, *, local_only: bool = False) -> None:
        """``local_only``: only models already in the store (verified), never a fetch; a camera whose
        model is not there is left as it is."""
        log.info("applying desired state version %s", desired.version)
        with self._lock:
            self._applying = desired
        try:
            if self._probes is not None:
                # First: the probes run on their own thread while this one may fetch and load for
                # minutes. A camera the state gives the device is not probed: its capture says
                # whether it is up.
                self._probes({c: s for c, s in desired.probe.items() if c not in desired.cameras})
            failed = self._apply_pool(desired)
            cameras = [c for c in self.pipeline.cameras if c not in failed]
            for cam_id in sorted(cameras, key=lambda c: self._needs_download(desired, c)):
                if self._stop.is_set():
                    return
                self._apply_camera(cam_id, desired.cameras.get(cam_id), local_only=local_only)
        except _Superseded:
            log.info("desired v%s superseded while it was applied; the newer one follows", desired.version)
            return
        finally:
            with self._lock:
                self._applying = None
        with self._lock:
            for cam_id in desired.cameras:
                if cam_id not in self.pipeline.cameras and cam_id not in failed:
                    self._reported[cam_id] = CameraReported(state="failed", error=NOT_CONFIGURED)
            # A camera that failed in an earlier state and that this one no longer names.
            for cam_id in [c for c in self._reported if c not in desired.cameras]:
                if cam_id not in self.pipeline.cameras:
                    del self._reported[cam_id]
            self.applied_version = max(self.applied_version, desired.version)
        self.report()
        # After the report: the controller hears of the version without waiting for this disk write.
        if not local_only and self._in_effect(desired):
            self._save_applied(desired)

    def _apply_pool(self, desired: DesiredState) -> set[str]:
        """Run the pool cameras ``desired`` names, before their models are applied: the ones it no
        longer names (or names with another source) stopped, the new ones started. Returns the
        cameras that cannot run, reported failed here; the others are left to the model apply. One
        that failed for a reason the device can mend (a secret, its file) schedules a retry."""
        self._pool_retry_at = None
        for cam, source in sorted(self._pool_sources.items()):
            cd = desired.cameras.get(cam)
            if cd is not None and cd.source == source:
                worker = self.pipeline.cameras.get(cam)
                if worker is not None and worker.config.max_fps != cd.max_fps:
                    worker.set_max_fps(cd.max_fps)
                continue
            self._stop_pool_camera(cam)
            if cd is None:
                with self._lock:
                    self._reported.pop(cam, None)
        failed: set[str] = set()
        for cam, cd in sorted(desired.cameras.items()):
            if cd.source is None or cam in self._pool_sources:
                continue
            if cam in self._configured:
                problem = (
                    f"camera {cam} is configured on this device; a pool camera never replaces one "
                    f"(source {cd.source} not opened)"
                )
            elif self._pool is None:
                continue  # reported as a camera this device lacks
            else:
                try:
                    config = self._pool.config(cam, cd)
                except PoolCameraError as exc:
                    problem = str(exc)
                else:
                    self.pipeline.add_camera(self._pool.worker(config))
                    self._pool_sources[cam] = cd.source
                    log.info("pool camera %s started from %s", cam, cd.source)
                    continue
            log.error("pool camera %s cannot run: %s", cam, problem)
            failed.add(cam)
            if cam not in self._configured and self._pool is not None:
                # A secret may be added on the device: tried again without a new state.
                self._pool_retry_at = time.monotonic() + self._pool_retry_s
            self.set_reported(cam, CameraReported(state="failed", error=problem[:1000]), publish=False)
        return failed

    def _stop_pool_camera(self, cam: str) -> None:
        """Stop pool camera ``cam``: its model cleared, its capture closed."""
        del self._pool_sources[cam]
        self.pipeline.remove_camera(cam, _POOL_STOP_S)
        if self._pool is not None:
            self._pool.removed(cam)
        log.info("pool camera %s stopped", cam)

    def _needs_download(self, desired: DesiredState, cam: str) -> bool:
        """Whether ``cam``'s model in ``desired`` is neither running nor in the store (sort key: the
        cameras that need no download are applied first)."""
        cd = desired.cameras.get(cam)
        if cd is None or cd.model is None:
            return False
        sha = cd.model.manifest.sha256
        return self.pipeline.loaded(sha) is None and not self.fetcher.has(sha)

    def _in_effect(self, desired: DesiredState) -> bool:
        """Whether every camera runs exactly the model ``desired`` asks of it (none where none), and
        every pool camera it names runs from its source."""
        for cam_id, wanted in desired.cameras.items():
            if wanted.source is not None and self._pool_sources.get(cam_id) != wanted.source:
                return False
        for cam_id in self.pipeline.cameras:
            cd = desired.cameras.get(cam_id)
            running = self.pipeline.model_of(cam_id)
            want = cd.model.manifest.sha256 if cd is not None and cd.model is not None else None
            if (running.sha256 if running is not None else None) != want:
                return False
        return True

    def _save_applied(self, desired: DesiredState) -> None:
        # Best effort: without it a restart mid-swap only runs nothing until the new model is ready.
        try:
            with self._save_lock:
                with self._lock:
                    before = self._applied
                if before is not None and _models_of(before) != _models_of(desired):
                    self._write_state(self._previous_path, before)
                    with self._lock:
                        self._previous = before
                self._write_state(self._applied_path, desired)
                with self._lock:
                    self._applied = desired
        except OSError as exc:
            log.warning("could not save %s: %s", self._applied_path.name, exc)

    def _apply_camera(self, cam: str, cd: CameraDesired | None, *, local_only: bool = False) -> None:
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
            label_thresholds=dict(cd.label_thresholds or {}),
            min_box_area=cd.min_box_area or 0.0,
            zones=tuple(cd.zones or ()),
            lines=tuple(cd.lines or ()),
        )
        # Before anything else, even for the model already running: a ref that does not check out
        # is not the controller's word, so nothing of it is fetched, loaded or applied.
        refused = self._signature_problem(ref)
        if refused is not None:
            self._model_failed(cam, key, manifest.sha256, current, refused, check="signature")
            return
        # The motion gate is the camera's, not the model's: set before a load, so the new model's first
        # frames are gated as the state says.
        self.pipeline.set_motion(cam, cd.motion)
        if current is not None and current.sha256 == manifest.sha256 and current.manifest == manifest:
            self.pipeline.set_params(cam, params)
            self.set_reported(cam, self.running_report(cam, current), publish=False)
            return
        if local_only and not self.fetcher.path_for(manifest.sha256).exists():
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
            if self._stop.is_set():
                return
            raise _Superseded from None
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
        self.set_reported(cam, self.running_report(cam, model))

    def running_report(self, cam: str, model: LoadedModel) -> CameraReported:
        """``cam`` running ``model``, with the settings the pipeline applies to it now."""
        return CameraReported(model=model.key, sha256=model.sha256, state="running", **self._settings_of(cam))

    def _settings_of(self, cam: str) -> dict[str, Any]:
        params = self.pipeline.params_of(cam)
        if params is None:
            return {}
        return {
            "threshold": params.threshold,
            "max_fps": params.max_fps,
            "labels": sorted(params.labels) if params.labels is not None else None,
            # Always reported, {} and 0.0 when none: the controller tells this agent from one
            # before these settings by them.
            "label_thresholds": dict(sorted(params.label_thresholds.items())),
            "min_box_area": params.min_box_area,
            "zones": list(params.zones),
            "lines": list(params.lines),
            "motion": self.pipeline.motion_of(cam),
        }

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

        cancel = threading.Event()
        with self._lock:
            if sha not in _models_of(self._taken):
                raise _Superseded  # a newer state came before this fetch could start
            self._fetching = (sha, cancel)
        try:
            path = self.fetcher.fetch(ref, self._stop, progress, cancel=cancel)
        finally:
            with self._lock:
                self._fetching = None
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
        agent = self._agent_update.reported() if self._agent_update is not None else None
        with self._lock:
            return ReportedState(
                ts=time.time(),
                desired_version=max(0, self.applied_version),
                cameras=dict(self._reported),
                agent_version=__version__,
                agent=agent,
            )

    def report(self) -> None:
        """Publish the reported state as it is now.

        Called from several threads (this one, the link's at each connect, the updater's). One thread
        publishes at a time and, before it stops, again while a report was asked for meanwhile: each
        state is built right before its publish, so the last one published (and retained by the
        broker) is the newest, never an older one built first and published last. A caller that finds
        a publish under way returns at once: its state goes out with the next one.
        """
        with self._report_lock:
            self._report_due = True
            if self._reporting:
                return
            self._reporting = True
        try:
            while True:
                with self._report_lock:
                    if not self._report_due:
                        # In the same hold as the check: a report asked for after it finds none
                        # under way and publishes itself.
                        self._reporting = False
                        return
                    self._report_due = False
                self._publish(TopicKind.TWIN_REPORTED, encode(self.reported_state()))
        except BaseException:
            with self._report_lock:
                self._reporting = False
            raise

    def report_failed(
        self, camera: str, model: LoadedModel | None, reason: str, *, publish: bool = True
    ) -> None:
        """The camera is failed, still naming the model it has (None: none)."""
        rep = CameraReported(
            model=model.key if model else None,
            sha256=model.sha256 if model else None,
            state="failed",
            error=reason[:1000],
            **(self._settings_of(camera) if model else {}),
        )
        self.set_reported(camera, rep, publish=publish)

    def set_reported(self, camera: str, rep: CameraReported, *, publish: bool = True) -> None:
        with self._lock:
            self._reported[camera] = rep
        if publish:
            self.report()
