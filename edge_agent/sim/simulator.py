"""``edgefleet simulate``: a fleet of lightweight simulated devices in one process, on the real contract.

Each device speaks PROTOCOL.md as the agent does, without cameras or models: client id = device id,
persistent session, Last Will ``offline`` (retained), a birth ``online`` with capabilities and agent
version, its subscriptions, then its reported state; a heartbeat every ``heartbeat_s``; one
``DetectionBatch`` every ``batch_s`` (a few plausible boxes per frame, deterministic from the seq);
an outbox that numbers detection batches and events from ONE per-device sequence and sends every
unacked seq again after the ack timeout (``ack_timeout_s``, longer while acks are slower:
``fleet_protocol/ack_timer.py``) until an ``Ack`` covers it; desired states taken as the
agent takes them (signature and device checked when a key is given, then version and issue time) and
reported as applied, each camera ``running`` the desired model with the settings in effect. No
artifact is fetched and nothing is inferred.

Scale without a thread per device: every device is a paho-mqtt client WITHOUT ``loop_start``, driven
by one selector loop on the clients' sockets (``loop_read`` / ``loop_write`` / ``loop_misc``). Only the
blocking part of a connection (TCP connect, TLS handshake, CONNECT) runs on a few connector threads,
at a bounded rate (``connect_rate`` per second), so neither a fleet's start nor its return after an
outage is a connection storm. A client is touched by one thread at a time: the loop hands it to a
connector only while it has no socket, and takes it back through a queue.

The next seq of each device lives in a small SQLite file in ``data_dir`` (per broker and prefix),
reserved ahead in blocks while running and written exactly at a clean stop together with whatever is
still unacked, so a restarted simulator continues each device's sequence (and sends the leftovers
again) instead of reusing seqs the controller would drop as duplicates.

Graceful stop (SIGINT/SIGTERM, or ``seconds`` elapsed): stop producing, keep resending until every
outbox is empty or ``drain_s`` passed (a second signal ends the wait), then publish ``offline`` and
disconnect. Exit status 0 only when every seq was acked and every device connected.

Imports: fleet_protocol, paho and the standard library only (no onnxruntime, no OpenCV).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import logging
import math
import platform
import queue
import random
import resource
import selectors
import signal
import socket
import sqlite3
import sys
import threading
import time
import urllib.error
import urllib.request
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import SecretStr

from edge_agent import __version__
from fleet_protocol.ack_timer import AckTimer
from fleet_protocol.codec import ProtocolError, decode, encode
from fleet_protocol.desired import (
    REFUSED_DEVICE,
    REFUSED_SIGNATURE,
    REFUSED_UNDECODABLE,
    order_problem,
    trust_problem,
)
from fleet_protocol.endpoint import MqttEndpoint, check_tls_files, describe_connect_error
from fleet_protocol.messages import (
    Ack,
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
    cpu_flags_from_cpuinfo,
)
from fleet_protocol.paho_client import Connack, Will, classify_connack, make_client
from fleet_protocol.signing import SignatureError, desired_canonical_bytes, load_public_key, verify
from fleet_protocol.topics import DEFAULT_PREFIX, SPECS, TopicKind, Topics, valid_device_id

log = logging.getLogger(__name__)

SIM_AGENT_VERSION = f"{__version__}-sim"
FRAME_WIDTH, FRAME_HEIGHT = 1280, 720
FRAMES_PER_BATCH = 2  # per camera and batch
DEFAULT_LABELS = ("person", "car", "bicycle")  # a camera that runs no model still "sees" these
SEQ_BLOCK = 100  # seqs reserved on disk ahead of use (a crash leaves at most this gap)
DEFAULT_OUTBOX_MAX = 600  # messages per device; when full the device produces nothing (counted)
RESEND_LIMIT = 100  # messages sent per device and round, oldest first (as the agent's resend_batch)
CONNECT_WORKERS = 8
CLOSE_WAIT_S = 5.0
STATUS_EVERY_S = 5.0
MISC_EVERY_S = 1.0

APPLIED = "applied"
IGNORED = "ignored"


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


class SimulatorError(Exception):
    """A setting or an answer that stops the simulator before it starts; the message says why."""


# --------------------------------------------------------------------------- figures


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


# --------------------------------------------------------------------------- the outbox


@dataclass(slots=True)
class Pending:
    """One numbered message not acked yet. ``first_sent``/``last_sent``: monotonic seconds, None
    before its first publish in this run."""

    seq: int
    kind: TopicKind
    payload: bytes
    first_sent: float | None = None
    last_sent: float | None = None
    attempts: int = 0
    carried: bool = False  # numbered by an earlier run of the simulator, left unacked at its stop


class SimOutbox:
    """One simulated device's outbox, in memory: every detection batch and event, numbered from one
    sequence, stays here until an ``Ack`` covers it (PROTOCOL.md "Sequence numbers, outbox, acks").

    Bounded to ``max_messages``; its drop policy is *refuse new*: a full outbox numbers nothing more
    (the device skips its batch, counted in ``skipped_full``), so a simulated outage never loses a seq.
    ``reserve(n)`` is called before seq ``n`` or any above it up to the next block is used: the caller
    persists it, so a restart never numbers a seq twice.
    """

    def __init__(
        self,
        next_seq: int = 1,
        *,
        max_messages: int = DEFAULT_OUTBOX_MAX,
        reserve: Callable[[int], None] | None = None,
        reserved: int | None = None,
        block: int = SEQ_BLOCK,
        ack_timeout_s: float = 10.0,
    ) -> None:
        """``reserved``: seqs below it are already reserved on disk (default: none are);
        ``ack_timeout_s``: the least wait before a resend (ack_timer.py)."""
        self.timer = AckTimer(ack_timeout_s)
        if next_seq < 1:
            raise ValueError("next_seq starts at 1")
        self.next_seq = next_seq
        self.start_seq = next_seq  # the first seq this run numbers (unless an ack moves numbering on)
        self.max_messages = max_messages
        self._reserve = reserve
        self._block = block
        self._limit = max(next_seq, reserved or 0)  # seqs below it may be used without writing first
        self._pending: dict[int, Pending] = {}
        self.sent = 0  # distinct seqs published at least once in this run
        self.acked = 0  # seqs an ack covered
        self.resends = 0  # publishes after the first one of a seq
        self.skipped_full = 0  # messages not produced because the outbox was full
        self.carried = 0  # unacked seqs taken over from an earlier run
        self.acked_above = 0  # highest seq an ack covered above the highest this outbox numbered
        self.latencies = array("d")  # per acked seq: ack time minus its first publish (seconds)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def full(self) -> bool:
        return len(self._pending) >= self.max_messages

    @property
    def in_flight(self) -> int:
        """Seqs published and not acked yet."""
        return sum(1 for p in self._pending.values() if p.first_sent is not None)

    @property
    def unsent(self) -> int:
        """Seqs numbered and never published in this run."""
        return sum(1 for p in self._pending.values() if p.first_sent is None)

    def pending(self) -> list[Pending]:
        return list(self._pending.values())

    def add(self, kind: TopicKind, build: Callable[[int], bytes]) -> int | None:
        """Number and keep one message (``build`` gets its seq); None when the outbox is full."""
        if self.full:
            self.skipped_full += 1
            return None
        seq = self.next_seq
        payload = build(seq)  # raises before the seq is used
        if seq >= self._limit:
            self._limit = seq + self._block
            if self._reserve is not None:
                self._reserve(self._limit)
        self.next_seq = seq + 1
        self._pending[seq] = Pending(seq, kind, payload)
        return seq

    def carry(self, seq: int, kind: TopicKind, payload: bytes) -> None:
        """Take over a message an earlier run numbered and left unacked (sent again like any other)."""
        if seq >= self.next_seq:
            raise ValueError(f"carried seq {seq} is not below next seq {self.next_seq}")
        self._pending[seq] = Pending(seq, kind, payload, carried=True)
        self._pending = dict(sorted(self._pending.items()))
        self.carried += 1

    def due(self, now: float, timeout_s: float, limit: int) -> list[Pending]:
        """Messages never sent, or last sent ``timeout_s`` or more ago; oldest first, at most ``limit``."""
        out: list[Pending] = []
        cutoff = now - timeout_s
        for p in self._pending.values():
            if p.last_sent is None or p.last_sent <= cutoff:
                out.append(p)
                if len(out) >= limit:
                    break
        return out

    def mark_sent(self, p: Pending, now: float) -> None:
        if p.first_sent is None:
            p.first_sent = now
            self.sent += 1
        else:
            self.resends += 1
        p.last_sent = now
        p.attempts += 1

    def reset_sent(self) -> None:
        """Everything unacked is due now (after a reconnect: what was in flight may be gone)."""
        for p in self._pending.values():
            p.last_sent = None

    def ack(self, msg: Ack, now: float) -> list[float]:
        """Drop every message ``msg`` covers; returns their publish->ack latencies (seconds).

        An ack above the highest seq numbered here means the controller stored seqs of this device
        that this outbox never numbered (another data folder, or none, was used before): numbering
        continues above them, so nothing new is taken for a duplicate and dropped.
        """
        covered = [seq for seq in self._pending if msg.covers(seq)]
        lat: list[float] = []
        for seq in covered:
            p = self._pending.pop(seq)
            if p.first_sent is not None:
                lat.append(now - p.first_sent)
                if p.attempts == 1:  # Karn's rule: a resent message's ack times no one send
                    self.timer.sample(now - p.first_sent)
        self.acked += len(covered)
        self.latencies.extend(lat)
        top = max([msg.upto, *(b for _, b in msg.ranges)])
        if top >= self.next_seq:
            self.acked_above = max(self.acked_above, top)
            self.next_seq = top + 1
        return lat


# --------------------------------------------------------------------------- seqs on disk


class SeqStore:
    """Per device: the next seq that is safe to use, and (after a clean stop) what was left unacked.

    One SQLite file for every device of every deployment the simulator ran against (a deployment is
    broker host:port + topic prefix: seqs are per device *at a controller*).
    """

    _SCHEMA = """
    CREATE TABLE IF NOT EXISTS device (
        deployment TEXT NOT NULL, device_id TEXT NOT NULL, next_seq INTEGER NOT NULL,
        PRIMARY KEY (deployment, device_id));
    CREATE TABLE IF NOT EXISTS unacked (
        deployment TEXT NOT NULL, device_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL,
        payload BLOB NOT NULL, PRIMARY KEY (deployment, device_id, seq));
    """

    def __init__(self, path: Path, deployment: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.deployment = deployment
        self._db = sqlite3.connect(str(path), isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(self._SCHEMA)

    def load(self, device_ids: Iterable[str]) -> dict[str, tuple[int, list[tuple[int, TopicKind, bytes]]]]:
        """Per device: its next seq (1 for a new one) and the messages left unacked, oldest first."""
        next_seq = dict(
            self._db.execute(
                "SELECT device_id, next_seq FROM device WHERE deployment = ?", (self.deployment,)
            ).fetchall()
        )
        left: dict[str, list[tuple[int, TopicKind, bytes]]] = {}
        for dev, seq, kind, payload in self._db.execute(
            "SELECT device_id, seq, kind, payload FROM unacked WHERE deployment = ? ORDER BY device_id, seq",
            (self.deployment,),
        ):
            left.setdefault(dev, []).append((int(seq), TopicKind(kind), bytes(payload)))
        return {d: (int(next_seq.get(d, 1)), left.get(d, [])) for d in device_ids}

    def set_next(self, items: Iterable[tuple[str, int]]) -> None:
        """Record next seqs (a reservation: written before any seq below it is used)."""
        rows = [(self.deployment, d, n) for d, n in items]
        if not rows:
            return
        with self._tx() as db:
            db.executemany(
                "INSERT INTO device (deployment, device_id, next_seq) VALUES (?, ?, ?) "
                "ON CONFLICT (deployment, device_id) DO UPDATE SET next_seq = MAX(next_seq, excluded.next_seq)",
                rows,
            )

    def save_final(self, items: Iterable[tuple[str, int, list[Pending]]]) -> None:
        """At a clean stop: each device's exact next seq and the messages still unacked."""
        with self._tx() as db:
            for device_id, next_seq, pending in items:
                db.execute(
                    "INSERT INTO device (deployment, device_id, next_seq) VALUES (?, ?, ?) "
                    "ON CONFLICT (deployment, device_id) DO UPDATE SET next_seq = excluded.next_seq",
                    (self.deployment, device_id, next_seq),
                )
                db.execute(
                    "DELETE FROM unacked WHERE deployment = ? AND device_id = ?", (self.deployment, device_id)
                )
                db.executemany(
                    "INSERT INTO unacked (deployment, device_id, seq, kind, payload) VALUES (?, ?, ?, ?, ?)",
                    [(self.deployment, device_id, p.seq, p.kind.value, p.payload) for p in pending],
                )

    @contextlib.contextmanager
    def _tx(self) -> Any:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()


# --------------------------------------------------------------------------- one device, no MQTT


@dataclass(frozen=True, slots=True)
class _CamRun:
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
        self._runs: dict[str, _CamRun | None] = dict.fromkeys(self.cameras)
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
            run = self._runs.get(cam)
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
            run = self._runs.get(cam)
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
        ran = any(r is not None for r in self._runs.values())
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
            current = self._runs.get(cam)
            if cd is None or cd.model is None:
                self._runs[cam] = None
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
            run = _CamRun(
                model=key,
                sha256=manifest.sha256,
                labels=tuple(x for x in manifest.labels if wanted is None or x in wanted),
                all_labels=tuple(manifest.labels),
                threshold=cd.threshold if cd.threshold is not None else manifest.default_threshold,
                max_fps=cd.max_fps,
                label_filter=sorted(set(cd.labels)) if cd.labels is not None else None,
            )
            self._runs[cam] = run
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
            if cam not in self._runs:
                self._reported[cam] = CameraReported(
                    state="failed", error="camera is not configured on this device"
                )
        self.applied_version = state.version
        self.applied_versions.append(state.version)

    @staticmethod
    def _settings(run: _CamRun) -> dict[str, Any]:
        return {"threshold": run.threshold, "max_fps": run.max_fps, "labels": run.label_filter}


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class SimConfig:
    devices: int
    endpoint: MqttEndpoint
    prefix: str = DEFAULT_PREFIX
    seconds: float | None = None
    heartbeat_s: float = 5.0
    batch_s: float = 1.0
    ack_timeout_s: float = 10.0
    drain_s: float = 30.0
    device_prefix: str = "sim-"
    cameras: int = 1
    data_dir: Path = Path("edgefleet-sim")
    credentials: dict[str, str] = field(default_factory=dict)
    public_key: Ed25519PublicKey | None = None
    connect_rate: float = 200.0
    keepalive_s: int = 15
    outbox_max: int = DEFAULT_OUTBOX_MAX
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 30.0

    def __post_init__(self) -> None:
        checks = [
            (self.devices >= 1, "--devices must be at least 1"),
            (self.seconds is None or self.seconds > 0, "--seconds must be above 0"),
            (self.heartbeat_s > 0, "--heartbeat-s must be above 0"),
            (self.batch_s > 0, "--batch-s must be above 0"),
            (self.ack_timeout_s > 0, "--ack-timeout-s must be above 0"),
            (self.drain_s >= 0, "--drain-s must be 0 or more"),
            (1 <= self.cameras <= 16, "--cameras must be 1 to 16"),
            (self.connect_rate > 0, "--connect-rate must be above 0"),
            (self.outbox_max >= 1, "the outbox bound must be at least 1"),
        ]
        for ok, why in checks:
            if not ok:
                raise SimulatorError(why)
        Topics(self.prefix)  # raises ValueError on a bad prefix
        for d in (self.device_ids[0], self.device_ids[-1]):
            if not valid_device_id(d):
                raise SimulatorError(
                    f"device id {d!r} (from --device-prefix {self.device_prefix!r}) is not a valid id: "
                    "letters, digits and _.- (not first), at most 64 characters"
                )

    @property
    def device_ids(self) -> list[str]:
        width = max(4, len(str(self.devices)))
        return [f"{self.device_prefix}{i:0{width}d}" for i in range(1, self.devices + 1)]

    @property
    def deployment(self) -> str:
        return f"{self.endpoint.host}:{self.endpoint.port}/{Topics(self.prefix).prefix}"


# --------------------------------------------------------------------------- report


@dataclass
class DeviceFigures:
    device: str
    sent: int
    acked: int
    resends: int
    in_flight: int
    unsent: int
    carried: int
    skipped_full: int
    p50_ms: float | None
    p99_ms: float | None
    desired_versions: list[int]
    refused: dict[str, int]
    connects: int
    disconnects: int
    start_seq: int  # the first seq numbered in this run; this run numbered start_seq .. next_seq - 1
    next_seq: int
    error: str | None

    @property
    def not_acked(self) -> int:
        return self.in_flight + self.unsent


@dataclass
class TotalFigures:
    devices: int
    connected_at_stop: int
    never_connected: int
    refused_by_broker: int
    sent: int
    acked: int
    resends: int
    in_flight: int
    unsent: int
    not_acked: int
    carried: int
    skipped_full: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    desired_applied: int
    devices_with_desired: int
    refused_desired: int
    heartbeats: int
    protocol_errors: dict[str, int]  # messages to the devices that did not decode, per topic kind
    wall_s: float
    cpu_s: float
    cpu_per_s: float


@dataclass
class SimReport:
    total: TotalFigures
    devices: list[DeviceFigures]
    config: dict[str, Any]

    @property
    def ok(self) -> bool:
        t = self.total
        return t.not_acked == 0 and t.never_connected == 0 and t.refused_by_broker == 0

    def verdict(self) -> str:
        t = self.total
        problems = []
        if t.not_acked:
            worst = sum(1 for d in self.devices if d.not_acked)
            problems.append(
                f"{t.not_acked} seqs NOT acked on {worst} devices ({t.in_flight} sent, {t.unsent} never sent)"
            )
        if t.never_connected:
            problems.append(f"{t.never_connected} devices never connected")
        if t.refused_by_broker:
            problems.append(f"{t.refused_by_broker} devices refused by the broker (credentials / ACL)")
        if problems:
            return "FAILED: " + "; ".join(problems)
        return f"OK: all {t.sent} seqs sent were acked ({t.carried} carried over from an earlier run)"

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "verdict": self.verdict(),
            "config": self.config,
            "total": asdict(self.total),
            "devices": [{**asdict(d), "not_acked": d.not_acked} for d in self.devices],
        }

    def table(self, max_rows: int = 20) -> str:
        """The per-device figures (every device up to ``max_rows``; else those with the most not
        acked, then the highest p99) and the total."""
        rows = self.devices
        note = ""
        if len(rows) > max_rows:
            rows = sorted(rows, key=lambda d: (-d.not_acked, -(d.p99_ms or 0.0)))[:10]
            note = f"(the 10 devices with the most not acked / highest p99 of {len(self.devices)}; all in --report)\n"
        head = (
            f"{'device':<20} {'sent':>8} {'acked':>8} {'resends':>8} {'in-flight':>9} {'unsent':>7} "
            f"{'p50 ms':>8} {'p99 ms':>8}  desired versions"
        )
        lines = [note + head, "-" * len(head)]

        def num(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        for d in rows:
            versions = ",".join(map(str, d.desired_versions[-5:])) or "-"
            lines.append(
                f"{d.device:<20} {d.sent:>8} {d.acked:>8} {d.resends:>8} {d.in_flight:>9} {d.unsent:>7} "
                f"{num(d.p50_ms):>8} {num(d.p99_ms):>8}  {versions}"
            )
        t = self.total
        lines.append("-" * len(head))
        lines.append(
            f"{'TOTAL (' + str(t.devices) + ' devices)':<20} {t.sent:>8} {t.acked:>8} {t.resends:>8} "
            f"{t.in_flight:>9} {t.unsent:>7} {num(t.p50_ms):>8} {num(t.p99_ms):>8}  "
            f"{t.desired_applied} applied on {t.devices_with_desired} devices"
        )
        lines.append(
            f"connected at stop {t.connected_at_stop}/{t.devices}, never connected {t.never_connected}, "
            f"refused by the broker {t.refused_by_broker}; heartbeats {t.heartbeats}; desired states "
            f"refused {t.refused_desired}; batches skipped (outbox full) {t.skipped_full}; "
            f"max publish->ack {num(t.max_ms)} ms"
        )
        lines.append(f"simulator CPU {t.cpu_s:.1f} s over {t.wall_s:.1f} s wall = {t.cpu_per_s:.3f} CPU-s/s")
        lines.append(self.verdict())
        return "\n".join(lines)


# --------------------------------------------------------------------------- the MQTT side


class _Conn(Enum):
    NEW = "new"  # waiting for its first connect slot
    QUEUED = "queued"  # waiting for a connect slot (rate limit)
    CONNECTING = "connecting"  # on a connector thread: the loop does not touch the client
    AWAIT_CONNACK = "await_connack"
    CONNECTED = "connected"
    BACKOFF = "backoff"  # disconnected, a reconnect is scheduled
    FAILED = "failed"  # refused for good (credentials / ACL): no retry
    CLOSED = "closed"


class _Phase(Enum):
    RUNNING = "running"
    DRAINING = "draining"
    CLOSING = "closing"


_TICK, _RECONNECT = 0, 1


@dataclass(eq=False)
class _Slot:
    """One device's MQTT client and connection state (touched by the loop thread only, except while
    CONNECTING, when only its connector thread touches the client)."""

    index: int
    device: SimDevice
    client: mqtt.Client
    topics: dict[TopicKind, str]
    state: _Conn = _Conn.NEW
    sock: Any = None
    write_registered: bool = False
    backoff_s: float = 1.0
    connects: int = 0
    disconnects: int = 0
    producing: bool = False
    next_tick: float = 0.0
    next_batch: float = 0.0
    next_heartbeat: float = 0.0
    error: str | None = None
    offline_info: mqtt.MQTTMessageInfo | None = None


class FleetSimulator:
    """N simulated devices on N paho clients, one selector loop (see the module docstring)."""

    def __init__(self, config: SimConfig, *, out: TextIO | None = None) -> None:
        self.cfg = config
        self.out = out if out is not None else sys.stdout
        self.topics = Topics(config.prefix)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._done: queue.SimpleQueue[tuple[_Slot, bool, str | None]] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, int, int]] = []
        self._counter = itertools.count()
        self._connect_queue: deque[_Slot] = deque()
        self._connecting = 0
        self._tokens = 1.0
        self._phase = _Phase.RUNNING
        self._loop_ident = 0
        self._rng = random.Random(0)
        self._start = 0.0
        self._heartbeats = 0
        self._recent: list[float] = []
        self._connect_errors: Counter[str] = Counter()
        self._protocol_errors: Counter[str] = Counter()
        self._store = SeqStore(config.data_dir / "simulator.db", config.deployment)
        self._pool: ThreadPoolExecutor | None = None
        self.slots: list[_Slot] = []

    # ------------------------------------------------------------------ set-up

    def _build(self) -> None:
        ids = self.cfg.device_ids
        state = self._store.load(ids)
        flags = _host_cpu_flags()
        cams = [f"cam{i}" for i in range(1, self.cfg.cameras + 1)]
        reservations: list[tuple[str, int]] = []
        for i, device_id in enumerate(ids):
            next_seq, left = state[device_id]

            def reserve(limit: int, d: str = device_id) -> None:
                self._store.set_next([(d, limit)])

            # The first block of every device in one transaction (below), not one each at its first batch.
            reservations.append((device_id, next_seq + SEQ_BLOCK))
            outbox = SimOutbox(
                next_seq,
                max_messages=self.cfg.outbox_max,
                reserve=reserve,
                reserved=next_seq + SEQ_BLOCK,
                ack_timeout_s=self.cfg.ack_timeout_s,
            )
            for seq, kind, payload in left:
                outbox.carry(seq, kind, payload)
            device = SimDevice(
                device_id,
                i + 1,
                cameras=cams,
                outbox=outbox,
                public_key=self.cfg.public_key,
                batch_s=self.cfg.batch_s,
                cpu_flags=flags,
            )
            self.slots.append(self._make_slot(i, device))
        self._store.set_next(reservations)

    def _make_slot(self, index: int, device: SimDevice) -> _Slot:
        cfg = self.cfg
        endpoint = cfg.endpoint
        password = cfg.credentials.get(device.device_id)
        if password is not None:
            endpoint = endpoint.with_credentials(device.device_id, SecretStr(password))
        topics = {k: self.topics.device(device.device_id, k) for k in TopicKind}
        client = make_client(
            endpoint,
            client_id=device.device_id,
            clean_session=False,
            will=Will(
                topics[TopicKind.AVAILABILITY],
                encode(Availability(state="offline")),
                qos=SPECS[TopicKind.AVAILABILITY].qos,
                retain=True,
            ),
        )
        slot = _Slot(index, device, client, topics, backoff_s=cfg.reconnect_min_s)
        client.user_data_set(slot)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_socket_close = self._on_socket_close
        client.connect_async(endpoint.host, endpoint.port, keepalive=cfg.keepalive_s)
        return slot

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event, abort: threading.Event | None = None) -> SimReport:
        """Run until ``stop`` (or ``seconds``), drain, say offline, disconnect; the figures.

        ``abort`` ends the drain at once (a second Ctrl-C)."""
        abort = abort or threading.Event()
        self._loop_ident = threading.get_ident()
        _raise_fd_limit(self.cfg.devices + 64)
        cpu0, self._start = time.process_time(), time.monotonic()
        self._build()
        self._pool = ThreadPoolExecutor(
            max_workers=min(CONNECT_WORKERS, self.cfg.devices), thread_name_prefix="sim-connect"
        )
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        for slot in self.slots:
            slot.state = _Conn.QUEUED
            self._connect_queue.append(slot)
        print(
            f"simulating {self.cfg.devices} devices ({self.cfg.device_ids[0]} .. {self.cfg.device_ids[-1]}) "
            f"against {self.cfg.endpoint} prefix {self.topics.prefix}; connecting at "
            f"{self.cfg.connect_rate:g}/s",
            file=self.out,
            flush=True,
        )
        next_misc = next_status = self._start
        last_refill = self._start
        drain_until = next_drain_check = 0.0
        try:
            while True:
                now = time.monotonic()
                self._take_connected()
                if self._phase is _Phase.RUNNING and (
                    stop.is_set() or (self.cfg.seconds is not None and now - self._start >= self.cfg.seconds)
                ):
                    self._phase = _Phase.DRAINING
                    drain_until = now + self.cfg.drain_s
                    print(
                        f"[{now - self._start:7.1f}s] stopping: no new batches; waiting up to "
                        f"{self.cfg.drain_s:g} s for {self._pending_total()} unacked seqs",
                        file=self.out,
                        flush=True,
                    )
                if self._phase is _Phase.DRAINING and (abort.is_set() or now >= drain_until):
                    break
                if self._phase is _Phase.DRAINING and now >= next_drain_check:
                    next_drain_check = now + 0.1
                    if self._pending_total() == 0:
                        break
                self._tokens = min(
                    max(1.0, self.cfg.connect_rate / 20.0),
                    self._tokens + (now - last_refill) * self.cfg.connect_rate,
                )
                last_refill = now
                self._start_connects()
                self._run_timers(now)
                if now >= next_misc:
                    next_misc = now + MISC_EVERY_S
                    self._misc()
                if now >= next_status:
                    next_status = now + STATUS_EVERY_S
                    self._status(now)
                timeout = 0.1
                if self._timers:
                    timeout = max(0.0, min(timeout, self._timers[0][0] - time.monotonic()))
                if self._connect_queue and self._tokens < 1.0:
                    timeout = min(timeout, 1.0 / self.cfg.connect_rate)
                self._poll(timeout)
        finally:
            self._close()
            report = self._report(time.monotonic() - self._start, time.process_time() - cpu0)
            self._save()
        return report

    def _poll(self, timeout: float) -> None:
        for key, mask in self._sel.select(timeout):
            slot = key.data
            if slot is None:
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
                continue
            self._io(slot, mask)

    def _io(self, slot: _Slot, mask: int) -> None:
        client = slot.client
        try:
            if mask & selectors.EVENT_READ:
                client.loop_read()
                # TLS: bytes already decrypted inside the SSL object wake no select; read them now.
                for _ in range(64):
                    sock = client.socket()
                    pending = getattr(sock, "pending", None)
                    if sock is None or pending is None or pending() <= 0:
                        break
                    client.loop_read()
            if mask & selectors.EVENT_WRITE and client.socket() is not None:
                client.loop_write()
        except Exception:
            log.exception("%s: network handling failed", slot.device.device_id)
        self._flush(slot)

    def _flush(self, slot: _Slot) -> None:
        """Write what the client has queued; watch for writability only while some is left."""
        client = slot.client
        if slot.sock is None or client.socket() is not slot.sock:
            return
        if client.want_write():
            client.loop_write()
        if slot.sock is None:
            return
        want = client.want_write()
        if want != slot.write_registered:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._sel.modify(slot.sock, events, slot)
            slot.write_registered = want

    def _misc(self) -> None:
        for slot in self.slots:
            if slot.sock is not None:
                slot.client.loop_misc()  # keepalive pings, a silent link or a missing CONNACK
                self._flush(slot)

    # ------------------------------------------------------------------ connecting

    def _start_connects(self) -> None:
        limit = CONNECT_WORKERS * 2
        while self._connect_queue and self._tokens >= 1.0 and self._connecting < limit:
            slot = self._connect_queue.popleft()
            if slot.state is not _Conn.QUEUED:
                continue
            if self._phase is not _Phase.RUNNING and len(slot.device.outbox) == 0:
                slot.state = _Conn.CLOSED if slot.connects else _Conn.NEW
                continue  # stopping: only devices with something left to send come back
            self._tokens -= 1.0
            self._connecting += 1
            slot.state = _Conn.CONNECTING
            assert self._pool is not None
            self._pool.submit(self._connect_task, slot)

    def _connect_task(self, slot: _Slot) -> None:
        """On a connector thread: TCP (+TLS) connect and CONNECT; the loop takes the client back."""
        ok, error = False, None
        try:
            rc = slot.client.reconnect()
            ok = rc == mqtt.MQTT_ERR_SUCCESS and slot.client.socket() is not None
            if not ok:
                error = f"could not send CONNECT to {self.cfg.endpoint} ({mqtt.error_string(rc)})"
        except Exception as exc:
            error = describe_connect_error(exc, str(self.cfg.endpoint))
        self._done.put((slot, ok, error))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _take_connected(self) -> None:
        while True:
            try:
                slot, ok, error = self._done.get_nowait()
            except queue.Empty:
                return
            self._connecting -= 1
            sock = slot.client.socket()
            if self._phase is _Phase.CLOSING:
                if ok:
                    slot.client.disconnect()
                slot.state = _Conn.CLOSED
                continue
            if not ok or sock is None:
                self._connect_errors[error or "connection lost during connect"] += 1
                slot.state = _Conn.BACKOFF
                self._schedule_reconnect(slot)
                continue
            slot.sock = sock
            slot.write_registered = slot.client.want_write()
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if slot.write_registered else 0)
            self._sel.register(sock, events, slot)
            slot.state = _Conn.AWAIT_CONNACK

    def _schedule_reconnect(self, slot: _Slot) -> None:
        delay = slot.backoff_s * self._rng.uniform(0.5, 1.5)  # jitter: a fleet does not return at once
        slot.backoff_s = min(slot.backoff_s * 2.0, self.cfg.reconnect_max_s)
        self._push(time.monotonic() + delay, slot, _RECONNECT)

    # ------------------------------------------------------------------ paho callbacks (loop thread)

    def _on_connect(
        self, client: mqtt.Client, slot: _Slot, flags: object, reason: object, properties: object
    ) -> None:
        verdict = classify_connack(reason)
        if verdict is not Connack.ACCEPTED:
            if verdict is Connack.REFUSED:
                slot.error = f"broker refused the connection: {reason}"
                slot.state = _Conn.FAILED
                log.error(
                    "%s: %s; not retrying (check --credentials / the ACL)", slot.device.device_id, slot.error
                )
                client.disconnect()
            else:
                self._connect_errors[f"broker refused the connection: {reason}"] += 1
            return
        now, wall = time.monotonic(), time.time()
        slot.state = _Conn.CONNECTED
        slot.connects += 1
        slot.backoff_s = self.cfg.reconnect_min_s
        dev = self._publish_connected(slot, wall)
        dev.outbox.reset_sent()
        if not slot.producing and self._phase is _Phase.RUNNING:
            slot.producing = True
            dev.emit_event(
                EventKind.AGENT_STARTED,
                wall,
                message=f"simulated agent {SIM_AGENT_VERSION} started",
                data={"agent_version": SIM_AGENT_VERSION, "cameras": dev.cameras, "simulated": True},
            )
            slot.next_heartbeat = now + self._rng.uniform(0.0, min(1.0, self.cfg.heartbeat_s))
            slot.next_batch = now + self._rng.uniform(0.0, self.cfg.batch_s)
            slot.next_tick = slot.next_batch
            self._push(slot.next_tick, slot, _TICK)
        self._send_due(slot, now)

    def _publish_connected(self, slot: _Slot, wall: float) -> SimDevice:
        """PROTOCOL.md "Connection (agent)": birth, subscriptions, then the reported state."""
        dev = slot.device
        spec = SPECS[TopicKind.AVAILABILITY]
        slot.client.publish(
            slot.topics[TopicKind.AVAILABILITY], encode(dev.birth(wall)), spec.qos, spec.retain
        )
        slot.client.subscribe(self.topics.agent_subscriptions(dev.device_id))
        self._publish(slot, TopicKind.TWIN_REPORTED, encode(dev.reported_state(wall)))
        return dev

    def _on_disconnect(
        self, client: mqtt.Client, slot: _Slot, flags: object, reason: object, properties: object
    ) -> None:
        if threading.get_ident() != self._loop_ident:
            return  # a failed CONNECT on a connector thread: it reports the failure itself
        if slot.state is _Conn.CONNECTED and self._phase is not _Phase.CLOSING:
            slot.disconnects += 1  # the link broke (not our own DISCONNECT at the end)
            log.info("%s disconnected: %s", slot.device.device_id, reason)
        if slot.state is _Conn.FAILED or self._phase is _Phase.CLOSING:
            if slot.state is not _Conn.FAILED:
                slot.state = _Conn.CLOSED
            return
        slot.state = _Conn.BACKOFF
        self._schedule_reconnect(slot)

    def _on_socket_close(self, client: mqtt.Client, slot: _Slot, sock: object) -> None:
        if slot.sock is not None and sock is slot.sock:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            slot.sock = None
            slot.write_registered = False

    def _on_message(self, client: mqtt.Client, slot: _Slot, msg: mqtt.MQTTMessage) -> None:
        topic = self.topics.parse(msg.topic)
        dev = slot.device
        if topic is None or topic.device_id != dev.device_id:
            self._protocol_errors["unknown"] += 1
            return
        if topic.kind == TopicKind.ARTIFACT_CHUNK:
            return  # never asked for: the simulator fetches no model
        now, wall = time.monotonic(), time.time()
        try:
            message = decode(topic.kind, bytes(msg.payload))
        except ProtocolError as exc:
            self._protocol_errors[topic.kind.value] += 1
            if topic.kind == TopicKind.TWIN_DESIRED:
                dev.refuse_undecodable(str(exc), wall)
                self._send_due(slot, now)
            return
        try:
            if isinstance(message, Ack):
                before = dev.outbox.acked_above
                self._recent.extend(dev.outbox.ack(message, now))
                if dev.outbox.acked_above != before:
                    log.warning(
                        "%s: the controller acked seq %s, above any this simulator numbered for it (a "
                        "different --data-dir was used before?); numbering continues at %s",
                        dev.device_id,
                        dev.outbox.acked_above,
                        dev.outbox.next_seq,
                    )
            elif isinstance(message, DesiredState):
                outcome = dev.on_desired(message, wall)
                if outcome == APPLIED:
                    log.info("%s applied desired version %s", dev.device_id, message.version)
                    self._publish(slot, TopicKind.TWIN_REPORTED, encode(dev.reported_state(wall)))
                self._send_due(slot, now)
            elif isinstance(message, Command):
                self._publish(slot, TopicKind.COMMAND_RESULT, encode(dev.run_command(message)))
        except Exception:
            log.exception("%s: handling %s failed", dev.device_id, topic.kind.value)

    # ------------------------------------------------------------------ sending

    def _publish(self, slot: _Slot, kind: TopicKind, payload: bytes) -> bool:
        if slot.state is not _Conn.CONNECTED:
            return False
        spec = SPECS[kind]
        info = slot.client.publish(slot.topics[kind], payload, spec.qos, spec.retain)
        return info.rc == mqtt.MQTT_ERR_SUCCESS

    def _send_due(self, slot: _Slot, now: float) -> None:
        """Publish what is due (never sent, or unacked for the device's ack timer), oldest first."""
        if slot.state is not _Conn.CONNECTED:
            return
        outbox = slot.device.outbox
        for p in outbox.due(now, outbox.timer.timeout_s, RESEND_LIMIT):
            if not self._publish(slot, p.kind, p.payload):
                break
            outbox.mark_sent(p, now)

    def _tick(self, slot: _Slot, now: float) -> None:
        """Every min(batch_s, heartbeat_s): a batch when due, resends, a heartbeat when due."""
        dev = slot.device
        wall = time.time()
        if now >= slot.next_batch:
            slot.next_batch += self.cfg.batch_s
            if slot.next_batch < now:  # far behind (a stalled loop): no burst to catch up
                slot.next_batch = now + self.cfg.batch_s
            if self._phase is _Phase.RUNNING:
                dev.produce_batch(wall)
        self._send_due(slot, now)
        if slot.state is _Conn.CONNECTED and now >= slot.next_heartbeat:
            slot.next_heartbeat = max(slot.next_heartbeat + self.cfg.heartbeat_s, now)
            if self._publish(slot, TopicKind.HEARTBEAT, encode(dev.heartbeat(wall, now - self._start))):
                self._heartbeats += 1
        self._flush(slot)
        period = min(self.cfg.batch_s, self.cfg.heartbeat_s)
        slot.next_tick += period
        if slot.next_tick < now:
            slot.next_tick = now + period
        self._push(slot.next_tick, slot, _TICK)

    # ------------------------------------------------------------------ timers

    def _push(self, when: float, slot: _Slot, kind: int) -> None:
        heapq.heappush(self._timers, (when, next(self._counter), slot.index, kind))

    def _run_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, index, kind = heapq.heappop(self._timers)
            slot = self.slots[index]
            if kind == _TICK:
                self._tick(slot, now)
            elif kind == _RECONNECT and slot.state is _Conn.BACKOFF:
                slot.state = _Conn.QUEUED
                self._connect_queue.append(slot)

    # ------------------------------------------------------------------ progress, stop

    def _pending_total(self) -> int:
        return sum(len(s.device.outbox) for s in self.slots)

    def _status(self, now: float) -> None:
        connected = sum(1 for s in self.slots if s.state is _Conn.CONNECTED)
        boxes = [s.device.outbox for s in self.slots]
        recent, self._recent = self._recent, []
        p50, p99 = percentile(recent, 50), percentile(recent, 99)
        lat = f"p50 {_ms(p50)} ms p99 {_ms(p99)} ms" if recent else "no acks"
        line = (
            f"[{now - self._start:7.1f}s] connected {connected}/{len(self.slots)}  sent "
            f"{sum(b.sent for b in boxes)}  acked {sum(b.acked for b in boxes)}  in-flight "
            f"{sum(len(b) for b in boxes)}  resends {sum(b.resends for b in boxes)}  last {STATUS_EVERY_S:g} s: {lat}"
        )
        if self._connect_errors:
            top, n = self._connect_errors.most_common(1)[0]
            line += f"  | connect failures {sum(self._connect_errors.values())} (e.g. {n}x {top})"
            self._connect_errors.clear()
        print(line, file=self.out, flush=True)

    def _close(self) -> None:
        """Say offline (retained, QoS 1) for every connected device, wait for the broker to take those,
        then disconnect everything."""
        self._phase = _Phase.CLOSING
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._take_connected()
        wall = time.time()
        offline = encode(Availability(state="offline", ts=wall))
        spec = SPECS[TopicKind.AVAILABILITY]
        for slot in self.slots:
            if slot.state is _Conn.CONNECTED:
                slot.offline_info = slot.client.publish(
                    slot.topics[TopicKind.AVAILABILITY], offline, spec.qos, spec.retain
                )
                self._flush(slot)
        self._pump(lambda: all(s.offline_info is None or s.offline_info.is_published() for s in self.slots))
        for slot in self.slots:
            if slot.sock is not None:
                slot.client.disconnect()
                self._flush(slot)
        self._pump(lambda: all(s.sock is None for s in self.slots))
        for slot in self.slots:
            if slot.state is not _Conn.FAILED:
                slot.state = _Conn.CLOSED
            if slot.sock is not None:  # the broker never took the DISCONNECT: drop the socket
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(slot.sock)
                with contextlib.suppress(OSError):
                    slot.sock.close()
                slot.sock = None
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _pump(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not done() and time.monotonic() < deadline:
            self._poll(0.05)

    def _save(self) -> None:
        try:
            self._store.save_final(
                (s.device.device_id, s.device.outbox.next_seq, s.device.outbox.pending()) for s in self.slots
            )
        finally:
            self._store.close()

    # ------------------------------------------------------------------ figures

    def _report(self, wall_s: float, cpu_s: float) -> SimReport:
        devices: list[DeviceFigures] = []
        all_lat = array("d")
        for s in self.slots:
            box, dev = s.device.outbox, s.device
            all_lat.extend(box.latencies)
            devices.append(
                DeviceFigures(
                    device=dev.device_id,
                    sent=box.sent,
                    acked=box.acked,
                    resends=box.resends,
                    in_flight=box.in_flight,
                    unsent=box.unsent,
                    carried=box.carried,
                    skipped_full=box.skipped_full,
                    p50_ms=_ms(percentile(box.latencies, 50)),
                    p99_ms=_ms(percentile(box.latencies, 99)),
                    desired_versions=list(dev.applied_versions),
                    refused=dict(dev.refused),
                    connects=s.connects,
                    disconnects=s.disconnects,
                    start_seq=box.start_seq,
                    next_seq=box.next_seq,
                    error=s.error,
                )
            )
        in_flight = sum(d.in_flight for d in devices)
        unsent = sum(d.unsent for d in devices)
        total = TotalFigures(
            devices=len(devices),
            connected_at_stop=sum(1 for s in self.slots if s.offline_info is not None),
            never_connected=sum(1 for s in self.slots if s.connects == 0 and s.error is None),
            refused_by_broker=sum(1 for s in self.slots if s.error is not None),
            sent=sum(d.sent for d in devices),
            acked=sum(d.acked for d in devices),
            resends=sum(d.resends for d in devices),
            in_flight=in_flight,
            unsent=unsent,
            not_acked=in_flight + unsent,
            carried=sum(d.carried for d in devices),
            skipped_full=sum(d.skipped_full for d in devices),
            p50_ms=_ms(percentile(all_lat, 50)),
            p99_ms=_ms(percentile(all_lat, 99)),
            max_ms=_ms(max(all_lat) if all_lat else None),
            desired_applied=sum(len(d.desired_versions) for d in devices),
            devices_with_desired=sum(1 for d in devices if d.desired_versions),
            refused_desired=sum(sum(d.refused.values()) for d in devices),
            heartbeats=self._heartbeats,
            protocol_errors=dict(self._protocol_errors),
            wall_s=round(wall_s, 2),
            cpu_s=round(cpu_s, 2),
            cpu_per_s=round(cpu_s / wall_s, 4) if wall_s > 0 else 0.0,
        )
        cfg = self.cfg
        config = {
            "devices": cfg.devices,
            "mqtt": str(cfg.endpoint),
            "prefix": self.topics.prefix,
            "seconds": cfg.seconds,
            "heartbeat_s": cfg.heartbeat_s,
            "batch_s": cfg.batch_s,
            "ack_timeout_s": cfg.ack_timeout_s,
            "drain_s": cfg.drain_s,
            "device_prefix": cfg.device_prefix,
            "cameras": cfg.cameras,
            "connect_rate": cfg.connect_rate,
            "signatures_checked": cfg.public_key is not None,
            "data_dir": str(cfg.data_dir),
        }
        return SimReport(total=total, devices=devices, config=config)


# --------------------------------------------------------------------------- helpers


def _host_cpu_flags() -> list[str] | None:
    try:
        return cpu_flags_from_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def _raise_fd_limit(needed: int) -> None:
    """One socket per device: lift the soft open-files limit towards the hard one, or say why not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and soft < needed:
            raise SimulatorError(
                f"{needed} open files needed (one socket per device) but the limit is {soft}: raise it "
                "(ulimit -n) or simulate fewer devices"
            )


def load_credentials(path: Path) -> dict[str, str]:
    """``{device_id: password}`` from a JSON file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SimulatorError(f"--credentials {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise SimulatorError(f"--credentials {path}: must be a JSON object {{device_id: password}}")
    return data


@dataclass
class Enrolled:
    passwords: dict[str, str]
    public_key: str | None


def enroll_devices(
    api_url: str, token: str | None, device_ids: Sequence[str], *, workers: int = 8, timeout_s: float = 30.0
) -> Enrolled:
    """Enroll each device through ``POST /api/v1/devices`` (idempotent; with broker credentials managed
    by the controller, each gets a new password, returned once). Raises SimulatorError on a refusal."""
    url = api_url.rstrip("/") + "/api/v1/devices"
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"

    def one(device_id: str) -> dict[str, Any]:
        req = urllib.request.Request(
            url, data=json.dumps({"id": device_id}).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                answer: dict[str, Any] = json.loads(resp.read())
                return answer
        except urllib.error.HTTPError as exc:
            body = exc.read()[:500].decode(errors="replace")
            raise SimulatorError(f"enrolling {device_id} at {url}: HTTP {exc.code}: {body}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise SimulatorError(f"enrolling {device_id} at {url}: {exc}") from None

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sim-enroll") as pool:
        answers = list(pool.map(one, device_ids))
    passwords = {a["id"]: a["mqtt_password"] for a in answers if isinstance(a.get("mqtt_password"), str)}
    keys = {a.get("artifact_public_key") for a in answers}
    key = next(iter(keys)) if len(keys) == 1 else None
    return Enrolled(passwords=passwords, public_key=key if isinstance(key, str) else None)


def run_from_cli(
    *,
    devices: int,
    mqtt_url: str,
    prefix: str = DEFAULT_PREFIX,
    seconds: float | None = None,
    heartbeat_s: float = 5.0,
    batch_s: float = 1.0,
    ack_timeout_s: float = 10.0,
    drain_s: float = 30.0,
    device_prefix: str = "sim-",
    cameras: int = 1,
    credentials: Path | None = None,
    enroll_url: str | None = None,
    token: str | None = None,
    key: str | None = None,
    data_dir: Path = Path("edgefleet-sim"),
    report: Path | None = None,
    connect_rate: float = 200.0,
    ca_file: Path | None = None,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    out: TextIO | None = None,
) -> int:
    """``edgefleet simulate``: 0 when every seq was acked (and every device connected), 1 when not,
    2 for bad settings."""
    out = out if out is not None else sys.stdout
    try:
        endpoint = MqttEndpoint.parse(mqtt_url).with_tls(ca_file, cert_file, key_file)
        check_tls_files(ca_file, cert_file, key_file)
        passwords = load_credentials(credentials) if credentials is not None else {}
        public_key = load_public_key(key) if key else None
        cfg = SimConfig(
            devices=devices,
            endpoint=endpoint,
            prefix=prefix,
            seconds=seconds,
            heartbeat_s=heartbeat_s,
            batch_s=batch_s,
            ack_timeout_s=ack_timeout_s,
            drain_s=drain_s,
            device_prefix=device_prefix,
            cameras=cameras,
            data_dir=data_dir,
            credentials=passwords,
            public_key=public_key,
            connect_rate=connect_rate,
        )
        if enroll_url:
            print(f"enrolling {devices} devices at {enroll_url}", file=out, flush=True)
            enrolled = enroll_devices(enroll_url, token, cfg.device_ids)
            updates: dict[str, Any] = {"credentials": {**passwords, **enrolled.passwords}}
            if public_key is None and enrolled.public_key:
                # The key the enrollment answer tells the device to trust, as a real agent is set up.
                updates["public_key"] = load_public_key(enrolled.public_key)
            cfg = dataclasses.replace(cfg, **updates)
    except (SimulatorError, ValueError) as exc:  # SignatureError and pydantic's errors are ValueErrors
        print(f"edgefleet simulate: {exc}", file=sys.stderr)
        return 2
    missing = [d for d in cfg.device_ids if d not in cfg.credentials]
    if cfg.credentials and missing:
        print(
            f"warning: {len(missing)} devices have no password (e.g. {missing[0]}); they connect as "
            f"{endpoint.username or 'anonymous'}",
            file=sys.stderr,
        )
    stop, abort = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            abort.set()
        stop.set()

    try:
        sim = FleetSimulator(cfg, out=out)
    except (OSError, sqlite3.Error) as exc:
        print(f"edgefleet simulate: --data-dir {cfg.data_dir}: {exc}", file=sys.stderr)
        return 2
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = sim.run(stop, abort)
    except SimulatorError as exc:
        print(f"edgefleet simulate: {exc}", file=sys.stderr)
        return 2
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    print(result.table(), file=out, flush=True)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(result.to_json(), indent=1))
        print(f"report written to {report}", file=out, flush=True)
    return 0 if result.ok else 1
