"""The broker admin account the dynsec tests share (fixtures in conftest.py), and the health probe."""

from __future__ import annotations

import threading
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ControllerProcess
from tests.support.waiting import wait_for

ADMIN_USER = "edgefleet-controller"
ADMIN_PASSWORD = "test-admin-password-not-for-production"


def healthz(c: ControllerProcess) -> dict[str, Any]:
    with c.client() as api:
        body: dict[str, Any] = api.get("/healthz").json()
        return body


class Device:
    """A raw MQTT client with a device's credentials: what a device (or an attacker holding its
    password) can do on the broker."""

    def __init__(
        self,
        broker: MosquittoBroker,
        username: str | None,
        password: str | None,
        client_id: str | None = None,
    ) -> None:
        self.received: list[tuple[str, bytes]] = []
        self.sub_results: dict[int, list[bool]] = {}
        self.connack: int | None = None
        self.disconnected = threading.Event()
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._acked = threading.Condition(self._lock)
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id or username or "", protocol=mqtt.MQTTv311
        )
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = lambda *_a: self.disconnected.set()
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        # No automatic reconnect: each test decides when to try again.
        self.client.reconnect_delay_set(1, 1)
        self.broker = broker

    def connect(self) -> int:
        """Connect and wait for the CONNACK; returns its code (0 = accepted)."""
        self.client.connect(self.broker.host, self.broker.port, keepalive=30)
        self.client.loop_start()
        wait_for(lambda: self.connack is not None, timeout=10, what="CONNACK")
        assert self.connack is not None
        return self.connack

    def _on_connect(self, client: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        self.connack = int(rc.value)
        if rc.is_failure:
            client.disconnect()  # stop paho reconnecting with credentials that were refused
        else:
            self._connected.set()

    def _on_subscribe(self, _c: mqtt.Client, _u: Any, mid: int, rcs: list[Any], _p: Any) -> None:
        with self._lock:
            self.sub_results[mid] = [not rc.is_failure for rc in rcs]
            self._acked.notify_all()

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.received.append((msg.topic, bytes(msg.payload)))

    def subscribe(self, topic: str) -> bool:
        """True when the broker granted the subscription."""
        _, mid = self.client.subscribe(topic, qos=1)
        assert mid is not None
        with self._lock:
            assert self._acked.wait_for(lambda: mid in self.sub_results, timeout=10), f"no SUBACK for {topic}"
            return all(self.sub_results[mid])

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def got(self, topic_part: str) -> list[str]:
        with self._lock:
            return [t for t, _ in self.received if topic_part in t]

    def carrying(self, marker: bytes) -> list[tuple[str, bytes]]:
        """Every message received whose payload holds ``marker``."""
        with self._lock:
            return [(t, p) for t, p in self.received if marker in p]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
