"""Fixtures for controller integration tests: the real MQTT bridge against a real mosquitto."""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from fastapi.testclient import TestClient
from paho.mqtt.enums import CallbackAPIVersion

from controller.app import create_app
from controller.settings import ControllerSettings
from fleet_protocol import TopicKind, Topics, encode
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ADMIN_HEADERS, ADMIN_TOKEN
from tests.support.waiting import wait_for

MODEL_BYTES = bytes(range(256)) * 1100


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(MODEL_BYTES)
    manifest = {
        "name": "tiny",
        "version": "1",
        "sha256": hashlib.sha256(MODEL_BYTES).hexdigest(),
        "size": len(MODEL_BYTES),
        "decoder": "tf_od",
        "input": {"name": "x", "layout": "NHWC", "dtype": "uint8", "color": "RGB", "width": 64, "height": 64},
        "labels": ["person"],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path / "models"


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
            from fleet_protocol.messages import Availability

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


AppFactory = Callable[..., TestClient]


@pytest.fixture
def make_app(tmp_path: Path, models_dir: Path, broker: MosquittoBroker) -> Iterator[AppFactory]:
    """Start ``create_app`` with the real bridge; returns a TestClient whose lifespan is running."""
    with ExitStack() as stack:

        def start(**overrides: Any) -> TestClient:
            settings = ControllerSettings(
                **{
                    "data_dir": tmp_path / "data",
                    "models_dir": models_dir,
                    "mqtt_url": broker.url,
                    "heartbeat_timeout_s": 30,
                    "build_variants_on_start": False,
                    "admin_token": ADMIN_TOKEN,
                    **overrides,
                }
            )
            client = TestClient(create_app(settings), headers=ADMIN_HEADERS)
            stack.enter_context(client)
            wait_for(lambda: client.get("/healthz").json()["mqtt"], timeout=10, what="controller connected")
            return client

        yield start


@pytest.fixture
def agents(broker: MosquittoBroker) -> Iterator[Callable[..., FakeAgent]]:
    made: list[FakeAgent] = []

    def make(device_id: str, **kw: Any) -> FakeAgent:
        a = FakeAgent(broker.host, broker.port, device_id, Topics(), **kw)
        made.append(a)
        return a

    yield make
    for a in made:
        with suppress(Exception):
            a.close()
