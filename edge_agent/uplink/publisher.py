"""The publisher thread: frames -> DetectionBatch -> outbox -> MQTT, plus resends and events.

Everything that carries a ``seq`` goes through the outbox first (written before it is published),
so a message is never lost between the pipeline and the controller's ack.

A disk that refuses the outbox's writes (full, read-only) stops nothing and loses nothing silently:
detection batches and events wait in memory (bounded by ``outbox.held_max``, drop oldest, counted)
and are written, oldest first, once the disk takes writes again. The failure and the recovery, with
what was held and dropped meanwhile, are each reported by an event (:mod:`edge_agent.core.disk_guard`). A
message held in memory has no seq yet: one dropped there was never published, and is declared in the
recovered event instead of by an OUTBOX_DROPPED span.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_agent.core.disk_guard import DiskGuard, Reserve
from edge_agent.core.queues import DropOldestQueue
from edge_agent.core.settings import OutboxConfig
from edge_agent.uplink.outbox import DroppedRange, Outbox, OutboxRow, StorageError
from fleet_protocol.ack_timer import AckTimer
from fleet_protocol.codec import ProtocolError, encode
from fleet_protocol.messages import Ack, DetectionBatch, Event, EventKind, FrameDetections, Severity
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)

KIND_DETECTIONS = "detections"
KIND_EVENTS = "events"
_TOPIC = {KIND_DETECTIONS: TopicKind.DETECTIONS, KIND_EVENTS: TopicKind.EVENTS}

PublishFn = Callable[[TopicKind, bytes], bool]
OUTBOX = "outbox"  # the part name in storage events


@dataclass(frozen=True, slots=True)
class _EventSpec:
    """An event before it has a seq: what it says, and when it happened."""

    ts: float
    kind: EventKind
    severity: Severity
    camera: str | None
    message: str
    data: dict[str, Any]

    def encode(self, seq: int, incarnation: str | None) -> bytes:
        return encode(
            Event(
                seq=seq,
                incarnation=incarnation,
                ts=self.ts,
                kind=self.kind,
                severity=self.severity,
                camera=self.camera,
                message=self.message,
                data=self.data,
            )
        )


@dataclass(frozen=True, slots=True)
class _Held:
    """A message for the outbox: a detection batch's frames, or an event."""

    frames: list[FrameDetections] | None = None
    event: _EventSpec | None = None

    @property
    def kind(self) -> str:
        return KIND_EVENTS if self.event is not None else KIND_DETECTIONS


@dataclass
class _HeldCounts:
    """What one storage failure made wait in memory, and what the bound dropped there."""

    counts: dict[str, int] = field(default_factory=dict)

    def messages(self, what: str) -> int:
        return self.counts.get(f"{what}_batches", 0) + self.counts.get(f"{what}_events", 0)

    def add(self, what: str, item: _Held) -> None:
        if item.frames is not None:
            self.counts[f"{what}_batches"] = self.counts.get(f"{what}_batches", 0) + 1
            self.counts[f"{what}_frames"] = self.counts.get(f"{what}_frames", 0) + len(item.frames)
        else:
            self.counts[f"{what}_events"] = self.counts.get(f"{what}_events", 0) + 1


_TIMED_MAX = 10_000  # first-send times kept for the ack timer


class Publisher:
    def __init__(
        self,
        outbox: Outbox,
        frames: DropOldestQueue[FrameDetections],
        publish: PublishFn,
        config: OutboxConfig,
        *,
        stop: threading.Event,
        resend_interval_s: float = 0.25,
        reserve: Reserve | None = None,
        clock: Callable[[], float] = time.time,
        link_up: bool = True,
    ) -> None:
        """``reserve``: room kept on the outbox's disk for the events that say it is full (None: none);
        ``clock``: the time sends, resends and acks are timed by; ``link_up``: False when the link is
        not connected yet and calls :meth:`on_connected` once it is (the agent's transport): nothing is
        sent before that call."""
        self._clock = clock
        self.outbox = outbox
        self._frames = frames
        self._publish = publish
        self._cfg = config
        self._stop = stop
        self._resend_interval = resend_interval_s
        self._resend_now = threading.Event()
        # Set once sends may start: at once, or (link_up False) after on_connected has reset the sent
        # marks. The transport calls on_connected on its own thread after the CONNACK, when publishes
        # already go through: a row sent before that reset would be made due again by it, and reach
        # the controller twice.
        self._link_up = threading.Event()
        if link_up:
            self._link_up.set()
        self._emit_lock = threading.Lock()
        self.published = 0
        self.publish_failures = 0
        # Storage failures of any part (this outbox, the twin's desired state), reported and retried.
        self.storage = DiskGuard(self._emit_storage_event, reserve=reserve)
        # Messages waiting for a disk that refuses the outbox's writes. ``_holding`` from the first
        # refused write until the retry has written them all: meanwhile every new message waits too,
        # behind the older ones, instead of trying the disk at each frame.
        self._held_lock = threading.Lock()
        self._held: deque[_Held] = deque()
        self._holding = False
        self._episode = _HeldCounts()
        self.held_dropped = _HeldCounts()  # since the start, for diagnostics and tests
        self._loop_errors = 0
        # The resend timeout follows the acks (ack_timer.py), timed on messages sent once: seq -> when.
        self.ack_timer = AckTimer(config.ack_timeout_s)
        self._timing_lock = threading.Lock()
        self._first_sent: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    # ------------------------------------------------------------------ API (any thread)

    def start(self) -> None:
        self.storage.start()
        self._thread.start()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def emit_event(
        self,
        kind: EventKind,
        *,
        message: str = "",
        camera: str | None = None,
        severity: Severity = Severity.INFO,
        data: dict[str, Any] | None = None,
    ) -> int | None:
        """Persist an event in the outbox and try to publish it now; returns its seq, or None when the
        disk refuses the outbox's writes and the event waits in memory (written, with its own time,
        once the disk takes writes). Never raises for a refused write."""
        spec = _EventSpec(time.time(), kind, severity, camera, message[:4096], dict(data or {}))
        return self._submit(_Held(event=spec))

    def _emit_storage_event(
        self, kind: EventKind, severity: Severity, message: str, data: dict[str, Any]
    ) -> None:
        # Tried at once even while other messages wait for the disk: the reserve was released for it.
        self._submit(
            _Held(event=_EventSpec(time.time(), kind, severity, None, message[:4096], data)), urgent=True
        )

    def _submit(self, item: _Held, *, urgent: bool = False) -> int | None:
        """Write ``item`` to the outbox and have it sent; None when it waits in memory instead."""
        if not urgent and self._hold_if_holding(item):
            return None
        try:
            seq = self._append(item)
        except StorageError as exc:
            self._hold(item)
            self._outbox_refused(exc)
            return None
        self._send_seq(seq)
        self._report_drops()
        return seq

    def _append(self, item: _Held) -> int:
        """Number and write one message (ProtocolError: it cannot be encoded; StorageError: refused)."""
        # The outbox's incarnation is known once it opened, which append does before it builds.
        event = item.event
        if event is not None:

            def build(seq: int) -> bytes:
                return event.encode(seq, self.outbox.incarnation)

        else:
            frames = item.frames or []

            def build(seq: int) -> bytes:
                return encode(
                    DetectionBatch(
                        seq=seq, incarnation=self.outbox.incarnation, sent_at=time.time(), frames=frames
                    )
                )

        with self._emit_lock:
            return self.outbox.append(item.kind, build, now=time.time())

    def on_ack(self, ack: Ack) -> None:
        now = self._clock()
        try:
            n = self.outbox.ack(ack)
        except StorageError as exc:  # remembered by the outbox: its rows are not sent again
            self._outbox_refused(exc)
            return
        if n:
            with self._timing_lock:
                for seq in [q for q in self._first_sent if ack.covers(q)]:
                    self.ack_timer.sample(now - self._first_sent.pop(seq))
        log.debug("ack upto %s (incarnation %s): %s rows deleted", ack.upto, ack.incarnation, n)

    def on_connected(self) -> None:
        """Everything unacked is due again: what was in flight when the link broke may be gone."""
        try:
            self.outbox.reset_sent()
        except StorageError as exc:  # due again in memory; on disk after the ack timeout
            self._outbox_refused(exc)
        finally:
            self._link_up.set()  # sends from now on come after the reset
        self._resend_now.set()

    # ------------------------------------------------------------------ a disk refusing writes

    def _outbox_refused(self, exc: StorageError) -> None:
        """Any refused write (an append, a sent mark, an ack): hold new messages until the retry."""
        with self._held_lock:
            self._start_holding()
        self.storage.failed(OUTBOX, self.outbox.path, exc, retry=self._write_held)

    def _start_holding(self) -> None:
        # Caller holds _held_lock.
        if not self._holding:
            self._holding = True
            self._episode = _HeldCounts()

    def _hold_if_holding(self, item: _Held) -> bool:
        with self._held_lock:
            if not self._holding:
                return False
            self._put_held(item)
            return True

    def _hold(self, item: _Held) -> None:
        with self._held_lock:
            self._start_holding()
            self._put_held(item)

    def _put_held(self, item: _Held) -> None:
        # Caller holds _held_lock. Drop policy: oldest first, counted, reported with the recovery.
        if len(self._held) >= self._cfg.held_max:
            old = self._held.popleft()
            self._episode.add("dropped", old)
            self.held_dropped.add("dropped", old)
            if self._episode.messages("dropped") == 1:
                log.warning(
                    "%s messages held in memory for the disk: dropping the oldest (counted, reported "
                    "once the disk takes writes)",
                    self._cfg.held_max,
                )
        self._held.append(item)
        self._episode.add("held", item)

    def _write_held(self) -> dict[str, Any]:
        """The storage guard's retry: write what waited in memory, oldest first; returns the figures of
        the failure for its recovered event. Raises StorageError (the rest keeps waiting) if refused."""
        self.outbox.record_remembered()
        while True:
            with self._held_lock:
                if not self._held:
                    self._holding = False
                    episode, self._episode = self._episode, _HeldCounts()
                    break
                item = self._held[0]
                # Written under the lock, so the bound cannot drop it meanwhile and count it dropped.
                try:
                    seq: int | None = self._append(item)
                except ProtocolError as exc:
                    log.error("dropping a held %s message that cannot be encoded: %s", item.kind, exc)
                    self._episode.add("dropped", item)
                    self.held_dropped.add("dropped", item)
                    seq = None
                self._held.popleft()
            if seq is not None:
                self._send_seq(seq)
        self._report_drops()
        figures = {"held_batches": 0, "held_frames": 0, "held_events": 0}
        figures |= {"dropped_batches": 0, "dropped_frames": 0, "dropped_events": 0}
        figures.update(episode.counts)
        return figures

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        batch: list[FrameDetections] = []
        first_at = 0.0
        next_resend = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                wait = 0.05
                if batch:
                    wait = max(0.0, min(wait, first_at + self._cfg.batch_max_delay_s - now))
                item = self._frames.get(timeout=wait)
                if item is not None:
                    if not batch:
                        first_at = time.monotonic()
                    batch.append(item)
                now = time.monotonic()
                if batch and (
                    len(batch) >= self._cfg.batch_max_frames or now - first_at >= self._cfg.batch_max_delay_s
                ):
                    full, batch = batch, []
                    self._flush(full)
                if self._resend_now.is_set() or now >= next_resend:
                    self._resend_now.clear()
                    next_resend = now + self._resend_interval
                    self.resend_due()
                if self.storage.probe_due(now):
                    self.storage.probe()
            except Exception:
                # The thread that carries every detection must outlive any one failure (a database
                # error the outbox does not foresee): logged, with repeats thinned out.
                self._loop_errors += 1
                if self._loop_errors & (self._loop_errors - 1) == 0:
                    log.exception("publisher pass failed (%s so far)", self._loop_errors)
                self._stop.wait(0.05)
        # Stop: what the pipeline produced still goes to disk, to be sent after the next start.
        batch.extend(self._frames.drain())
        if batch:
            self._flush(batch, send=False)
        self._last_write_of_held()

    def _last_write_of_held(self) -> None:
        with self._held_lock:
            if not self._held:
                return
        try:
            self._write_held()
            return
        except StorageError as exc:
            reason = str(exc)
        with self._held_lock:
            counts = _HeldCounts()
            for item in self._held:
                counts.add("lost", item)
        log.error(
            "stopping with messages held in memory that the disk refused (%s): lost: %s",
            reason,
            ", ".join(f"{v} {k.removeprefix('lost_')}" for k, v in counts.counts.items()),
        )

    def _flush(self, frames: list[FrameDetections], *, send: bool = True) -> None:
        for part in self._split(frames):
            self._submit_batch(part, send=send)
        self._report_drops()

    def _split(self, frames: list[FrameDetections]) -> list[list[FrameDetections]]:
        return [frames[i : i + 500] for i in range(0, len(frames), 500)]

    def _submit_batch(self, frames: list[FrameDetections], *, send: bool) -> None:
        item = _Held(frames=frames)
        if self._hold_if_holding(item):
            return
        try:
            seq = self._append(item)
        except ProtocolError as exc:
            if len(frames) == 1:
                log.error("dropping a frame whose detections cannot be encoded: %s", exc)
                return
            # Over the payload size limit: halve until it fits.
            mid = len(frames) // 2
            self._submit_batch(frames[:mid], send=send)
            self._submit_batch(frames[mid:], send=send)
            return
        except StorageError as exc:
            self._hold(item)
            self._outbox_refused(exc)
            return
        if send:
            self._send_seq(seq)

    def _send_seq(self, seq: int) -> None:
        # Rows are sent by the resend pass: one code path, oldest first, marks what went out.
        self._resend_now.set()

    def resend_due(self) -> None:
        """One resend round: what is due, oldest first (the publisher thread runs it)."""
        if not self._link_up.is_set():
            return  # the rows wait for on_connected, which makes them all due at once
        rows = self.outbox.due(self._clock(), self.ack_timer.timeout_s, self._cfg.resend_batch)
        sent: list[int] = []
        for row in rows:
            if self._publish(_TOPIC.get(row.kind, TopicKind.EVENTS), row.payload):
                sent.append(row.seq)
            else:
                self.publish_failures += 1
                break  # not connected: the rest waits for the reconnect
        self._time_sends(rows[: len(sent)], self._clock())
        if sent:
            self.published += len(sent)
            try:
                self.outbox.mark_sent(sent, self._clock())
            except StorageError as exc:  # remembered by the outbox: not due again before the timeout
                self._outbox_refused(exc)
        if len(sent) == self._cfg.resend_batch:
            self._resend_now.set()  # more may be due: next round at once

    def _time_sends(self, rows: list[OutboxRow], now: float) -> None:
        """Remember when each first send went out; a resent seq is not timed (Karn's rule)."""
        with self._timing_lock:
            for row in rows:
                if row.attempts == 0:
                    self._first_sent[row.seq] = now
                else:
                    self._first_sent.pop(row.seq, None)
            # Bounded: the oldest timings go first (an ack for them only loses a sample).
            while len(self._first_sent) > _TIMED_MAX:
                del self._first_sent[next(iter(self._first_sent))]

    def _report_drops(self) -> None:
        """Report what the bound dropped as one OUTBOX_DROPPED event (itself through the outbox).

        The outbox appends the report in the transaction that takes the pending span, so a report
        appended to a full outbox cannot drop another row and report that from inside the report
        (which would recurse without end): such a drop waits for the next report.
        """
        if self._holding or not self.outbox.drop_pending():
            return  # holding: the span stays pending on disk, reported after the messages held

        def build(seq: int, dropped: DroppedRange) -> bytes:
            return encode(
                Event(
                    seq=seq,
                    incarnation=self.outbox.incarnation,
                    ts=time.time(),
                    kind=EventKind.OUTBOX_DROPPED,
                    severity=Severity.WARNING,
                    message=(
                        f"outbox full: dropped {dropped.count} oldest messages "
                        f"(seq {dropped.first}..{dropped.last})"
                    ),
                    data={"first": dropped.first, "last": dropped.last, "count": dropped.count},
                )
            )

        try:
            with self._emit_lock:
                seq = self.outbox.append_drop_report(build, now=time.time())
        except StorageError as exc:  # rolled back: the span stays pending
            self._outbox_refused(exc)
            return
        if seq is not None:
            self._send_seq(seq)
