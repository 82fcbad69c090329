"""Commands from the controller (restart pipeline, snapshot, diagnostics), each answered by its id.

Commands arrive on the link's thread and run on the commands thread (:meth:`CommandRunner.run`), so a
slow snapshot never holds up MQTT. The queue between them is bounded: when it is full a command is
refused at once with "busy" rather than answered late. Every command gets exactly one result, also
when it fails (the error says why) or when the result is too large for one message.
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from edge_agent import __version__
from edge_agent.artifacts import ArtifactFetcher
from edge_agent.health import Health
from edge_agent.link import Transport
from edge_agent.outbox import Outbox
from edge_agent.pipeline import Pipeline
from edge_agent.publisher import Publisher
from fleet_protocol.codec import ProtocolError, encode
from fleet_protocol.messages import Command, CommandName, CommandResult, EventKind, Message
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)

# Commands waiting for the commands thread; one more is refused with "busy".
QUEUE_SIZE = 16
# A snapshot must fit one MQTT payload with the rest of the result; larger images are halved.
_SNAPSHOT_MAX_B64 = 400 * 1024


class CommandRunner:
    """Queues commands from the link, runs them on the commands thread, publishes the results."""

    def __init__(
        self,
        *,
        device_id: str,
        pipeline: Pipeline,
        publisher: Publisher,
        transport: Transport,
        outbox: Outbox,
        fetcher: ArtifactFetcher,
        health: Health,
        applied_version: Callable[[], int],
        stop: threading.Event,
    ) -> None:
        """``applied_version``: the desired version the twin last applied (-1 before the first)."""
        self.device_id = device_id
        self.pipeline = pipeline
        self.publisher = publisher
        self.transport = transport
        self.outbox = outbox
        self.fetcher = fetcher
        self.health = health
        self._applied_version = applied_version
        self._stop = stop
        self._queue: queue.Queue[Command] = queue.Queue(maxsize=QUEUE_SIZE)

    def on_message(self, msg: Message) -> None:
        if not isinstance(msg, Command):
            return
        try:
            self._queue.put_nowait(msg)
        except queue.Full:
            self._answer(CommandResult(id=msg.id, ok=False, error="busy: too many commands queued"))

    def _answer(self, result: CommandResult) -> None:
        try:
            payload = encode(result)
        except ProtocolError as exc:
            payload = encode(CommandResult(id=result.id, ok=False, error=f"result too large: {exc}"))
        self.transport.publish(TopicKind.COMMAND_RESULT, payload)

    def run(self) -> None:
        """The commands thread, until the stop event is set."""
        while not self._stop.is_set():
            try:
                cmd = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                result = self.execute(cmd)
            except Exception as exc:
                log.exception("command %s failed", cmd.name)
                # CommandResult.error is at most 4096 characters (fleet_protocol.messages.LongText).
                result = CommandResult(id=cmd.id, ok=False, error=f"{type(exc).__name__}: {exc}"[:4096])
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
            "desired_version": max(0, self._applied_version()),
            "connected": self.transport.connected,
            "cameras": [s.model_dump(mode="json") for s in self.pipeline.stats()],
            "providers": self.pipeline.providers(),
            "outbox": {
                "pending": self.outbox.pending(),
                "dropped": self.outbox.dropped,
                "next_seq": self.outbox.next_seq,
            },
            # What the data folder refuses to write now (disk full, read-only), and every refusal so far.
            "storage": self.publisher.storage.status(),
            "queue_dropped": self.pipeline.out.dropped,
            "inference_errors": self.pipeline.inference_errors,
            "watchdog": self.pipeline.watchdog_status(),
            "protocol_errors": dict(link_errors),
            "bad_chunks": self.fetcher.bad_chunks,
            "system": {k: v for k, v in self.health.system().items() if k != "gpus"},
        }

    def snapshot(self, camera: str, *, boxes: bool) -> dict[str, Any] | None:
        # OpenCV is imported on first use, as in capture.py: it comes with the `agent` extra only.
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
