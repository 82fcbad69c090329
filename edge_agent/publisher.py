"""The publisher thread: frames -> DetectionBatch -> outbox -> MQTT, plus resends and events.

Everything that carries a ``seq`` goes through the outbox first (written before it is published),
so a message is never lost between the pipeline and the controller's ack.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from edge_agent.outbox import DroppedRange, Outbox
from edge_agent.queues import DropOldestQueue
from edge_agent.settings import OutboxConfig
from fleet_protocol.codec import ProtocolError, encode
from fleet_protocol.messages import Ack, DetectionBatch, Event, EventKind, FrameDetections, Severity
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)

KIND_DETECTIONS = "detections"
KIND_EVENTS = "events"
_TOPIC = {KIND_DETECTIONS: TopicKind.DETECTIONS, KIND_EVENTS: TopicKind.EVENTS}

PublishFn = Callable[[TopicKind, bytes], bool]


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
    ) -> None:
        self.outbox = outbox
        self._frames = frames
        self._publish = publish
        self._cfg = config
        self._stop = stop
        self._resend_interval = resend_interval_s
        self._resend_now = threading.Event()
        self._emit_lock = threading.Lock()
        self.published = 0
        self.publish_failures = 0
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    # ------------------------------------------------------------------ API (any thread)

    def start(self) -> None:
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
    ) -> int:
        """Persist an event in the outbox and try to publish it now; returns its seq."""

        def build(seq: int) -> bytes:
            return encode(
                Event(
                    seq=seq,
                    ts=time.time(),
                    kind=kind,
                    severity=severity,
                    camera=camera,
                    message=message[:4096],
                    data=data or {},
                )
            )

        with self._emit_lock:
            seq = self.outbox.append(KIND_EVENTS, build, now=time.time())
        self._send_seq(seq)
        self._report_drops()
        return seq

    def on_ack(self, ack: Ack) -> None:
        n = self.outbox.ack(ack)
        log.debug("ack upto %s: %s rows deleted", ack.upto, n)

    def on_connected(self) -> None:
        """Everything unacked is due again: what was in flight when the link broke may be gone."""
        self.outbox.reset_sent()
        self._resend_now.set()

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        batch: list[FrameDetections] = []
        first_at = 0.0
        next_resend = 0.0
        while not self._stop.is_set():
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
                self._flush(batch)
                batch = []
            if self._resend_now.is_set() or now >= next_resend:
                self._resend_now.clear()
                self._resend()
                next_resend = now + self._resend_interval
        # Stop: what the pipeline produced still goes to disk, to be sent after the next start.
        batch.extend(self._frames.drain())
        if batch:
            self._flush(batch, send=False)

    def _flush(self, frames: list[FrameDetections], *, send: bool = True) -> None:
        for part in self._split(frames):
            try:
                seq = self._append_batch(part)
            except ProtocolError as exc:
                log.error("dropping a batch of %s frames that cannot be encoded: %s", len(part), exc)
                continue
            if send:
                self._send_seq(seq)
        self._report_drops()

    def _split(self, frames: list[FrameDetections]) -> list[list[FrameDetections]]:
        return [frames[i : i + 500] for i in range(0, len(frames), 500)]

    def _append_batch(self, frames: list[FrameDetections]) -> int:
        def build(seq: int) -> bytes:
            return encode(DetectionBatch(seq=seq, sent_at=time.time(), frames=frames))

        try:
            with self._emit_lock:
                return self.outbox.append(KIND_DETECTIONS, build, now=time.time())
        except ProtocolError:
            if len(frames) == 1:
                raise
            # Over the payload size limit: halve until it fits.
            mid = len(frames) // 2
            self._append_batch(frames[:mid])
            return self._append_batch(frames[mid:])

    def _send_seq(self, seq: int) -> None:
        # Rows are sent by the resend pass: one code path, oldest first, marks what went out.
        self._resend_now.set()

    def _resend(self) -> None:
        rows = self.outbox.due(time.time(), self._cfg.ack_timeout_s, self._cfg.resend_batch)
        sent: list[int] = []
        for row in rows:
            if self._publish(_TOPIC.get(row.kind, TopicKind.EVENTS), row.payload):
                sent.append(row.seq)
            else:
                self.publish_failures += 1
                break  # not connected: the rest waits for the reconnect
        if sent:
            self.outbox.mark_sent(sent, time.time())
            self.published += len(sent)
        if len(sent) == self._cfg.resend_batch:
            self._resend_now.set()  # more may be due: next round at once

    def _report_drops(self) -> None:
        """Report what the bound dropped as one OUTBOX_DROPPED event (itself through the outbox).

        The outbox appends the report in the transaction that takes the pending span: appending it to
        a full outbox used to drop another row and report that from inside the report, recursing
        without end; now such a drop simply waits for the next report.
        """
        if not self.outbox.drop_pending():
            return

        def build(seq: int, dropped: DroppedRange) -> bytes:
            return encode(
                Event(
                    seq=seq,
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

        with self._emit_lock:
            seq = self.outbox.append_drop_report(build, now=time.time())
        if seq is not None:
            self._send_seq(seq)
