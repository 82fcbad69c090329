"""The controller's MQTT side: a small transport interface, its paho implementation, and the bridge
that turns incoming frames into typed messages for the services.

Nothing here touches the database: handlers only enqueue, so the paho network thread never waits on
disk or on a lock held by an API request.

With a share group (controller replicas) the bridge splits its subscriptions: the devices' bulk
traffic goes to the group, each message to one replica; command results come to every replica (each
wakes its own waiting request); availability and reported state, retained and order-sensitive, come to
the leader alone, which subscribes when it starts leading (the retained ones resync it) and
unsubscribes when it stops (:meth:`MqttBridge.set_leader`).

Several handlers may listen to one topic kind (:meth:`MqttBridge.on` returns the function that removes
one again). Each runs once per message, in the order they were added; a message is counted once, with
the worst outcome its handlers returned (:func:`combine_outcomes`).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import paho.mqtt.client as mqtt
from paho.mqtt.reasoncodes import ReasonCode
from pydantic import BaseModel

from controller.link.budget import DeviceBudgets
from fleet_protocol import ProtocolError, TopicKind, Topics, decode, encode
from fleet_protocol.codec import MAX_JSON_BYTES
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import Availability, Message
from fleet_protocol.paho_client import (
    connect_failure,
    connect_in_background,
    handle_connack,
    make_client,
)
from fleet_protocol.topics import SPECS

log = logging.getLogger(__name__)


# What a transport calls for every incoming frame. One that takes a ``retain`` keyword as well (the
# bridge's) is told whether the broker delivered the frame as a retained message.
MessageCallback = Callable[[str, bytes], None]


ConnectCallback = Callable[[], None]
# With a share group: one replica of the group gets each of these (round-robin on Mosquitto; nothing
# relies on which one).
SHARED_KINDS = frozenset(
    {TopicKind.DETECTIONS, TopicKind.EVENTS, TopicKind.HEARTBEAT, TopicKind.ARTIFACT_REQUEST}
)
# With a share group: the leader alone, so one consumer keeps each device's order; any other kind an
# agent sends reaches every replica.
LEADER_KINDS = frozenset({TopicKind.AVAILABILITY, TopicKind.TWIN_REPORTED})
SHARE_PREFIX = "$share/"

# A handler returns the outcome to count now, or None when it is not its to count now (a worker
# counts it later, or another handler of the same kind counts it).
Handler = Callable[[str, Message], str | None]
# Returned by MqttBridge.on: removes that one registration.
Remover = Callable[[], None]

_BIRTHS_MAX = 100_000

# Outcomes counted per topic kind.
OK = "ok"
INVALID = "invalid"
DUPLICATE = "duplicate"
DROPPED_QUEUE_FULL = "dropped_queue_full"
# Over the device's share of a queue every device shares: one device cannot fill it for the others.
DROPPED_DEVICE_SHARE = "dropped_device_share"
UNKNOWN_TOPIC = "unknown_topic"
STORE_FAILED = "store_failed"
UNKNOWN_ARTIFACT = "unknown_artifact"
BAD_CHUNK_INDEX = "bad_chunk_index"
UNKNOWN_KIND = "unknown"
# A message that decoded with fields or enumeration values this build does not know (a newer agent's
# additive change, PROTOCOL.md "Versions and compatibility"): counted besides its handler's outcome.
UNKNOWN_FIELDS = "unknown_fields"
ERROR = "error"  # a handler raised
# From a decommissioned device (a broker without per-device credentials still lets it publish).
REFUSED_DECOMMISSIONED = "refused_decommissioned"
# Over the device's per-device budget (controller/link/budget.py), dropped before decoding.
DROPPED_BUDGET = "dropped_budget"
# Delivered retained on a topic the contract does not retain: a stale replay (a device set the flag on
# its own publish, and the broker hands it to every new subscription), not something the device says now.
IGNORED_RETAINED = "ignored_retained"

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

    def unsubscribe(self, filters: list[str]) -> None:
        """Unsubscribe now if connected, and no longer subscribe after a reconnect."""

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
        # No in-flight window (0 = unlimited): paho's window is shared by every device, so with chunked
        # model pushes to many devices at once it, not the link, would set the pace; and with a window,
        # each PUBACK walks paho's out-messages from the start to find the next queued one
        # (Client._update_inflight), O(window) on the network thread per ack once acks queue up, and
        # queued acks count against paho's 65,535 message ids. What this process publishes is bounded
        # by its own queues and pacing.
        self._client.max_inflight_messages_set(0)
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
        self._pass_retain = False
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
        self._pass_retain = "retain" in inspect.signature(on_message).parameters
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

    def unsubscribe(self, filters: list[str]) -> None:
        gone = set(filters)
        with self._lock:
            self._subs = [sub for sub in self._subs if sub[0] not in gone]
        if self.connected and filters:
            self._client.unsubscribe(list(filters))

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

    def publish_confirmed(self, topic: str, payload: bytes, qos: int, retain: bool, timeout_s: float) -> bool:
        """Publish and wait up to ``timeout_s`` for the broker's PUBACK (QoS 1); False when it did not
        come. Not connected: False at once, without queueing (what was not sent is sent again by the
        caller's owner of the truth, not replayed stale from paho's queue after a reconnect)."""
        if not self.connected:
            return False
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        try:
            info.wait_for_publish(timeout_s)
        except (RuntimeError, ValueError) as exc:
            log.warning("publish to %s failed: %s", topic, exc)
            return False
        return info.is_published()

    # paho callbacks, on paho's network thread -------------------------------------------------

    def _on_connect(
        self, client: mqtt.Client, _userdata: Any, _flags: Any, reason_code: ReasonCode, _props: Any
    ) -> None:
        refusal = handle_connack(
            client,
            reason_code,
            log=log,
            broker=f"MQTT broker {self._target.host}:{self._target.port}",
            refused="the controller",
            hint="check the credentials in EDGEFLEET_MQTT_URL / EDGEFLEET_MQTT_PASSWORD",
        )
        if refusal is not None:
            if refusal.for_good:
                self.refused = refusal.reason
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
        cb: Any = self._on_message_cb
        if cb is None:
            return
        if self._pass_retain:
            cb(msg.topic, bytes(msg.payload), retain=bool(msg.retain))
        else:
            cb(msg.topic, bytes(msg.payload))


class MqttBridge:
    """Parses topics, decodes payloads, counts outcomes, and hands typed messages to handlers."""

    def __init__(
        self,
        transport: Transport,
        topics: Topics,
        *,
        share_group: str | None = None,
        budgets: DeviceBudgets | None = None,
    ) -> None:
        """``budgets``: per-device caps checked before decoding (None: none, as in tests that
        drive the bridge directly)."""
        self.transport = transport
        self.budgets = budgets
        self.topics = topics
        self.share_group = share_group
        # With a share group: whether this replica leads, i.e. holds the leader-only subscriptions.
        self._leading = False
        self._started = False
        self._subs_lock = threading.Lock()
        self.counters = Counters()
        # Copy on write: the paho thread reads a kind's tuple without a lock while on() adds to it.
        self._handlers: dict[TopicKind, tuple[_Registration, ...]] = {}
        self._handlers_lock = threading.Lock()
        self._connect_listeners: list[ConnectCallback] = []
        self._bad = RateLimitedLog(log)
        self._activity: dict[str, float] = {}
        # The incarnation each device's last birth named here (ingest starts a space only after one).
        self._births: dict[str, str | None] = {}
        # Devices whose messages are refused (decommissioned). Copy on write: read without a lock.
        self._refused: frozenset[str] = frozenset()
        self._refused_lock = threading.Lock()
        # This process's own changes (device -> (refused, monotonic time)), kept over a database read
        # that began before them (it may not see their commit yet).
        self._refused_changes: dict[str, tuple[bool, float]] = {}

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

    def set_refused(self, device_ids: Iterable[str], *, read_at: float) -> None:
        """Refuse (count, never hand on) what these devices send: the decommissioned ones, as the
        database said when read at ``read_at`` (``time.monotonic()`` before the read; the status worker
        reads it every few seconds, for other replicas' changes). This process's own changes since
        ``read_at`` stand."""
        with self._refused_lock:
            refused = set(device_ids)
            for device_id, (refuse, at) in list(self._refused_changes.items()):
                if at < read_at:
                    del self._refused_changes[device_id]  # the read saw it
                elif refuse:
                    refused.add(device_id)
                else:
                    refused.discard(device_id)
            self._refused = frozenset(refused)

    def refuse(self, device_id: str, refused: bool = True) -> None:
        """Refuse ``device_id`` from now on (False: take its messages again), in this process at once."""
        with self._refused_lock:
            self._refused_changes[device_id] = (refused, time.monotonic())
            self._refused = self._refused | {device_id} if refused else self._refused - {device_id}

    def on_connect(self, listener: ConnectCallback) -> None:
        self._connect_listeners.append(listener)

    def birth_incarnation(self, device_id: str) -> str | None:
        """The incarnation the last birth of ``device_id`` that reached this process named."""
        return self._births.get(device_id)

    def last_activity(self, device_id: str) -> float | None:
        """``time.monotonic()`` of the last valid message from ``device_id``."""
        return self._activity.get(device_id)

    def subscriptions(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """``(always, leader_only)``: the filters this bridge holds from its start, and those it holds
        only while its replica leads (none without a share group: one process leads always)."""
        group = self.share_group
        if group is None:
            return self.topics.controller_subscriptions(), []
        always: list[tuple[str, int]] = []
        leader: list[tuple[str, int]] = []
        for kind, spec in SPECS.items():
            if not spec.from_agent:
                continue
            filter_ = self.topics.all_devices(kind)
            if kind in LEADER_KINDS:
                leader.append((filter_, spec.qos))
            elif kind in SHARED_KINDS:
                always.append((f"{SHARE_PREFIX}{group}/{filter_}", spec.qos))
            else:
                always.append((filter_, spec.qos))
        return always, leader

    @property
    def leading(self) -> bool:
        """Whether the leader-only subscriptions are held (always, without a share group)."""
        return self.share_group is None or self._leading

    def set_leader(self, leading: bool) -> None:
        """Take (``True``) or drop the leader-only subscriptions; a no-op without a share group.

        May come before :meth:`start` (the first leadership is often settled first) and from any thread.
        """
        with self._subs_lock:
            if self.share_group is None or leading == self._leading:
                return
            self._leading = leading
            if not self._started:
                return
            _, leader = self.subscriptions()
            if leading:
                # A new subscription gets the retained birth and reported state of every device.
                self.transport.subscribe(leader)
            else:
                self.transport.unsubscribe([f for f, _ in leader])
        log.info("%s the leader-only subscriptions", "took" if leading else "dropped")

    def start(self) -> None:
        with self._subs_lock:
            always, leader = self.subscriptions()
            self.transport.subscribe(always + leader if self.leading else always)
            self._started = True
        self.transport.start(on_message=self.handle_message, on_connect=self._connected)

    def stop(self) -> None:
        self.transport.stop()

    def publish_message(self, device_id: str, kind: TopicKind, msg: BaseModel) -> None:
        spec = SPECS[kind]
        self.transport.publish(self.topics.device(device_id, kind), encode(msg), spec.qos, spec.retain)

    def publish_confirmed(self, device_id: str, kind: TopicKind, msg: BaseModel, timeout_s: float) -> bool:
        """Publish ``msg`` and wait for the broker to have it (PUBACK) up to ``timeout_s``.

        Lets a publisher holding a lock release it only once the broker has the message, so publishes
        from several controller replicas reach the broker in lock order. A transport that cannot confirm
        (the tests' fakes) publishes and answers True.
        """
        spec = SPECS[kind]
        topic = self.topics.device(device_id, kind)
        confirm = getattr(self.transport, "publish_confirmed", None)
        if confirm is None:
            self.transport.publish(topic, encode(msg), spec.qos, spec.retain)
            return True
        return bool(confirm(topic, encode(msg), spec.qos, spec.retain, timeout_s))

    def publish_raw(self, device_id: str, kind: TopicKind, payload: bytes) -> None:
        spec = SPECS[kind]
        self.transport.publish(self.topics.device(device_id, kind), payload, spec.qos, spec.retain)

    def clear_retained(self, device_id: str) -> None:
        """Have the broker forget every retained message of a device, on every topic kind.

        Not only the kinds the contract retains: a device may set the retain flag on any topic it
        publishes to (Mosquitto's ACLs cannot refuse the flag), and the broker would hand such a message
        to every new subscription, an id enrolled again on new hardware included. An empty retained
        publish deletes whatever is there and costs nothing where there is none.
        """
        for kind in TopicKind:
            self.transport.publish(self.topics.device(device_id, kind), b"", 1, True)

    def _connected(self) -> None:
        for listener in self._connect_listeners:
            try:
                listener()
            except Exception:
                log.exception("connect listener failed")

    def handle_message(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Entry point for every incoming frame; never raises (it runs on paho's thread).

        Checked before decoding, cheapest first: the topic, a retain flag the contract does not give
        this kind, a decommissioned device, the device's budget."""
        kind_name = UNKNOWN_KIND
        try:
            if topic.startswith(SHARE_PREFIX):
                # Brokers deliver the publisher's topic; should one pass the filter's form, drop the
                # "$share/<group>/" in front of it.
                topic = topic[len(SHARE_PREFIX) :].partition("/")[2]
            parsed = self.topics.parse(topic)
            handlers = self._handlers.get(parsed.kind, ()) if parsed is not None else ()
            if parsed is None or not handlers:
                self.counters.add(parsed.kind.value if parsed else UNKNOWN_KIND, UNKNOWN_TOPIC)
                self._bad.warning(
                    "topic:" + topic[:80], "ignoring message on unexpected topic %r", topic[:200]
                )
                return
            kind_name = parsed.kind.value
            device_id = parsed.device_id
            if retain and not SPECS[parsed.kind].retain:
                self.counters.add(kind_name, IGNORED_RETAINED)
                self._bad.warning(
                    f"{IGNORED_RETAINED}:{kind_name}",
                    "ignoring a retained %s from %s: this kind is never retained, so it is a stale replay",
                    kind_name,
                    device_id,
                )
                return
            if device_id in self._refused:
                self.counters.add(kind_name, REFUSED_DECOMMISSIONED)
                self._bad.warning(
                    f"{REFUSED_DECOMMISSIONED}:{device_id}",
                    "refusing %s from %s: the device is decommissioned (enroll it again to take it back)",
                    kind_name,
                    device_id,
                )
                return
            budgets = self.budgets
            # A payload over the decoder's size limit is refused by its length alone (as cheap as the
            # budget): it is counted invalid and spends nothing.
            if (
                budgets is not None
                and len(payload) <= MAX_JSON_BYTES
                and not budgets.allow(device_id, parsed.kind, len(payload))
            ):
                self.counters.add(kind_name, DROPPED_BUDGET)
                self._bad.warning(
                    f"{DROPPED_BUDGET}:{device_id}",
                    "dropping %s from %s: over its per-device budget",
                    kind_name,
                    device_id,
                )
                return

            def newer(what: tuple[str, ...]) -> None:
                self.counters.add(kind_name, UNKNOWN_FIELDS)
                self._bad.warning(
                    f"{UNKNOWN_FIELDS}:{kind_name}",
                    "ignoring what this build does not know in %s from %s (a newer agent?): %s",
                    kind_name,
                    device_id,
                    ", ".join(what)[:300],
                )

            try:
                msg = decode(parsed.kind, payload, newer)
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
            if isinstance(msg, Availability) and msg.state == "online":
                if len(self._births) >= _BIRTHS_MAX and device_id not in self._births:
                    self._births.clear()  # ids come from the network: keep the map bounded
                self._births[device_id] = msg.incarnation
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
