"""Commands to devices: request/response over MQTT with correlation ids.

``request`` publishes a :class:`Command` on ``devices/{d}/commands`` with a fresh id and waits (with a
deadline, interruptible by the controller's stop event) for the :class:`CommandResult` carrying the
same id on ``devices/{d}/commands/result``. Results nobody waits for (late, or unknown ids) are counted
and passed on like every result.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from controller.errors import DeviceError, NotFoundError, TimedOutError, UnavailableError
from controller.link.bridge import MqttBridge
from fleet_protocol import TopicKind
from fleet_protocol.messages import Command, CommandName, CommandResult, Message

log = logging.getLogger(__name__)

MAX_PENDING = 256


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


class CommandService:
    def __init__(self, bridge: MqttBridge, *, stop: threading.Event, max_pending: int = MAX_PENDING) -> None:
        self._bridge = bridge
        self._stop = stop
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self.unmatched = 0  # results that arrived for no waiting request (late or foreign)

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

    def results_then(
        self, then: Callable[[str, Message], str | None]
    ) -> Callable[[str, Message], str | None]:
        """A bridge handler for command results: wake the waiting request, then pass it on (``then``).

        Snapshot images are not passed on: the event log keeps that a snapshot was taken, not its bytes.
        """

        def handle(device_id: str, msg: Message) -> str | None:
            if isinstance(msg, CommandResult):
                self.on_result(device_id, msg)
                if "jpeg_base64" in msg.result:
                    slim = {k: v for k, v in msg.result.items() if k != "jpeg_base64"}
                    slim["jpeg_bytes"] = len(msg.result["jpeg_base64"]) * 3 // 4
                    msg = msg.model_copy(update={"result": slim})
            return then(device_id, msg)

        return handle
