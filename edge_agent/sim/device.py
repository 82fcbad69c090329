"""One simulated device without its transport: what it says and how it takes what it is told.

``SimDevice`` speaks PROTOCOL.md as the agent does, without cameras or models, deterministically (every
figure follows from the device's index, its settings and how many batches and heartbeats it made):

- a birth with capabilities (4 CPU cores, no GPU) and agent version; events and command results;
- desired states taken as the agent takes them (signature and device checked when a key is given, then
  version and issue time) and reported as applied, each camera ``running`` the desired model with the
  settings in effect; no artifact is fetched and nothing is inferred;
- pool cameras (PROTOCOL.md "Pool cameras"): a desired camera with a ``source`` that is not one of its
  own starts at that apply (a ``camera_up`` event, or ``camera_down`` when the source is unreachable)
  and runs its model like its own cameras; one that a later state no longer names, or names with
  another source, stops (``camera_down``) and leaves the reported state. One that reuses an own
  camera's id, or a scheme the agent cannot open, is reported ``failed``. Every ``{secret:NAME}`` is
  taken as present on the device. A pool camera is not kept across a restart: the retained desired
  state brings it back;
- reachability: ``Heartbeat.reach`` says, for every ``probe`` camera of the state applied last,
  whether the device reaches its source: always, unless its host matches one of the device's
  ``unreachable`` patterns (shell globs, e.g. ``10.0.9.*``; a ``file://`` source has no host, so only
  ``*`` matches it). A pool camera it runs from such a source is down: no frames, no detections;
- frames: each camera that is up runs at its rate, ``min(max_fps, source_fps)`` (``source_fps`` with no
  cap; by default ``FRAMES_PER_BATCH`` a batch period), counted per batch period (``batch_s``); a ``DetectionBatch`` per period carries, per camera,
  the period's frames up to ``FRAMES_PER_BATCH`` (a sample, so that a simulated fleet's ingest load is
  set by ``batch_s`` and its cameras, not by their frame rates), 0 to 3 plausible boxes each,
  deterministic from the seq. A camera with no model still "sees" ``DEFAULT_LABELS`` under the
  model name ``simulated``, so a fleet with no desired state sends detections;
- heartbeats as the placement planner and the device views read them: per camera ``fps``, ``frames``,
  ``inference_ms``/``inference_p99_ms`` of its model, ``decode_ms``, ``source_fps`` (while up) and
  ``last_inferred_at`` (the last batch period in which it had a frame); per model variant that runs and
  has done a frame, a ``VariantCost``: ``infer_ms`` is the device's own cost (``infer_ms``, the same
  for every variant) within ``COST_JITTER`` of it, ``cpu_ms`` ``CPU_PER_INFER`` times that (one
  inference thread plus preprocessing and decoding), ``busy`` the sum of its cameras' rate x infer_ms
  over one lane's second (none on the first heartbeat, as the agent's) and ``frames`` the frames it
  did since it was loaded; ``cpu_pct`` follows the same figures plus decoding over 4 cores.
  ``frames_skipped`` (no motion gate is simulated) and ``occupancy`` (no zone is counted) are never
  reported: both stay absent, as from an agent whose cameras have neither.

No sockets here: ``loop.py`` carries the messages.
"""

from __future__ import annotations

import logging
import math
import platform
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent import __version__
from edge_agent.sim.outbox import SimOutbox
from fleet_protocol.codec import encode
from fleet_protocol.desired import (
    REFUSED_DEVICE,
    REFUSED_SIGNATURE,
    REFUSED_UNDECODABLE,
    order_problem,
    trust_problem,
)
from fleet_protocol.messages import (
    MAX_CAMERAS,
    Availability,
    Box,
    CameraDesired,
    CameraReported,
    CameraState,
    CameraStats,
    Capabilities,
    Command,
    CommandName,
    CommandResult,
    DesiredState,
    Detection,
    DetectionBatch,
    Event,
    EventKind,
    FrameDetections,
    Heartbeat,
    ReportedState,
    Severity,
    VariantCost,
)
from fleet_protocol.signing import SignatureError, desired_canonical_bytes, verify
from fleet_protocol.sources import SOURCE_SCHEMES
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)


SIM_AGENT_VERSION = f"{__version__}-sim"
FRAME_WIDTH, FRAME_HEIGHT = 1280, 720
FRAMES_PER_BATCH = 2  # at most, per camera and batch
DEFAULT_LABELS = ("person", "car", "bicycle")  # a camera that runs no model still "sees" these
CPU_COUNT = 4  # what the birth says, and what cpu_pct is a share of

# A device's costs unless told otherwise (SimConfig takes its defaults from these).
DEFAULT_INFER_MS = 12.0
DEFAULT_DECODE_MS = 3.0
# Each reported figure lies within this share of the device's own, drawn from (device, variant or
# camera, heartbeat): noise that a planner must not move cameras for, the same on every run.
COST_JITTER = 0.03
CPU_PER_INFER = 1.2  # CPU ms per lane ms: the run on one thread, plus preprocessing and decoding
P99_PER_MEDIAN = 1.5

NOT_CONFIGURED = "camera is not configured on this device"

# What SimDevice.on_desired returns besides a refusal reason.
APPLIED = "applied"
IGNORED = "ignored"  # the retained copy of the state already taken

# An 8 x 8 grey JPEG (cv2.imencode, quality 50): what a simulated camera shows in a snapshot.
SIM_SNAPSHOT_JPEG_B64 = (
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDABALDA4MChAODQ4SERATGCgaGBYWGDEjJR0oOjM9PDkzODdASFxOQERXRTc4UG1R"
    "V19iZ2hnPk1xeXBkeFxlZ2P/2wBDARESEhgVGC8aGi9jQjhCY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2Nj"
    "Y2NjY2NjY2NjY2NjY2P/wAARCAAIAAgDASIAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAA"
    "AgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRolJicoKSo0NTY3ODk6"
    "Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXG"
    "x8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREA"
    "AgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5"
    "OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPE"
    "xcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwAooooA/9k="
)


@dataclass(frozen=True, slots=True)
class _RunningModel:
    """What a camera runs now: the model key and the settings in effect."""

    model: str  # "name:version", as reported
    variant: str  # "name/version", as costs are keyed
    sha256: str
    labels: tuple[str, ...]  # the labels it reports (the model's, after the desired filter)
    all_labels: tuple[str, ...]  # the model's labels (class ids are indices here)
    threshold: float
    max_fps: float | None
    label_filter: list[str] | None


@dataclass(slots=True)
class _Camera:
    """A camera the device runs: one of its own (``source`` None) or a pool camera."""

    source: str | None
    up: bool = True  # its source delivers (a pool camera's source may be unreachable)
    frames: int = 0
    clock: float = 0.0  # the frames it would have done so far at its rate, a fraction included
    last_inferred_at: float | None = None


def _jitter(*key: object) -> float:
    """A factor within COST_JITTER of 1, the same for the same key on every run."""
    rng = random.Random("/".join(str(k) for k in key))  # a str seed: not salted per process as hash()
    return rng.uniform(1.0 - COST_JITTER, 1.0 + COST_JITTER)


class SimDevice:
    """A simulated device without its transport: outbox, twin, messages. Tested without a broker.

    ``cameras``: its own cameras (always up). ``public_key``: check desired states and model refs
    against it as the agent does; None accepts them unchecked (only a state naming another device is
    refused). ``infer_ms``, ``decode_ms``: what one frame costs here, on the inference lane and in the
    capture thread. ``source_fps``: the rate every source delivers (None: ``FRAMES_PER_BATCH`` a batch
    period, so that every period carries a full batch, as a fleet sized by ``batch_s`` expects). ``unreachable``: shell globs of the
    source hosts this device does not reach (probed or run).
    """

    def __init__(
        self,
        device_id: str,
        index: int,
        *,
        cameras: Sequence[str] = ("cam1",),
        outbox: SimOutbox | None = None,
        public_key: Ed25519PublicKey | None = None,
        batch_s: float = 1.0,
        cpu_flags: list[str] | None = None,
        infer_ms: float = DEFAULT_INFER_MS,
        decode_ms: float = DEFAULT_DECODE_MS,
        source_fps: float | None = None,
        unreachable: Sequence[str] = (),
    ) -> None:
        self.device_id = device_id
        self.index = index
        self.cameras = list(cameras)
        self.outbox = outbox if outbox is not None else SimOutbox()  # an empty one is falsy (len 0)
        self.public_key = public_key
        self.batch_s = batch_s
        self.cpu_flags = cpu_flags
        self.infer_ms = infer_ms
        self.decode_ms = decode_ms
        self.source_fps = source_fps if source_fps is not None else FRAMES_PER_BATCH / batch_s
        self.unreachable = tuple(p.lower() for p in unreachable)  # hosts compare lowercased
        self.taken: DesiredState | None = None
        self._taken_bytes: bytes | None = None
        self.applied_version = 0
        self.applied_versions: list[int] = []
        self.refused: Counter[str] = Counter()
        self._refusals_reported: set[tuple[str, int | None]] = set()
        # Its own cameras first, then the pool cameras in the order they started.
        self._cams: dict[str, _Camera] = {c: _Camera(None) for c in self.cameras}
        self._running: dict[str, _RunningModel | None] = dict.fromkeys(self.cameras)
        self._reported: dict[str, CameraReported] = {c: CameraReported() for c in self.cameras}
        self._variant_frames: dict[str, int] = {}  # frames per variant since it was loaded
        self._probes: dict[str, str] = {}  # the applied state's probe cameras it does not run
        self.batches = 0
        self.heartbeats = 0

    # ------------------------------------------------------------------ what it runs

    @property
    def running_cameras(self) -> list[str]:
        """Every camera it runs: its own, then the pool cameras."""
        return list(self._cams)

    @property
    def pool_cameras(self) -> dict[str, str]:
        """The pool cameras it runs, with the source each was started from."""
        return {c: cam.source for c, cam in self._cams.items() if cam.source is not None}

    def frames(self, camera: str) -> int:
        """The frames ``camera`` has done since it started (0 for a camera it does not run)."""
        cam = self._cams.get(camera)
        return cam.frames if cam is not None else 0

    def reaches(self, source: str) -> bool:
        """Whether this device reaches ``source``: a scheme the agent opens, and a host that no
        ``unreachable`` pattern matches."""
        scheme = source.split("://", 1)[0].lower() if "://" in source else ""
        if scheme not in SOURCE_SCHEMES:
            return False
        try:
            host = urlsplit(source).hostname or ""
        except ValueError:
            return False
        return not any(fnmatchcase(host, p) for p in self.unreachable)

    def rate(self, camera: str) -> float:
        """Frames a second ``camera`` runs at: 0 while down, else its source's rate under its cap."""
        cam = self._cams.get(camera)
        if cam is None or not cam.up:
            return 0.0
        run = self._running.get(camera)
        cap = run.max_fps if run is not None else None
        return self.source_fps if cap is None else min(cap, self.source_fps)

    # ------------------------------------------------------------------ produced messages

    def birth(self, now_wall: float) -> Availability:
        caps = Capabilities(
            hostname=f"{self.device_id}.sim",
            os=f"{platform.system()} (simulated)",
            arch=platform.machine(),
            cpu_model="edgefleet simulator",
            cpu_count=CPU_COUNT,
            memory_total_mb=8192.0,
            execution_providers=["CPUExecutionProvider"],
            cameras=self.cameras,
            cpu_flags=self.cpu_flags,
        )
        return Availability(state="online", ts=now_wall, agent_version=SIM_AGENT_VERSION, capabilities=caps)

    def produce_batch(self, now_wall: float) -> int | None:
        """One batch period: every camera that is up does its frames; number and keep the period's
        DetectionBatch. None when no camera had a frame, or the outbox is full."""
        done = self._run_period(now_wall)
        if not done:
            return None
        seq = self.outbox.add(TopicKind.DETECTIONS, lambda s: encode(self.detection_batch(s, now_wall, done)))
        if seq is not None:
            self.batches += 1
        return seq

    def _run_period(self, now_wall: float) -> dict[str, int]:
        """Advance every camera by one batch period; the frames each did."""
        done: dict[str, int] = {}
        for cam_id, cam in self._cams.items():
            rate = self.rate(cam_id)
            if rate <= 0:
                continue
            cam.clock += rate * self.batch_s
            n = math.floor(cam.clock + 1e-9) - cam.frames  # the epsilon: 0.1 x 10 periods is 1 frame
            if n <= 0:
                continue
            cam.frames += n
            cam.last_inferred_at = now_wall
            done[cam_id] = n
            run = self._running.get(cam_id)
            if run is not None:
                self._variant_frames[run.variant] = self._variant_frames.get(run.variant, 0) + n
        return done

    def detection_batch(
        self, seq: int, now_wall: float, done: Mapping[str, int] | None = None
    ) -> DetectionBatch:
        """Batch ``seq``: per camera min(its frames ``done`` this period, FRAMES_PER_BATCH) frames (with
        ``done`` None: FRAMES_PER_BATCH per camera that is up), 0 to 3 boxes each; everything but the
        timestamps follows from (device index, seq) and what the cameras run."""
        rng = random.Random((self.index << 40) ^ seq)
        frames: list[FrameDetections] = []
        for cam, state in self._cams.items():
            n_frames = (FRAMES_PER_BATCH if state.up else 0) if done is None else done.get(cam, 0)
            n_frames = min(n_frames, FRAMES_PER_BATCH)
            run = self._running.get(cam)
            labels = run.labels if run is not None else DEFAULT_LABELS
            all_labels = run.all_labels if run is not None else DEFAULT_LABELS
            threshold = run.threshold if run is not None else 0.5
            model = run.model if run is not None else "simulated"
            for k in range(n_frames):
                n = rng.randint(0, 3) if labels else 0
                dets: list[Detection] = []
                slot_w = FRAME_WIDTH / max(n, 1)
                for i in range(n):
                    label = labels[rng.randrange(len(labels))]
                    w = rng.uniform(40.0, slot_w * 0.8)
                    h = rng.uniform(60.0, FRAME_HEIGHT * 0.6)
                    x0 = i * slot_w + rng.uniform(0.0, slot_w - w)  # one box per slot: never two alike
                    y0 = rng.uniform(0.0, FRAME_HEIGHT - h)
                    dets.append(
                        Detection(
                            label=label,
                            class_id=all_labels.index(label),
                            score=round(rng.uniform(threshold, 1.0), 3),
                            box=Box(
                                x0=round(x0, 1), y0=round(y0, 1), x1=round(x0 + w, 1), y1=round(y0 + h, 1)
                            ),
                        )
                    )
                frames.append(
                    FrameDetections(
                        camera=cam,
                        frame=(seq - 1) * FRAMES_PER_BATCH + k,
                        captured_at=now_wall - (n_frames - 1 - k) * self.batch_s / FRAMES_PER_BATCH,
                        width=FRAME_WIDTH,
                        height=FRAME_HEIGHT,
                        model=model,
                        inference_ms=round(self.infer_ms * rng.uniform(1 - COST_JITTER, 1 + COST_JITTER), 2),
                        detections=dets,
                    )
                )
        return DetectionBatch(seq=seq, sent_at=now_wall, frames=frames)

    def heartbeat(self, now_wall: float, uptime_s: float) -> Heartbeat:
        first = self.heartbeats == 0
        self.heartbeats += 1
        beat = self.heartbeats
        rng = random.Random((self.index << 20) ^ beat)
        # Per variant that runs: this heartbeat's lane ms a frame, and its lane ms a second.
        infer: dict[str, float] = {}
        lane: dict[str, float] = {}
        cams: list[CameraStats] = []
        cpu_ms_per_s = 0.0
        for cam_id, cam in self._cams.items():
            run = self._running.get(cam_id)
            rate = self.rate(cam_id)
            ms: float | None = None
            if run is not None:
                ms = infer.setdefault(run.variant, self.infer_ms * _jitter(self.index, run.variant, beat))
                lane[run.variant] = lane.get(run.variant, 0.0) + rate * ms
            decode = round(self.decode_ms * _jitter(self.index, cam_id, beat), 3) if cam.up else None
            cpu_ms_per_s += rate * ((ms or 0.0) * CPU_PER_INFER + (decode or 0.0))
            measured = ms is not None and cam.frames > 0
            cams.append(
                CameraStats(
                    camera=cam_id,
                    state=CameraState.UP if cam.up else CameraState.DOWN,
                    fps=round(rate, 2) if cam.frames > 0 else 0.0,
                    frames=cam.frames,
                    inference_ms=round(ms, 2) if measured and ms is not None else None,
                    inference_p99_ms=round(ms * P99_PER_MEDIAN, 2) if measured and ms is not None else None,
                    model=run.model if run is not None else None,
                    decode_ms=decode,
                    source_fps=self.source_fps if cam.up else None,
                    last_inferred_at=cam.last_inferred_at,
                )
            )
        costs = [
            VariantCost(
                variant=v,
                infer_ms=round(ms, 3),
                cpu_ms=round(ms * CPU_PER_INFER, 3),
                busy=None if first else round(min(1.0, lane[v] / 1000.0), 4),  # one lane
                frames=self._variant_frames[v],
            )
            for v, ms in sorted(infer.items())
            if self._variant_frames.get(v, 0) > 0
        ]
        medians = [c.inference_ms for c in cams if c.inference_ms is not None]
        p99s = [c.inference_p99_ms for c in cams if c.inference_p99_ms is not None]
        load_pct = 100.0 * cpu_ms_per_s / (CPU_COUNT * 1000.0)
        return Heartbeat(
            ts=now_wall,
            uptime_s=round(uptime_s, 1),
            cpu_pct=round(min(100.0, rng.uniform(3.0, 8.0) + load_pct), 1),
            memory_pct=round(rng.uniform(30.0, 50.0), 1),
            memory_used_mb=3200.0,
            disk_free_mb=50_000.0,
            disk_pct=40.0,
            cameras=cams,
            inference_ms=max(medians) if medians else None,
            inference_p99_ms=max(p99s) if p99s else None,
            outbox_pending=len(self.outbox),
            outbox_dropped=0,
            queue_dropped=0,
            costs=costs,
            reach={c: self.reaches(source) for c, source in sorted(self._probes.items())},
        )

    def reported_state(self, now_wall: float) -> ReportedState:
        return ReportedState(
            ts=now_wall,
            desired_version=self.applied_version,
            cameras=dict(self._reported),
            agent_version=SIM_AGENT_VERSION,
        )

    def emit_event(
        self,
        kind: EventKind,
        now_wall: float,
        *,
        message: str = "",
        camera: str | None = None,
        severity: Severity = Severity.INFO,
        data: dict[str, Any] | None = None,
    ) -> int | None:
        """An event through the outbox (the same seq space as the detection batches)."""
        event = Event(
            seq=1,
            ts=now_wall,
            kind=kind,
            severity=severity,
            camera=camera,
            message=message[:4096],
            data=data or {},
        )
        return self.outbox.add(TopicKind.EVENTS, lambda s: encode(event.model_copy(update={"seq": s})))

    def run_command(self, cmd: Command) -> CommandResult:
        if cmd.name == CommandName.DIAGNOSTICS:
            return CommandResult(
                id=cmd.id,
                ok=True,
                result={
                    "simulated": True,
                    "agent_version": SIM_AGENT_VERSION,
                    "outbox_pending": len(self.outbox),
                    "desired_version": self.applied_version,
                },
            )
        if cmd.name == CommandName.RESTART_PIPELINE:
            return CommandResult(id=cmd.id, ok=True, result={"simulated": True})
        if cmd.name == CommandName.SNAPSHOT:
            camera = str(cmd.args.get("camera", ""))
            if camera not in self._cams:
                return CommandResult(id=cmd.id, ok=False, error=f"unknown camera {camera!r}")
            # A real (8 x 8 grey) JPEG, so that the controller's snapshot path runs end to end.
            return CommandResult(
                id=cmd.id,
                ok=True,
                result={
                    "camera": camera,
                    "frame": 0,
                    "captured_at": time.time(),
                    "width": 8,
                    "height": 8,
                    "boxes": 0,
                    "jpeg_base64": SIM_SNAPSHOT_JPEG_B64,
                    "simulated": True,
                },
            )
        return CommandResult(id=cmd.id, ok=False, error=f"a simulated device cannot {cmd.name.value}")

    # ------------------------------------------------------------------ desired state in

    def on_desired(self, state: DesiredState, now_wall: float) -> str:
        """Take ``state`` as the agent would: APPLIED, IGNORED (the retained copy of the state it has)
        or the reason it was refused as a whole (nothing of it applied, an error event sent)."""
        problem = trust_problem(state, self.public_key, self.device_id)
        if problem is not None:
            return self._refuse(state, *problem, now_wall=now_wall)
        try:
            content = desired_canonical_bytes(state)
        except ValueError as exc:
            return self._refuse(state, REFUSED_SIGNATURE, str(exc), now_wall=now_wall)
        problem = order_problem(state, content, self.taken, self._taken_bytes)
        if problem is not None:
            return self._refuse(state, *problem, now_wall=now_wall) if problem[0] else IGNORED
        self.taken, self._taken_bytes = state, content
        self._apply(state, now_wall)
        return APPLIED

    def refuse_undecodable(self, why: str, now_wall: float) -> str:
        return self._refuse(None, REFUSED_UNDECODABLE, why[:1000], now_wall=now_wall)

    def _refuse(self, state: DesiredState | None, reason: str, why: str, *, now_wall: float) -> str:
        self.refused[reason] += 1
        version = state.version if state is not None else None
        log.debug("%s refused desired state v%s: %s", self.device_id, version, why)
        key = (reason, version)
        if key not in self._refusals_reported and len(self._refusals_reported) < 100:
            self._refusals_reported.add(key)  # one event per reason and version, as the agent rate-limits
            have = self.taken.version if self.taken is not None else None
            severity = Severity.ERROR if reason in (REFUSED_SIGNATURE, REFUSED_DEVICE) else Severity.WARNING
            self.emit_event(
                EventKind.ERROR,
                now_wall,
                severity=severity,
                message=f"refused desired state v{version}: {why}",
                data={"check": "desired_state", "reason": reason, "version": version, "have": have},
            )
        return reason

    def _apply(self, state: DesiredState, now_wall: float) -> None:
        # As the agent: the pool cameras first (started, stopped), then every camera's model.
        failed = self._apply_pool(state, now_wall)
        for cam in self.running_cameras:
            if cam not in failed:  # an own camera that a pool camera tried to replace keeps its model
                self._apply_camera(cam, state.cameras.get(cam), now_wall)
        for cam in state.cameras:
            if cam not in self._cams and cam not in failed:
                self._reported[cam] = CameraReported(state="failed", error=NOT_CONFIGURED)
        # A camera that failed in an earlier state and that this one no longer names.
        for cam in [c for c in self._reported if c not in self._cams and c not in state.cameras]:
            del self._reported[cam]
        running = {r.variant for r in self._running.values() if r is not None}
        # A variant no camera runs any more is unloaded: loaded again, it is measured afresh.
        self._variant_frames = {v: n for v, n in self._variant_frames.items() if v in running}
        # A camera the state gives the device is not probed: its own state says whether it is up.
        self._probes = {c: s for c, s in state.probe.items() if c not in state.cameras}
        self.applied_version = state.version
        self.applied_versions.append(state.version)

    def _apply_pool(self, state: DesiredState, now_wall: float) -> set[str]:
        """Stop the pool cameras ``state`` no longer names (or names with another source), start the
        new ones; the cameras that cannot run, reported failed here."""
        for cam, source in self.pool_cameras.items():
            cd = state.cameras.get(cam)
            if cd is None or cd.source != source:
                self._stop_pool_camera(cam, now_wall)
        failed: set[str] = set()
        for cam, cd in sorted(state.cameras.items()):
            if cd.source is None or cam in self.pool_cameras:
                continue
            problem = self._start_pool_camera(cam, cd.source, now_wall)
            if problem is not None:
                log.debug("%s: pool camera %s cannot run: %s", self.device_id, cam, problem)
                failed.add(cam)
                self._reported[cam] = CameraReported(state="failed", error=problem[:1000])
        return failed

    def _start_pool_camera(self, cam: str, source: str, now_wall: float) -> str | None:
        """Start pool camera ``cam`` from ``source``; why it cannot run, or None."""
        if cam in self._cams:
            return (
                f"camera {cam} is configured on this device; a pool camera never replaces one "
                f"(source {source} not opened)"
            )
        scheme = source.split("://", 1)[0].lower() if "://" in source else ""
        if scheme not in SOURCE_SCHEMES:
            opens = ", ".join(f"{s}://" for s in SOURCE_SCHEMES)
            return f"source {source} cannot be opened on this device (it opens {opens})"
        if len(self._cams) >= MAX_CAMERAS:
            return f"this device runs {MAX_CAMERAS} cameras at most"
        up = self.reaches(source)
        self._cams[cam] = _Camera(source, up=up)
        self._running[cam] = None
        self._reported[cam] = CameraReported()
        if up:
            message = f"pool camera started from {source} (simulated)"
            self.emit_event(EventKind.CAMERA_UP, now_wall, camera=cam, message=message)
        else:
            self._camera_down(cam, now_wall, "unreachable", f"{source} not reached (simulated)")
        return None

    def _stop_pool_camera(self, cam: str, now_wall: float) -> None:
        del self._cams[cam]
        self._running.pop(cam, None)
        self._reported.pop(cam, None)
        self._camera_down(cam, now_wall, "stopped", "pool camera stopped (simulated)")

    def _camera_down(self, cam: str, now_wall: float, reason: str, message: str) -> None:
        self.emit_event(
            EventKind.CAMERA_DOWN,
            now_wall,
            camera=cam,
            severity=Severity.WARNING,
            message=f"pool camera {cam}: {message}",
            data={"reason": reason},
        )

    def _apply_camera(self, cam: str, cd: CameraDesired | None, now_wall: float) -> None:
        current = self._running.get(cam)
        if cd is None or cd.model is None:
            self._running[cam] = None
            self._reported[cam] = CameraReported(state="idle")
            return
        ref = cd.model
        manifest = ref.manifest
        key = f"{manifest.name}:{manifest.version}"
        if self.public_key is not None:
            try:
                verify(ref, self.public_key)
            except SignatureError as exc:
                reason = f"refused {key}: {exc}"
                self.emit_event(
                    EventKind.MODEL_FAILED,
                    now_wall,
                    camera=cam,
                    severity=Severity.ERROR,
                    message=reason,
                    data={"model": key, "sha256": manifest.sha256, "check": "signature"},
                )
                self._reported[cam] = CameraReported(
                    model=current.model if current else None,
                    sha256=current.sha256 if current else None,
                    state="failed",
                    error=reason[:1000],
                    **(self._settings(current) if current else {}),
                )
                return
        wanted = tuple(cd.labels) if cd.labels is not None else None
        run = _RunningModel(
            model=key,
            variant=f"{manifest.name}/{manifest.version}",
            sha256=manifest.sha256,
            labels=tuple(x for x in manifest.labels if wanted is None or x in wanted),
            all_labels=tuple(manifest.labels),
            threshold=cd.threshold if cd.threshold is not None else manifest.default_threshold,
            max_fps=cd.max_fps,
            label_filter=sorted(set(cd.labels)) if cd.labels is not None else None,
        )
        self._running[cam] = run
        self._reported[cam] = CameraReported(
            model=key, sha256=manifest.sha256, state="running", **self._settings(run)
        )
        if current is None or current.sha256 != run.sha256:
            self.emit_event(
                EventKind.MODEL_ACTIVATE,
                now_wall,
                camera=cam,
                message=f"{key} active (simulated)",
                data={"model": key, "sha256": manifest.sha256, "provider": "simulated"},
            )

    @staticmethod
    def _settings(run: _RunningModel) -> dict[str, Any]:
        return {"threshold": run.threshold, "max_fps": run.max_fps, "labels": run.label_filter}
