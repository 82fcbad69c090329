"""The controller's MQTT side: a small transport interface, its paho implementation, and the bridge
that turns incoming frames into typed messages for the services.

Nothing here touches the database: handlers only enqueue, so the paho network thread never waits on
disk or on a lock held by an API request.

Several handlers may listen to one topic kind (:meth:`MqttBridge.on` returns the function that removes
one again). Each runs once per message, in the order they were added; a message is counted once, with
the worst outcome its handlers returned (:func:`combine_outcomes`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import paho.mqtt.client as mqtt
from paho.mqtt.reasoncodes import ReasonCode
from pydantic import BaseModel

from fleet_protocol import ProtocolError, TopicKind, Topics, decode, encode
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import Message
from fleet_protocol.paho_client import (
    Connack,
    classify_connack,
    connect_failure,
    connect_in_background,
    make_client,
)
from fleet_protocol.topics import SPECS

log = logging.getLogger(__name__)

MessageCallback = Callable[[str, bytes], None]
ConnectCallback = Callable[[], None]
# A handler returns the outcome to count now, or None when it is not its to count now (a worker
# counts it later, or another handler of the same kind counts it).
Handler = Callable[[str, Message], str | None]
# Returned by MqttBridge.on: removes that one registration.
Remover = Callable[[], None]

# Outcomes counted per topic kind.
OK = "ok"
INVALID = "invalid"
DUPLICATE = "duplicate"
DROPPED_QUEUE_FULL = "dropped_queue_full"
UNKNOWN_TOPIC = "unknown_topic"
STORE_FAILED = "store_failed"
UNKNOWN_ARTIFACT = "unknown_artifact"
BAD_CHUNK_INDEX = "bad_chunk_index"
UNKNOWN_KIND = "unknown"
ERROR = "error"  # a handler raised

# How bad an outcome is, for combining those of several handlers; any outcome not named here is a
# drop or failure (rank 2): the message did not get everywhere it was meant to.
_SEVERITY = {OK: 0, DUPLICATE: 1, ERROR: 3}


def combine_outcomes(first: str | None, second: str | None) -> str | None:
    """The outcome to count for a message two handlers answered ``first`` and ``second``.

    None yields to anything (that handler leaves the counting to a worker or to another handler). Of
    two outcomes the worse wins: OK < DUPLICATE < any drop or failure < ERROR; between two equally bad
    ones, the first. So a message one handler stored and another dropped is counted as dropped.
    """
    if first is None:
        return second
    if second is None:
        return first
    return second if _SEVERITY.get(second, 2) > _SEVERITY.get(first, 2) else first


class Transport(Protocol):
    """What the bridge needs from an MQTT client. Tests use a hand-written fake."""

    @property
    def connected(self) -> bool: ...

    def start(self, *, on_message: MessageCallback, on_connect: ConnectCallback) -> None:
        """Begin connecting in the background; call ``on_connect`` after every successful CONNACK."""

    def stop(self) -> None: ...

    def subscribe(self, topics: list[tuple[str, int]]) -> None:
        """Subscribe now if connected, and again after every reconnect."""

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None: ...


class Counters:
    """Thread-safe counts per (topic kind, outcome)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, kind: str, outcome: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            self._counts[(kind, outcome)] = self._counts.get((kind, outcome), 0) + n

    def get(self, kind: str, outcome: str) -> int:
        with self._lock:
            return self._counts.get((kind, outcome), 0)

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for (kind, outcome), n in sorted(self._counts.items()):
                out.setdefault(kind, {})[outcome] = n
            return out


class RateLimitedLog:
    """Logs at most one line per key per interval, saying how many were suppressed in between.

    A misbehaving device can send thousands of bad frames a second; the log must stay readable.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (float("-inf"), 0))
            if now - last < self._interval:
                self._last[key] = (last, suppressed + 1)
                return
            if len(self._last) > 10_000:  # keys come from the network: keep the map bounded
                self._last.clear()
            self._last[key] = (now, 0)
        if suppressed:
            self._log.warning(msg + " (%d similar suppressed)", *args, suppressed)
        else:
            self._log.warning(msg, *args)


class PahoTransport:
    """paho-mqtt 2.x client: background network loop, reconnect with backoff, resubscribe on connect."""

    def __init__(self, target: MqttEndpoint, *, client_id: str, keepalive: int = 30) -> None:
        self._target = target
        self._keepalive = keepalive
        # clean_session: correctness never relies on the broker queueing for us (agents resend
        # until acked), and a persistent session would replay a flood after a long outage.
        self._client = make_client(target, client_id=client_id, clean_session=True)
        # paho's default of 20 unacknowledged QoS 1 messages is shared by every device: with chunked
        # model pushes to many devices at once it, not the link, would set the pace.
        self._client.max_inflight_messages_set(1000)
        self._client.max_queued_messages_set(0)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_connect_fail = self._on_connect_fail
        self._client.on_subscribe = self._on_subscribe
        self._subs: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._on_message_cb: MessageCallback | None = None
        self._on_connect_cb: ConnectCallback | None = None
        self.refused: str | None = None  # reason, once the broker refused us for good
        # Why the link is not (fully) up: a failed connect (TLS, refused) or a refused subscription.
        # Shown by /healthz; cleared by the next good CONNACK / SUBACK.
        self.last_error: str | None = None
        self._error_log = RateLimitedLog(log, interval_s=60.0)
        self._stopping = False

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    def start(self, *, on_message: MessageCallback, on_connect: ConnectCallback) -> None:
        self._on_message_cb = on_message
        self._on_connect_cb = on_connect
        log.info("connecting to MQTT broker %s:%s", self._target.host, self._target.port)
        connect_in_background(self._client, self._target, keepalive=self._keepalive)

    def stop(self) -> None:
        self._stopping = True
        self._client.disconnect()
        self._client.loop_stop()
        self._connected.clear()

    def subscribe(self, topics: list[tuple[str, int]]) -> None:
        with self._lock:
            self._subs.extend(topics)
        if self.connected and topics:
            self._client.subscribe(topics)

    def resubscribe(self) -> None:
        """Subscribe again to everything (after the broker's ACL for us changed)."""
        with self._lock:
            subs = list(self._subs)
        if self.connected and subs:
            self._client.subscribe(subs)

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        # QoS 1/2 messages stay queued in paho while disconnected; only a QoS 0 one is lost here.
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            log.warning("publish to %s failed: %s", topic, mqtt.error_string(info.rc))

    # paho callbacks, on paho's network thread -------------------------------------------------

    def _on_connect(
        self, client: mqtt.Client, _userdata: Any, _flags: Any, reason_code: ReasonCode, _props: Any
    ) -> None:
        verdict = classify_connack(reason_code)
        if verdict is not Connack.ACCEPTED:
            if verdict is Connack.REFUSED:
                self.refused = str(reason_code)
                log.error(
                    "MQTT broker %s:%s refused the controller (%s); check the credentials in "
                    "EDGEFLEET_MQTT_URL / EDGEFLEET_MQTT_PASSWORD. Not retrying.",
                    self._target.host,
                    self._target.port,
                    reason_code,
                )
                # disconnect() from a callback makes paho's loop exit instead of reconnecting.
                client.disconnect()
            else:
                log.warning("MQTT broker refused the connection (%s); retrying", reason_code)
            return
        log.info("connected to MQTT broker %s:%s", self._target.host, self._target.port)
        self.last_error = None
        with self._lock:
            subs = list(self._subs)
        if subs:
            client.subscribe(subs)
        self._connected.set()
        if self._on_connect_cb is not None:
            try:
                self._on_connect_cb()
            except Exception:
                log.exception("on_connect handler failed")

    def _on_connect_fail(self, _client: mqtt.Client, _userdata: Any) -> None:
        self.last_error = connect_failure(f"MQTT broker {self._target.host}:{self._target.port}")
        self._error_log.warning("connect", "%s; retrying with backoff", self.last_error)

    def _on_subscribe(
        self, _client: mqtt.Client, _userdata: Any, _mid: int, reason_codes: list[ReasonCode], _props: Any
    ) -> None:
        if any(rc.is_failure for rc in reason_codes):
            self.last_error = (
                "the broker refused a subscription: the controller's MQTT user lacks read access to the "
                "device topics (ACL)"
            )
            log.error("%s", self.last_error)
        elif self.last_error is not None and "subscription" in self.last_error:
            self.last_error = None

    def _on_disconnect(
        self, _client: mqtt.Client, _userdata: Any, _flags: Any, reason_code: ReasonCode, _props: Any
    ) -> None:
        was = self._connected.is_set()
        self._connected.clear()
        if was and not self._stopping:
            log.warning("disconnected from MQTT broker (%s); reconnecting", reason_code)

    def _on_message(self, _client: mqtt.Client, _userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if self._on_message_cb is not None:
            self._on_message_cb(msg.topic, bytes(msg.payload))


class MqttBridge:
    """Parses topics, decodes payloads, counts outcomes, and hands typed messages to handlers."""

    def __init__(self, transport: Transport, topics: Topics) -> None:
        self.transport = transport
        self.topics = topics
        self.counters = Counters()
        # Copy on write: the paho thread reads a kind's tuple without a lock while on() adds to it.
        self._handlers: dict[TopicKind, tuple[_Registration, ...]] = {}
        self._handlers_lock = threading.Lock()
        self._connect_listeners: list[ConnectCallback] = []
        self._bad = RateLimitedLog(log)
        self._activity: dict[str, float] = {}

    @property
    def connected(self) -> bool:
        return self.transport.connected

    @property
    def link_error(self) -> str | None:
        """Why the broker link is down or partial, where the transport can tell (fakes cannot)."""
        error = getattr(self.transport, "last_error", None) or getattr(self.transport, "refused", None)
        return str(error) if error else None

    def on(self, kind: TopicKind, handler: Handler) -> Remover:
        """Route decoded messages of ``kind`` to ``handler`` too, after the handlers already there.

        Nothing is replaced: every handler of a kind runs once per message, in the order added, and one
        that raises does not keep the others from running. What they return is combined into the one
        outcome counted for the message (:func:`combine_outcomes`). Call the returned function to remove
        this registration again, and only it (the same handler added twice is two registrations); a
        kind left without handlers is an unexpected topic again.
        """
        registration = _Registration(handler)
        with self._handlers_lock:
            self._handlers[kind] = (*self._handlers.get(kind, ()), registration)

        def remove() -> None:
            with self._handlers_lock:
                rest = tuple(r for r in self._handlers.get(kind, ()) if r is not registration)
                if rest:
                    self._handlers[kind] = rest
                else:
                    self._handlers.pop(kind, None)

        return remove

    def on_connect(self, listener: ConnectCallback) -> None:
        self._connect_listeners.append(listener)

    def last_activity(self, device_id: str) -> float | None:
        """``time.monotonic()`` of the last valid message from ``device_id``."""
        return self._activity.get(device_id)

    def start(self) -> None:
        self.transport.subscribe(self.topics.controller_subscriptions())
        self.transport.start(on_message=self.handle_message, on_connect=self._connected)

    def stop(self) -> None:
        self.transport.stop()

    def publish_message(self, device_id: str, kind: TopicKind, msg: BaseModel) -> None:
        spec = SPECS[kind]
        self.transport.publish(self.topics.device(device_id, kind), encode(msg), spec.qos, spec.retain)

    def publish_raw(self, device_id: str, kind: TopicKind, payload: bytes) -> None:
        spec = SPECS[kind]
        self.transport.publish(self.topics.device(device_id, kind), payload, spec.qos, spec.retain)

    def _connected(self) -> None:
        for listener in self._connect_listeners:
            try:
                listener()
            except Exception:
                log.exception("connect listener failed")

    def handle_message(self, topic: str, payload: bytes) -> None:
        """Entry point for every incoming frame; never raises (it runs on paho's thread)."""
        kind_name = UNKNOWN_KIND
        try:
            parsed = self.topics.parse(topic)
            handlers = self._handlers.get(parsed.kind, ()) if parsed is not None else ()
            if parsed is None or not handlers:
                self.counters.add(parsed.kind.value if parsed else UNKNOWN_KIND, UNKNOWN_TOPIC)
                self._bad.warning(
                    "topic:" + topic[:80], "ignoring message on unexpected topic %r", topic[:200]
                )
                return
            kind_name = parsed.kind.value
            try:
                msg = decode(parsed.kind, payload)
            except ProtocolError as exc:
                self.counters.add(kind_name, INVALID)
                self._bad.warning(
                    f"invalid:{parsed.device_id}:{kind_name}",
                    "dropping invalid %s from %s: %s",
                    kind_name,
                    parsed.device_id,
                    str(exc)[:300],
                )
                return
            self._activity[parsed.device_id] = time.monotonic()
            outcome: str | None = None
            for registration in handlers:
                try:
                    answer = registration.handler(parsed.device_id, msg)
                except Exception:
                    answer = ERROR
                    log.exception("unexpected error handling a message on %r", topic[:200])
                outcome = combine_outcomes(outcome, answer)
            if outcome is not None:
                self.counters.add(kind_name, outcome)
        except Exception:
            self.counters.add(kind_name, ERROR)
            log.exception("unexpected error handling a message on %r", topic[:200])


class _Registration:
    """One ``MqttBridge.on`` call: its identity, not the handler's, is what its remover removes."""

    __slots__ = ("handler",)

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
