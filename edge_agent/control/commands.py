"""Commands from the controller, each answered by its id: restart the pipeline, one camera or the
agent; a snapshot; a diagnostics bundle; the recent log; a probe of a camera's source
(``diagnostics.py`` holds what the last three compute).

Commands arrive on the link's thread and run on the commands thread (:meth:`CommandRunner.run`), so a
slow snapshot never holds up MQTT. The queue between them is bounded: when it is full a command is
refused at once with "busy" rather than answered late. Every command gets exactly one result, also
when it fails (the error says why) or when the result is too large for one message.

A result is kept in the outbox (on disk, before it is published) until the broker acknowledges it
(PUBACK): one produced while the link is down, or whose PUBACK the cut took with it, is sent again after
the reconnect, also after a restart of the agent. A result carries no seq, so the controller's acks
cannot cover it (adding one would make controllers that refuse unknown fields refuse every result); the
controller records each command id once, so a result sent twice is harmless. The outbox bounds what it
keeps: the oldest snapshots lose their picture first (the result says so), then the oldest results go
whole (an ``error`` event names them).
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from edge_agent import __version__
from edge_agent.control import diagnostics
from edge_agent.core.logring import LogRing
from edge_agent.core.settings import AgentSettings
from edge_agent.device.health import Health
from edge_agent.uplink.artifacts import ArtifactFetcher
from edge_agent.uplink.link import Delivery, Handed, Transport
from edge_agent.uplink.outbox import Outbox, ResultsDropped
from edge_agent.uplink.publisher import Publisher
from edge_agent.vision.pipeline import Pipeline
from fleet_protocol.codec import ProtocolError, encode
from fleet_protocol.messages import Command, CommandName, CommandResult, EventKind, Message, Severity
from fleet_protocol.topics import TopicKind

log = logging.getLogger(__name__)

# Commands waiting for the commands thread; one more is refused with "busy".
QUEUE_SIZE = 16
# A snapshot must fit one MQTT payload with the rest of the result; larger images are halved.
_SNAPSHOT_MAX_B64 = 400 * 1024
# A safety net: kept results not in flight are tried again this often. A publish fails only on a link
# that is down, and the reconnect sends them at once.
RESEND_S = 60.0
# How long the commands thread waits for a command before it looks at the results in flight.
_POLL_S = 0.1


@runtime_checkable
class TrackedTransport(Protocol):
    """A transport that says when the broker has a message (MqttLink: paho's PUBACK for QoS 1)."""

    def publish_tracked(self, kind: TopicKind, payload: bytes) -> Delivery | None:
        """Publish like ``Transport.publish``; None when not connected (nothing queued)."""
        ...


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
        resend_s: float = RESEND_S,
        settings: AgentSettings | None = None,
        logs: LogRing | None = None,
        restart_agent: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``applied_version``: the desired version the twin last applied (-1 before the first);
        ``resend_s``: how often kept results not in flight are tried again without a reconnect;
        ``settings``: what the diagnostics bundle shows (redacted); ``logs``: the ring the ``logs``
        command reads; ``restart_agent(why)``: ends the process to be started again (None: the command
        is refused, as on an agent that nothing would restart)."""
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
        self._tracked = transport.publish_tracked if isinstance(transport, TrackedTransport) else None
        # Held while a result is kept and sent, and during a resend pass: a result is never sent twice
        # by this process on one connection, and a PUBACK is never taken for the wrong publish.
        self._send_lock = threading.Lock()
        # Command id -> its publish on the current connection, until the broker acknowledges it.
        self._inflight: dict[str, Delivery] = {}
        # Acknowledged by the broker but not yet forgotten by the outbox (a disk refusing the delete).
        self._delivered: set[str] = set()
        # Set by a (re)connect: what was in flight on the old connection may never be acknowledged.
        self._reconnected = threading.Event()
        # Kept results not in flight: due at the next pass (start-up: those kept before a restart).
        self._due = True
        self._resend_s = resend_s
        self._next_try = 0.0
        self.settings = settings
        self.logs = logs
        self.restart_agent = restart_agent
        # When each queued command arrived (its id -> unix seconds), for the clock reading.
        self._arrived: dict[str, float] = {}
        # What a command does once its result is kept (the agent's restart), run by the commands thread.
        self._after_answer: Callable[[], None] | None = None

    def on_message(self, msg: Message) -> None:
        if not isinstance(msg, Command):
            return
        try:
            self._arrived[msg.id] = time.time()
            self._queue.put_nowait(msg)
        except queue.Full:
            self._arrived.pop(msg.id, None)
            self._answer(CommandResult(id=msg.id, ok=False, error="busy: too many commands queued"))

    def on_connected(self) -> None:
        """The link is (re)connected: kept results not acknowledged yet go out again (link thread)."""
        self._reconnected.set()

    def _answer(self, result: CommandResult) -> None:
        """Keep ``result`` in the outbox, then publish it (any thread)."""
        try:
            payload = encode(result)
        except ProtocolError as exc:
            result = CommandResult(id=result.id, ok=False, error=f"result too large: {exc}")
            payload = encode(result)
        slim = _without_picture(result)
        with self._send_lock:
            kept = self._keep(result.id, payload, slim)
            delivery = self._publish(payload)
            if kept and delivery is not None:
                self._inflight[result.id] = delivery
            # Not sent (link down): kept, and sent by the pass after the reconnect.

    def _keep(self, command_id: str, payload: bytes, slim: bytes | None) -> bool:
        # Caller holds _send_lock. A result the outbox refuses (disk full, outbox closed at shutdown)
        # is still published once now: it is then merely not sent again.
        try:
            dropped = self.outbox.put_result(command_id, payload, slim=slim, now=time.time())
        except Exception as exc:
            log.error("command result %s not kept in the outbox (%s): sent once, not again", command_id, exc)
            return False
        if dropped:
            self._report_dropped(dropped)
        return True

    def _report_dropped(self, dropped: ResultsDropped) -> None:
        if dropped.pictures:
            log.warning(
                "command results outbox full: dropped the pictures of %s (kept without them)",
                ", ".join(dropped.pictures),
            )
        if dropped.results:
            log.warning("command results outbox full: dropped %s", ", ".join(dropped.results))
            # Through the seq outbox, which the controller acks: the loss is told even if it lasts.
            self.publisher.emit_event(
                EventKind.ERROR,
                severity=Severity.WARNING,
                message=f"command results outbox full: dropped the results of {len(dropped.results)} "
                "commands before the broker had them",
                data={"error": "command_results_dropped", "ids": dropped.results[:100]},
            )

    def _publish(self, payload: bytes) -> Delivery | None:
        if self._tracked is not None:
            return self._tracked(TopicKind.COMMAND_RESULT, payload)
        return Handed() if self.transport.publish(TopicKind.COMMAND_RESULT, payload) else None

    def deliver(self) -> None:
        """One pass over the kept results (commands thread): forget those the broker acknowledged,
        send the others again after a reconnect (or every ``resend_s``)."""
        with self._send_lock:
            self._settle()
            now = time.monotonic()
            if not self._due and now < self._next_try:
                return
            self._due = False
            self._next_try = now + self._resend_s
            for command_id in self.outbox.result_ids():
                if command_id in self._inflight or command_id in self._delivered:
                    continue
                payload = self.outbox.result_payload(command_id)
                if payload is None:
                    continue  # delivered or dropped meanwhile
                delivery = self._publish(payload)
                if delivery is None:
                    return  # link down: the reconnect brings the next pass
                self._inflight[command_id] = delivery

    def _settle(self) -> None:
        # Caller holds _send_lock. Acknowledged first: a PUBACK that came just before a cut counts.
        done = [cid for cid, d in self._inflight.items() if d.is_published()]
        for cid in done:
            del self._inflight[cid]
        self._delivered.update(done)
        if self._delivered:
            try:
                self.outbox.results_delivered(self._delivered)
                self._delivered.clear()
            except Exception as exc:  # kept on disk: forgotten with the next pass that can write
                log.warning("could not forget %d delivered command results: %s", len(self._delivered), exc)
        if self._reconnected.is_set():
            self._reconnected.clear()
            # No PUBACK comes for a publish of the old connection that this one does not complete:
            # send them all again (the controller records each command id once).
            self._inflight.clear()
            self._due = True

    def run(self) -> None:
        """The commands thread, until the stop event is set."""
        while not self._stop.is_set():
            try:
                cmd = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                self._deliver_logged()
                continue
            # After a reconnect the results kept from before go out first, ahead of this one (the link
            # marks the reconnect before it hands over a command the broker sends again after a cut).
            self._deliver_logged()
            try:
                result = self.execute(cmd)
            except Exception as exc:
                log.exception("command %s failed", cmd.name)
                # CommandResult.error is at most 4096 characters (fleet_protocol.messages.LongText).
                result = CommandResult(id=cmd.id, ok=False, error=f"{type(exc).__name__}: {exc}"[:4096])
            self._answer(result)
            then, self._after_answer = self._after_answer, None
            if then is not None:
                then()

    def _deliver_logged(self) -> None:
        # The thread that answers every command must outlive a failing pass (a database error).
        try:
            self.deliver()
        except Exception:
            log.exception("command results pass failed")
            self._stop.wait(1.0)

    def execute(self, cmd: Command) -> CommandResult:
        received_at = self._arrived.pop(cmd.id, time.time())
        try:
            return self._execute(cmd, received_at)
        except diagnostics.ArgError as exc:
            return CommandResult(id=cmd.id, ok=False, error=f"bad arguments: {exc}")

    def _execute(self, cmd: Command, received_at: float) -> CommandResult:
        if cmd.name == CommandName.DIAGNOSTICS:
            bundle = self.diagnostics()
            bundle["clock"] = diagnostics.clock(cmd.args, received_at)
            return CommandResult(id=cmd.id, ok=True, result=bundle)
        if cmd.name == CommandName.LOGS:
            return CommandResult(id=cmd.id, ok=True, result=diagnostics.log_lines(self.logs, cmd.args))
        if cmd.name in (CommandName.PROBE_CAMERA, CommandName.RESTART_CAMERA):
            camera = cmd.args.get("camera")
            worker = self.pipeline.cameras.get(camera) if isinstance(camera, str) else None
            if worker is None:
                return CommandResult(id=cmd.id, ok=False, error=f"unknown camera {camera!r}")
            if cmd.name == CommandName.RESTART_CAMERA:
                worker.reopen()
                log.info("camera %s restarted by command %s", camera, cmd.id)
                return CommandResult(id=cmd.id, ok=True, result={"restarted": camera})
            timeout = cmd.args.get("timeout_s", diagnostics.PROBE_TIMEOUT_S)
            if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 60:
                raise diagnostics.ArgError(
                    f"timeout_s must be a number of seconds up to {diagnostics.MAX_PROBE_TIMEOUT_S:g}"
                )
            probe = diagnostics.probe_source(worker.config, timeout_s=float(timeout), stop=self._stop)
            return CommandResult(id=cmd.id, ok=True, result={"camera": camera, **probe.as_dict()})
        if cmd.name == CommandName.RESTART_AGENT:
            if self.restart_agent is None:
                return CommandResult(id=cmd.id, ok=False, error="this agent cannot restart itself")
            why = {"command": cmd.id, "by": str(cmd.args.get("by", ""))[:64], "at": time.time()}
            restart = self.restart_agent
            # After the answer is kept in the outbox (run()): it survives the restart and goes out then
            # if the broker did not have it yet.
            self._after_answer = lambda: restart(why)
            return CommandResult(id=cmd.id, ok=True, result={"restarting": True})
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
                "results": self.outbox.results_figures(),
            },
            # What the data folder refuses to write now (disk full, read-only), and every refusal so far.
            "storage": self.publisher.storage.status(),
            "queue_dropped": self.pipeline.out.dropped,
            "inference_errors": self.pipeline.inference_errors,
            "watchdog": self.pipeline.watchdog_status(),
            "protocol_errors": dict(link_errors),
            "bad_chunks": self.fetcher.bad_chunks,
            "system": {k: v for k, v in self.health.system().items() if k != "gpus"},
            "uplink": self._uplink(),
            "inference_stack": diagnostics.inference_stack(),
            "config": diagnostics.redacted_config(self.settings) if self.settings is not None else None,
        }

    def _uplink(self) -> dict[str, Any]:
        """The link's state in words: connected or not, and the connect errors it met (newest last)."""
        errors = getattr(self.transport, "connect_errors", None)
        return {
            "connected": self.transport.connected,
            "last_error": getattr(self.transport, "last_error", None),
            "connect_errors": [{"at": at, "error": err} for at, err in errors] if errors is not None else [],
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


def _without_picture(result: CommandResult) -> bytes | None:
    """What the outbox keeps of a snapshot result when its bound drops the picture (None: no picture).

    Not ``ok``: whoever waits for a snapshot needs the picture, and is told why it is missing.
    """
    if "jpeg_base64" not in result.result:
        return None
    rest = {k: v for k, v in result.result.items() if k != "jpeg_base64"}
    return encode(
        CommandResult(
            id=result.id,
            ok=False,
            error="picture dropped: the agent's outbox was full while the link was down",
            result={**rest, "jpeg_dropped": True},
        )
    )
