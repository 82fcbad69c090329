"""Fixtures for the controller's unit tests: a fake MQTT transport, SQLite and PostgreSQL databases,
a tiny registered model, and a TestClient around ``create_app``."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controller.app import create_app
from controller.link.bridge import ConnectCallback, MessageCallback
from controller.settings import ControllerSettings
from fleet_protocol import TopicKind, Topics, decode, encode
from fleet_protocol.messages import Ack
from tests.databases import DATABASES, database_url
from tests.processes import ADMIN_HEADERS, ADMIN_TOKEN
from tests.waiting import wait_for


@dataclass
class Published:
    topic: str
    payload: bytes
    qos: int
    retain: bool


class FakeTransport:
    """Records what the controller publishes; ``inject`` delivers a frame as if from the broker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.published: list[Published] = []
        self.subscriptions: list[tuple[str, int]] = []
        self._connected = False
        self._on_message: MessageCallback | None = None
        self._on_connect: ConnectCallback | None = None

    @property
    def connected(self) -> bool:
        return self._connected

    def start(self, *, on_message: MessageCallback, on_connect: ConnectCallback) -> None:
        self._on_message, self._on_connect = on_message, on_connect
        self.connect()

    def connect(self) -> None:
        self._connected = True
        if self._on_connect is not None:
            self._on_connect()

    def stop(self) -> None:
        self._connected = False

    def subscribe(self, topics: list[tuple[str, int]]) -> None:
        self.subscriptions.extend(topics)

    def unsubscribe(self, filters: list[str]) -> None:
        self.subscriptions = [t for t in self.subscriptions if t[0] not in filters]

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        with self._lock:
            self.published.append(Published(topic, bytes(payload), qos, retain))

    def inject(self, topic: str, payload: bytes) -> None:
        assert self._on_message is not None, "transport not started"
        self._on_message(topic, payload)

    def on_topic(self, topic: str) -> list[Published]:
        with self._lock:
            return [p for p in self.published if p.topic == topic]


@pytest.fixture(params=DATABASES)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database per test: a SQLite file, or a PostgreSQL schema of its own (tests/databases.py)."""
    with database_url(request.param, tmp_path) as url:
        yield url


def write_model(
    models_dir: Path, name: str, version: str, data: bytes, *, sha256: str | None = None
) -> dict[str, Any]:
    """A model folder as the registry expects it: ``model.onnx`` + ``manifest.json``."""
    folder = models_dir / f"{name}_{version}"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(data)
    manifest = {
        "name": name,
        "version": version,
        "sha256": sha256 or hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "decoder": "tf_od",
        "input": {
            "name": "input",
            "layout": "NHWC",
            "dtype": "uint8",
            "color": "RGB",
            "width": 300,
            "height": 300,
        },
        "labels": ["person"],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


MODEL_BYTES = bytes(range(256)) * 2600 + b"tail"  # 665 604 bytes: 3 chunks of 256 KiB, the last short


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    write_model(d, "tiny", "1", MODEL_BYTES)
    return d


class Fleet:
    """A running controller on a fake transport, and what a device would send it."""

    def __init__(self, client: TestClient, transport: FakeTransport, topics: Topics) -> None:
        self.client = client
        self.transport = transport
        self.topics = topics
        self._stack = ExitStack()
        self._stack.enter_context(client)

    def close(self) -> None:
        """Stop the controller (runs the app's shutdown); safe to call twice."""
        self._stack.close()

    def send(self, device: str, kind: TopicKind, msg: Any) -> None:
        payload = msg if isinstance(msg, bytes) else encode(msg)
        self.transport.inject(self.topics.device(device, kind), payload)

    def acks(self, device: str) -> list[Ack]:
        out: list[Ack] = []
        for p in self.transport.on_topic(self.topics.device(device, TopicKind.ACKS)):
            msg = decode(TopicKind.ACKS, p.payload)
            assert isinstance(msg, Ack)
            out.append(msg)
        return out

    def wait_ack(self, device: str, check: Callable[[Ack], bool], what: str) -> Ack:
        def latest() -> Ack | None:
            acks = self.acks(device)
            return acks[-1] if acks and check(acks[-1]) else None

        return wait_for(latest, timeout=10, what=what, interval=0.02)

    def device(self, device: str) -> dict[str, Any]:
        r = self.client.get(f"/api/v1/devices/{device}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def device_or_none(self, device: str) -> dict[str, Any] | None:
        r = self.client.get(f"/api/v1/devices/{device}")
        return r.json() if r.status_code == 200 else None  # type: ignore[no-any-return]

    def counters(self) -> dict[str, dict[str, int]]:
        r = self.client.get("/api/v1/stats/ingest")
        assert r.status_code == 200, r.text
        body: dict[str, dict[str, int]] = r.json()["counters"]
        return body


FleetFactory = Callable[..., Fleet]


@pytest.fixture
def make_fleet(db_url: str, models_dir: Path, tmp_path: Path) -> Iterator[FleetFactory]:
    """Start a controller (``create_app`` + TestClient lifespan); keyword arguments override settings."""
    fleets: list[Fleet] = []

    def start(*, builder: Any = None, **overrides: Any) -> Fleet:
        settings = ControllerSettings(
            **{
                "data_dir": tmp_path / "data",
                "database_url": db_url,
                "models_dir": models_dir,
                "mqtt_url": "mqtt://127.0.0.1:1",
                "chunk_size": 256 * 1024,
                "build_variants_on_start": False,
                "admin_token": ADMIN_TOKEN,
                **overrides,
            }
        )
        transport = FakeTransport()
        fleet = Fleet(
            # Acts as the admin; tests of roles send their own Authorization header.
            TestClient(
                create_app(settings, transport=transport, variant_builder=builder), headers=ADMIN_HEADERS
            ),
            transport,
            Topics(settings.topic_prefix),
        )
        fleets.append(fleet)
        return fleet

    yield start
    for f in reversed(fleets):
        f.close()


@pytest.fixture
def fleet(make_fleet: FleetFactory) -> Fleet:
    return make_fleet()
