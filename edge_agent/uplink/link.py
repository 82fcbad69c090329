"""The MQTT link: a small transport interface and its paho implementation.

The agent only talks to :class:`Transport`, so its logic is tested with a fake. MqttLink follows
PROTOCOL.md "Connection (agent)": client id = device id, persistent session, Last Will offline,
birth + subscriptions + reported state on every CONNACK, stop retrying on bad credentials.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Protocol

import paho.mqtt.client as mqtt
from paho.mqtt.reasoncodes import ReasonCode

from fleet_protocol.codec import ProtocolError, decode, encode
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import Availability, Message
from fleet_protocol.paho_client import (
    Will,
    connect_failure,
    connect_in_background,
    handle_connack,
    make_client,
)
from fleet_protocol.topics import SPECS, TopicKind, Topics

log = logging.getLogger(__name__)

# Distinct connect failures remembered (the same one repeated updates its time instead).
CONNECT_ERRORS_KEPT = 20

MessageHandler = Callable[[Message], None]
ChunkHandler = Callable[[bytes], None]


class Delivery(Protocol):
    """A publish in flight: ``is_published()`` turns True once the broker has it (QoS 1: its PUBACK)."""

    def is_published(self) -> bool: ...


class Handed:
    """The delivery of a transport that can say no more than that it took the message."""

    def is_published(self) -> bool:
        return True


class Transport(Protocol):
    """What the agent needs from a message link."""

    @property
    def connected(self) -> bool: ...

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        """Publish with the topic's QoS/retain; False when not connected (nothing queued)."""
        ...

    def on_message(self, kind: TopicKind, handler: MessageHandler) -> None: ...

    def on_chunk(self, handler: ChunkHandler) -> None: ...

    def set_callbacks(
        self,
        *,
        birth: Callable[[], Availability],
        on_connected: Callable[[], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        """``birth`` builds the online message; ``on_connected`` runs after each successful CONNACK
        (after birth and subscriptions); ``on_fatal`` when retrying cannot help."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class MqttLink:
    """paho-mqtt 2.x client wrapped as a :class:`Transport`."""

    def __init__(
        self,
        endpoint: MqttEndpoint,
        *,
        device_id: str,
        topics: Topics,
        reconnect_min_s: float = 1.0,
        reconnect_max_s: float = 30.0,
        keepalive_s: int = 15,
    ) -> None:
        self._endpoint = endpoint
        self._device_id = device_id
        self._topics = topics
        self._birth: Callable[[], Availability] = lambda: Availability(state="online", ts=time.time())
        self._on_connected: Callable[[], None] | None = None
        self._on_fatal: Callable[[str], None] | None = None
        self._handlers: dict[TopicKind, MessageHandler] = {}
        # paho's handle of the last publish, per thread: publish_tracked reads it right after publish.
        self._last_publish = threading.local()
        self._chunk_handler: ChunkHandler | None = None
        self._connected = threading.Event()
        # Set by the broker's SUBACK for this connection's subscriptions: until then a message to the
        # device may be dropped by the broker, which is what a sender that just saw us connect needs.
        self._subscribed = threading.Event()
        self._subscribe_mid: int | None = None
        self.fatal: str | None = None
        # Why the last connection attempt failed (TLS verification above all); None once connected.
        self.last_error: str | None = None
        # The newest connect failures (unix seconds, in words), kept after a connection succeeds: what
        # a technician or the diagnostics bundle reads to learn why the link was down.
        self.connect_errors: deque[tuple[float, str]] = deque(maxlen=CONNECT_ERRORS_KEPT)
        # Connection attempts so far (the first and every reconnect), counted as paho starts each one:
        # shows that a failing link keeps trying with its backoff instead of having given up.
        self.connect_attempts = 0
        self._last_error_logged: tuple[str, float] | None = None
        self.protocol_errors: dict[str, int] = {}
        # Messages that decoded with fields or values this build does not know, per topic kind (a newer
        # controller's additive change, PROTOCOL.md "Versions and compatibility").
        self.unknown_fields: dict[str, int] = {}
        self._last_unknown_log: dict[str, float] = {}
        # Told about every payload of a known kind that does not decode (after it is counted), e.g. so
        # that the twin reports a refused desired state; never raises into the network thread.
        self.on_undecodable: Callable[[TopicKind, str], None] | None = None
        self._last_error_log = 0.0
        self._keepalive = keepalive_s
        # PROTOCOL.md "Connection (agent)": client id = device id, persistent session, Last Will offline.
        client = make_client(
            endpoint,
            client_id=device_id,
            clean_session=False,
            will=Will(
                topics.device(device_id, TopicKind.AVAILABILITY),
                encode(Availability(state="offline")),
                qos=SPECS[TopicKind.AVAILABILITY].qos,
                retain=True,
            ),
            reconnect_min_s=reconnect_min_s,
            reconnect_max_s=reconnect_max_s,
        )
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_connect_fail = self._handle_connect_fail
        client.on_message = self._handle_message
        client.on_subscribe = self._handle_subscribe
        client.on_pre_connect = self._handle_pre_connect
        self._client = client

    # ------------------------------------------------------------------ Transport

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def subscribed(self) -> bool:
        """Connected and the broker granted every subscription of this connection."""
        return self._connected.is_set() and self._subscribed.is_set()

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        if not self._connected.is_set():
            return False
        spec = SPECS[kind]
        info = self._client.publish(
            self._topics.device(self._device_id, kind), payload, spec.qos, spec.retain
        )
        self._last_publish.info = info
        return info.rc == mqtt.MQTT_ERR_SUCCESS

    def publish_tracked(self, kind: TopicKind, payload: bytes) -> Delivery | None:
        """:meth:`publish`, returning paho's handle, whose ``is_published()`` turns True with the
        broker's PUBACK (QoS 1); None when not published. It goes through :meth:`publish`, so a subclass
        that replaces that (a test's link without a network) is taken at its word."""
        self._last_publish.info = None
        if not self.publish(kind, payload):
            return None
        info: Delivery | None = self._last_publish.info
        return info if info is not None else Handed()

    def on_message(self, kind: TopicKind, handler: MessageHandler) -> None:
        self._handlers[kind] = handler

    def on_chunk(self, handler: ChunkHandler) -> None:
        self._chunk_handler = handler

    def set_callbacks(
        self,
        *,
        birth: Callable[[], Availability],
        on_connected: Callable[[], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        self._birth = birth
        self._on_connected = on_connected
        self._on_fatal = on_fatal

    def start(self) -> None:
        log.info("connecting to %s as %s", self._endpoint, self._device_id)
        connect_in_background(self._client, self._endpoint, keepalive=self._keepalive)

    def stop(self) -> None:
        if self._connected.is_set():
            try:
                info = self._client.publish(
                    self._topics.device(self._device_id, TopicKind.AVAILABILITY),
                    encode(Availability(state="offline", ts=time.time())),
                    qos=1,
                    retain=True,
                )
                info.wait_for_publish(timeout=3.0)
            except (RuntimeError, ValueError) as exc:
                log.warning("could not publish offline availability: %s", exc)
        self._client.disconnect()
        self._client.loop_stop()
        self._connected.clear()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    # ------------------------------------------------------------------ paho callbacks
    # Never raise from these: paho runs them on its network thread.

    def _handle_connect(
        self, client: mqtt.Client, userdata: object, flags: object, reason: object, properties: object
    ) -> None:
        try:
            refusal = handle_connack(
                client, reason, log=log, broker="broker", hint="check the credentials / ACL"
            )
            if refusal is not None:
                self._failed(f"broker refused the connection: {refusal.reason}")
                if refusal.for_good:
                    self.fatal = f"broker refused the connection: {refusal.reason}"
                    if self._on_fatal is not None:
                        self._on_fatal(self.fatal)
                return
            log.info("connected to %s", self._endpoint)
            self.last_error = None
            spec = SPECS[TopicKind.AVAILABILITY]
            client.publish(
                self._topics.device(self._device_id, TopicKind.AVAILABILITY),
                encode(self._birth()),
                spec.qos,
                spec.retain,
            )
            self._subscribed.clear()
            _, self._subscribe_mid = client.subscribe(self._topics.agent_subscriptions(self._device_id))
            self._connected.set()
            if self._on_connected is not None:
                self._on_connected()
        except Exception:
            log.exception("on_connect failed")

    def _handle_subscribe(
        self, client: mqtt.Client, userdata: object, mid: int, reason_codes: list[ReasonCode], props: object
    ) -> None:
        if mid != self._subscribe_mid:
            return
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        if refused:
            # Connected but deaf: the broker's ACL does not let this device read its own topics.
            self.last_error = (
                f"the broker refused the device's subscriptions ({', '.join(refused)}): check the ACL"
            )
            log.error("%s", self.last_error)
            return
        self._subscribed.set()

    def _handle_pre_connect(self, client: mqtt.Client, userdata: object) -> None:
        self.connect_attempts += 1  # only paho's network thread writes it

    def _handle_connect_fail(self, client: mqtt.Client, userdata: object) -> None:
        # Not fatal: a CA or certificate can be fixed on the broker side while we back off, so the
        # reconnect policy applies.
        try:
            error = connect_failure(str(self._endpoint))
            self._failed(error)
            now = time.monotonic()
            last = self._last_error_logged
            if last is None or last[0] != error or now - last[1] > 60.0:
                self._last_error_logged = (error, now)
                # A TLS failure needs a person; a broker that is down merely needs time.
                level = logging.ERROR if error.startswith("TLS") else logging.WARNING
                log.log(level, "%s; retrying with backoff", error)
        except Exception:
            log.exception("on_connect_fail failed")

    def _failed(self, error: str) -> None:
        self.last_error = error
        if not self.connect_errors or self.connect_errors[-1][1] != error:
            self.connect_errors.append((time.time(), error))
        else:  # the same failure again: its newest time, not another row
            self.connect_errors[-1] = (time.time(), error)

    def _handle_disconnect(
        self, client: mqtt.Client, userdata: object, flags: object, reason: object, properties: object
    ) -> None:
        was = self._connected.is_set()
        self._connected.clear()
        self._subscribed.clear()
        if was:
            log.warning("disconnected from %s: %s", self._endpoint, reason)

    def _handle_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        topic = self._topics.parse(msg.topic)
        if topic is None or topic.device_id != self._device_id:
            self._protocol_error("unknown", f"unexpected topic {msg.topic!r}")
            return
        try:
            if topic.kind == TopicKind.ARTIFACT_CHUNK:
                if self._chunk_handler is not None:
                    self._chunk_handler(bytes(msg.payload))
                return
            handler = self._handlers.get(topic.kind)
            if handler is None:
                return
            handler(decode(topic.kind, bytes(msg.payload), partial(self._newer, topic.kind.value)))
        except ProtocolError as exc:
            self._protocol_error(topic.kind.value, str(exc))
            if self.on_undecodable is not None:
                try:
                    self.on_undecodable(topic.kind, str(exc))
                except Exception:
                    log.exception("reporting an undecodable %s failed", topic.kind.value)
        except Exception:
            log.exception("handler for %s failed", topic.kind.value)

    def _newer(self, kind: str, what: tuple[str, ...]) -> None:
        self.unknown_fields[kind] = self.unknown_fields.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._last_unknown_log.get(kind, float("-inf")) > 60.0:
            self._last_unknown_log[kind] = now
            log.warning(
                "ignoring what this build does not know in %s (a newer controller?): %s (%s so far)",
                kind,
                ", ".join(what)[:300],
                self.unknown_fields[kind],
            )

    def _protocol_error(self, kind: str, why: str) -> None:
        self.protocol_errors[kind] = self.protocol_errors.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._last_error_log > 10.0:
            self._last_error_log = now
            log.warning("dropped bad message on %s: %s (%s so far)", kind, why, self.protocol_errors[kind])
