"""A device speaking the MQTT contract by hand through a raw paho client, for tests of the
controller's side of the link where a real agent would hide what is sent."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import Availability


class FakeAgent:
    """A raw paho client speaking the protocol by hand, as a device would."""

    def __init__(
        self, url_host: str, port: int, device_id: str, topics: Topics, *, will: bool = True
    ) -> None:
        self.device_id = device_id
        self.topics = topics
        self.received: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"{device_id}-{uuid.uuid4().hex[:6]}"
        )
        if will:
            self.client.will_set(
                topics.device(device_id, TopicKind.AVAILABILITY),
                encode(Availability(state="offline")),
                1,
                True,
            )
        self.client.on_message = self._on_message
        self._subscribed = threading.Event()
        self.client.on_subscribe = lambda *_a: self._subscribed.set()
        self.client.connect(url_host, port)
        self.client.loop_start()
        self.client.subscribe([(t, q) for t, q in topics.agent_subscriptions(device_id)])
        assert self._subscribed.wait(10), "agent subscription not acknowledged"

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.received.setdefault(msg.topic, []).append(bytes(msg.payload))

    def got(self, kind: TopicKind) -> list[bytes]:
        with self._lock:
            return list(self.received.get(self.topics.device(self.device_id, kind), []))

    def publish(
        self, kind: TopicKind, payload: bytes | Any, *, retain: bool | None = None, qos: int = 1
    ) -> None:
        data = payload if isinstance(payload, bytes) else encode(payload)
        topic = self.topics.device(self.device_id, kind)
        self.client.publish(topic, data, qos=qos, retain=bool(retain)).wait_for_publish(5)

    def publish_raw(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(5)

    def drop_connection(self) -> None:
        """Vanish without DISCONNECT, so the broker publishes the Last Will."""
        self.client.loop_stop()
        sock = self.client.socket()
        if sock is not None:
            sock.close()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
