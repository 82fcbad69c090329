"""Commands to devices: request/response over MQTT with correlation ids.

``request`` publishes a :class:`Command` on ``devices/{d}/commands`` with a fresh id and waits (with a
deadline, interruptible by the controller's stop event) for the :class:`CommandResult` carrying the
same id on ``devices/{d}/commands/result``. Results nobody waits for (late, or unknown ids) are counted
and passed on like every result.

Every result is recorded once, as a ``command_result`` event (:func:`command_result_event`): the agent
keeps a result until the broker has it and sends it again after a cut, and MQTT QoS 1 may deliver it
twice, so the same command id can arrive more than once; the event log looks the id up before adding
it. A result for a request this process gave up on (timed out) is recorded as ``late``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col, select

from controller.db.engine import db_json, db_text
from controller.db.tables import Event
from controller.errors import DeviceError, NotFoundError, TimedOutError, UnavailableError
from controller.link.bridge import MqttBridge
from fleet_protocol import TopicKind
from fleet_protocol.messages import Command, CommandName, CommandResult, Message

log = logging.getLogger(__name__)

MAX_PENDING = 256
# Requests given up on (timed out, stopping), remembered so that their result is recorded as late; the
# oldest is forgotten first (its result, if it ever comes, is then merely unmatched).
MAX_EXPIRED = 1024
EVENT_KIND = "command_result"
# Put in a result's ``result`` by :meth:`CommandService.results_then` for a request that had given up;
# :func:`command_result_event` moves it to the event's ``late``. Stripped from what devices send.
_LATE = "_edgefleet_late"
# Keyed like the leader's lock (controller/db/leader.py) by database and schema, then by the result.
_RESULT_LOCK_SQL = (
    "SELECT pg_advisory_xact_lock(hashtextextended('edgefleet-command-result:' || current_database() "
    "|| ':' || coalesce(current_schema(), '') || ':' || :device || ':' || :id, 0))"
)


class CommandError(UnavailableError):
    """A command could not be answered; ``reason`` is one of ``timeout``, ``busy``, ``stopping``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class CommandTimeoutError(CommandError, TimedOutError):
    """The device did not answer within the timeout (``reason`` is ``timeout``)."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


class CommandFailedError(DeviceError):
    """The device answered a command with an error of its own; ``error`` is its words."""

    def __init__(self, message: str, *, error: str) -> None:
        super().__init__(message)
        self.error = error

    @staticmethod
    def of(device_id: str, error: str | None, *, doing: str) -> CommandFailedError:
        """A device's refusal as the kind of error it is (devices say it in words): an unknown camera,
        not ready yet (no frame, busy), or any other failure ("device … could not ``doing``: …")."""
        err = error or "unknown error"
        if err.startswith("unknown camera"):
            return UnknownCameraError(f"device {device_id}: {err}", error=err)
        if "no frame" in err or err.startswith("busy"):
            return DeviceNotReadyError(f"device {device_id}: {err}", error=err)
        return CommandFailedError(f"device {device_id} could not {doing}: {err}", error=err)


class UnknownCameraError(CommandFailedError, NotFoundError):
    """The device has no camera of the id the command named."""


class DeviceNotReadyError(CommandFailedError, UnavailableError):
    """The device cannot do it yet (the camera has no frame yet, or it is busy); later it may."""


@dataclass
class _Pending:
    device_id: str
    done: threading.Event = field(default_factory=threading.Event)
    result: CommandResult | None = None


def command_result_event(
    s: Session, device_id: str, msg: CommandResult, *, received_at: datetime
) -> Event | None:
    """The event that records ``msg``, or None when its command id is recorded already (a result sent
    again after a cut, a QoS 1 duplicate). Add it in the session that looked, before it commits.

    In one process one status worker writes command results, and the session's autoflush shows it an
    event added earlier in its batch. Replicas all get every result: on PostgreSQL the look-up first
    takes a transaction lock on the command id, so the replica that waited sees the row the first one
    committed instead of adding a second.
    """
    command_id = db_text(msg.id) or ""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(sa.text(_RESULT_LOCK_SQL), {"device": device_id, "id": command_id})
    seen = s.exec(
        select(Event.id)
        .where(
            col(Event.kind) == EVENT_KIND,
            col(Event.device_id) == device_id,
            col(Event.data)["id"].as_string() == command_id,
        )
        .limit(1)
    ).first()
    if seen is not None:
        log.info("command result %s from %s is recorded already: duplicate dropped", msg.id, device_id)
        return None
    data = db_json(msg.model_dump(mode="json"))
    # The id as looked up: PostgreSQL cannot turn a JSON "\u0000" into text, and one such row would
    # break every later look-up of the device's results.
    data["id"] = command_id
    if data["result"].pop(_LATE, None) is True:
        data["late"] = True
    return Event(
        device_id=device_id,
        ts=received_at,
        kind=EVENT_KIND,
        severity="info" if msg.ok else "error",
        message=db_text(msg.error) or "",
        data=data,
    )


class CommandService:
    def __init__(self, bridge: MqttBridge, *, stop: threading.Event, max_pending: int = MAX_PENDING) -> None:
        self._bridge = bridge
        self._stop = stop
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        # Command id -> device, for requests that gave up without a result.
        self._expired: OrderedDict[str, str] = OrderedDict()
        self.unmatched = 0  # results that arrived for no waiting request (late or foreign)
        self.late = 0  # of those, results for a request of this process that had given up

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def request(
        self, device_id: str, name: CommandName, args: dict[str, Any] | None = None, *, timeout: float
    ) -> CommandResult:
        """Send a command and wait for its result; raises :class:`CommandError` without one."""
        cmd_id = uuid.uuid4().hex
        p = _Pending(device_id)
        with self._lock:
            if len(self._pending) >= self._max_pending:
                raise CommandError("busy", f"too many commands in flight ({self._max_pending})")
            self._pending[cmd_id] = p
        try:
            self._bridge.publish_message(
                device_id, TopicKind.COMMANDS, Command(id=cmd_id, name=name, args=args or {})
            )
            deadline = time.monotonic() + timeout
            # Wait in short slices so that a stopping controller does not hold a request open.
            while not p.done.wait(max(0.0, min(0.05, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise CommandTimeoutError(
                        f"device {device_id} did not answer the {name.value} command within {timeout:g} s",
                    )
                if self._stop.is_set():
                    raise CommandError("stopping", "the controller is shutting down")
            assert p.result is not None
            return p.result
        finally:
            with self._lock:
                self._pending.pop(cmd_id, None)
                if p.result is None:
                    self._expired[cmd_id] = device_id
                    while len(self._expired) > MAX_EXPIRED:
                        self._expired.popitem(last=False)

    def on_result(self, device_id: str, msg: CommandResult) -> bool:
        """Hand a result to its waiting request; True when one was waiting for it."""
        with self._lock:
            p = self._pending.get(msg.id)
        if p is None or p.device_id != device_id:
            with self._lock:
                self.unmatched += 1
            return False
        p.result = msg
        p.done.set()
        return True

    def _was_given_up(self, device_id: str, command_id: str) -> bool:
        """True (once) when ``command_id`` is a request of this process to ``device_id`` that gave up."""
        with self._lock:
            if self._expired.get(command_id) != device_id:
                return False
            del self._expired[command_id]
            self.late += 1
        log.info("late result for command %s from %s: its request had given up", command_id, device_id)
        return True

    def results_then(
        self, then: Callable[[str, Message], str | None]
    ) -> Callable[[str, Message], str | None]:
        """A bridge handler for command results: wake the waiting request, then pass it on (``then``).

        Snapshot images are not passed on: the event log keeps that a snapshot was taken, not its bytes.
        A result for a request of this process that gave up is passed on marked late.
        """

        def handle(device_id: str, msg: Message) -> str | None:
            if isinstance(msg, CommandResult):
                late = not self.on_result(device_id, msg) and self._was_given_up(device_id, msg.id)
                logged = {k: v for k, v in msg.result.items() if k not in ("jpeg_base64", _LATE)}
                if "jpeg_base64" in msg.result:
                    logged["jpeg_bytes"] = len(msg.result["jpeg_base64"]) * 3 // 4
                if late:
                    logged[_LATE] = True
                if logged != msg.result:
                    msg = msg.model_copy(update={"result": logged})
            return then(device_id, msg)

        return handle
