"""One simulated device without its transport: what it says and how it takes what it is told.

``SimDevice`` speaks PROTOCOL.md as the agent does, without cameras or models: a birth with
capabilities and agent version, heartbeats, one ``DetectionBatch`` per period (a few plausible boxes
per frame, deterministic from the seq), events, command results, and desired states taken as the agent
takes them (signature and device checked when a key is given, then version and issue time) and
reported as applied, each camera ``running`` the desired model with the settings in effect. No
artifact is fetched and nothing is inferred. No sockets here: ``loop.py`` carries the messages.
"""

from __future__ import annotations

import logging
import platform
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    Availability,
    Box,
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
)
from fleet_protocol.signing import SignatureError, desired_canonical_bytes, verify
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)


SIM_AGENT_VERSION = f"{__version__}-sim"
FRAME_WIDTH, FRAME_HEIGHT = 1280, 720
FRAMES_PER_BATCH = 2  # per camera and batch
DEFAULT_LABELS = ("person", "car", "bicycle")  # a camera that runs no model still "sees" these

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

    model: str
    sha256: str
    labels: tuple[str, ...]  # the labels it reports (the model's, after the desired filter)
    all_labels: tuple[str, ...]  # the model's labels (class ids are indices here)
    threshold: float
    max_fps: float | None
    label_filter: list[str] | None


class SimDevice:
    """A simulated device without its transport: outbox, twin, messages. Tested without a broker.

    ``public_key``: check desired states and model refs against it as the agent does; None accepts
    them unchecked (only a state naming another device is refused).
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
    ) -> None:
        self.device_id = device_id
        self.index = index
        self.cameras = list(cameras)
        self.outbox = outbox if outbox is not None else SimOutbox()  # an empty one is falsy (len 0)
        self.public_key = public_key
        self.batch_s = batch_s
        self.cpu_flags = cpu_flags
        self.taken: DesiredState | None = None
        self._taken_bytes: bytes | None = None
        self.applied_version = 0
        self.applied_versions: list[int] = []
        self.refused: Counter[str] = Counter()
        self._refusals_reported: set[tuple[str, int | None]] = set()
        self._running: dict[str, _RunningModel | None] = dict.fromkeys(self.cameras)
        self._reported: dict[str, CameraReported] = {c: CameraReported() for c in self.cameras}
        self.frames: dict[str, int] = dict.fromkeys(self.cameras, 0)
        self.batches = 0

    # ------------------------------------------------------------------ produced messages

    def birth(self, now_wall: float) -> Availability:
        caps = Capabilities(
            hostname=f"{self.device_id}.sim",
            os=f"{platform.system()} (simulated)",
            arch=platform.machine(),
            cpu_model="edgefleet simulator",
            cpu_count=4,
            memory_total_mb=8192.0,
            execution_providers=["CPUExecutionProvider"],
            cameras=self.cameras,
            cpu_flags=self.cpu_flags,
        )
        return Availability(state="online", ts=now_wall, agent_version=SIM_AGENT_VERSION, capabilities=caps)

    def produce_batch(self, now_wall: float) -> int | None:
        """Number and keep the next DetectionBatch; None when the outbox is full."""
        seq = self.outbox.add(TopicKind.DETECTIONS, lambda s: encode(self.detection_batch(s, now_wall)))
        if seq is not None:
            self.batches += 1
            for cam in self.cameras:
                self.frames[cam] += FRAMES_PER_BATCH
        return seq

    def detection_batch(self, seq: int, now_wall: float) -> DetectionBatch:
        """Batch ``seq``: per camera FRAMES_PER_BATCH frames, 0 to 3 boxes each; everything but the
        timestamps follows from (device index, seq)."""
        rng = random.Random((self.index << 40) ^ seq)
        frames: list[FrameDetections] = []
        for cam in self.cameras:
            run = self._running.get(cam)
            labels = run.labels if run is not None else DEFAULT_LABELS
            all_labels = run.all_labels if run is not None else DEFAULT_LABELS
            threshold = run.threshold if run is not None else 0.5
            model = run.model if run is not None else "simulated"
            for k in range(FRAMES_PER_BATCH):
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
                        captured_at=now_wall - (FRAMES_PER_BATCH - 1 - k) * self.batch_s / FRAMES_PER_BATCH,
                        width=FRAME_WIDTH,
                        height=FRAME_HEIGHT,
                        model=model,
                        inference_ms=round(rng.uniform(8.0, 20.0), 2),
                        detections=dets,
                    )
                )
        return DetectionBatch(seq=seq, sent_at=now_wall, frames=frames)

    def heartbeat(self, now_wall: float, uptime_s: float) -> Heartbeat:
        rng = random.Random((self.index << 20) ^ int(uptime_s))
        fps = round(FRAMES_PER_BATCH / self.batch_s, 2)
        cams: list[CameraStats] = []
        for cam in self.cameras:
            run = self._running.get(cam)
            cams.append(
                CameraStats(
                    camera=cam,
                    state=CameraState.UP,
                    fps=fps,
                    frames=self.frames[cam],
                    inference_ms=12.0 if run is not None else None,
                    inference_p99_ms=18.0 if run is not None else None,
                    model=run.model if run is not None else None,
                )
            )
        ran = any(r is not None for r in self._running.values())
        return Heartbeat(
            ts=now_wall,
            uptime_s=round(uptime_s, 1),
            cpu_pct=round(rng.uniform(10.0, 40.0), 1),
            memory_pct=round(rng.uniform(30.0, 50.0), 1),
            memory_used_mb=3200.0,
            disk_free_mb=50_000.0,
            disk_pct=40.0,
            cameras=cams,
            inference_ms=12.0 if ran else None,
            inference_p99_ms=18.0 if ran else None,
            outbox_pending=len(self.outbox),
            outbox_dropped=0,
            queue_dropped=0,
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
            if camera not in self.cameras:
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
        for cam in self.cameras:
            cd = state.cameras.get(cam)
            current = self._running.get(cam)
            if cd is None or cd.model is None:
                self._running[cam] = None
                self._reported[cam] = CameraReported(state="idle")
                continue
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
                    continue
            wanted = tuple(cd.labels) if cd.labels is not None else None
            run = _RunningModel(
                model=key,
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
        for cam in state.cameras:
            if cam not in self._running:
                self._reported[cam] = CameraReported(
                    state="failed", error="camera is not configured on this device"
                )
        self.applied_version = state.version
        self.applied_versions.append(state.version)

    @staticmethod
    def _settings(run: _RunningModel) -> dict[str, Any]:
        return {"threshold": run.threshold, "max_fps": run.max_fps, "labels": run.label_filter}
