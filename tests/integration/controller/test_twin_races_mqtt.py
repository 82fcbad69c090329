"""Two controller replicas on one PostgreSQL and one real Mosquitto serve concurrent changes to one
device's model assignment: every change gets its own version, the versions reach the broker
in order, one version never carries two contents, and the retained desired state ends as the database's."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from sqlmodel import Session

from controller.db import crud
from controller.link.bridge import PahoTransport
from fleet_protocol import TopicKind, Topics, decode
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import DesiredState
from tests.support.databases import database_url
from tests.support.fleet_replicas import (
    Replica,
    add_devices,
    make_replica,
    prepare,
)
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.waiting import wait_for

DEVICE = f"race-{uuid.uuid4().hex[:6]}"  # the session's broker is shared: a topic of this test's own


class Listener:
    """A subscriber to one topic: every message in the order the broker delivers it."""

    def __init__(self, broker: MosquittoBroker, topic: str) -> None:
        self.messages: list[mqtt.MQTTMessage] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"listener-{uuid.uuid4().hex[:6]}")
        self._client.on_message = self._on_message
        self._client.on_subscribe = lambda *_: self._subscribed.set()
        self._client.connect(broker.host, broker.port)
        self._client.loop_start()
        self._client.subscribe(topic, qos=1)
        assert self._subscribed.wait(10), "no SUBACK"

    def _on_message(self, _c: mqtt.Client, _u: object, m: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append(m)

    def payloads(self) -> list[tuple[bytes, bool]]:
        with self._lock:
            return [(bytes(m.payload), bool(m.retain)) for m in self.messages]

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()


@pytest.fixture
def pg_url(tmp_path: Path, models_dir: Path) -> Iterator[str]:
    with database_url("postgresql", tmp_path / "db") as url:
        prepare(url, models_dir)
        yield url


def test_replicas_publishing_one_device_leave_the_broker_with_the_databases_state(
    pg_url: str, tmp_path: Path, broker: MosquittoBroker
) -> None:
    links = [
        PahoTransport(
            MqttEndpoint(host=broker.host, port=broker.port), client_id=f"replica-{n}-{uuid.uuid4().hex[:6]}"
        )
        for n in "ab"
    ]
    replicas: list[Replica] = []
    topic = Topics().device(DEVICE, TopicKind.TWIN_DESIRED)
    listener = Listener(broker, topic)
    try:
        for link in links:
            link.start(on_message=lambda _t, _p: None, on_connect=lambda: None)
            assert link.wait_connected(10)
            replicas.append(make_replica(pg_url, tmp_path / "keys", transport=link))
        add_devices(replicas[0].engine, [DEVICE])
        errors: list[BaseException] = []

        def client(k: int) -> None:
            for i in range(k, 50, 10):
                try:
                    replicas[i % 2].twin.assign(
                        device_id=DEVICE, camera="cam1", model="tiny", version="1", threshold=0.01 * (i + 1)
                    )
                except BaseException as exc:  # reported below
                    errors.append(exc)

        threads = [threading.Thread(target=client, args=(k,), name=f"api-{k}") for k in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors

        with Session(replicas[0].engine) as s:
            dev = crud.get_device(s, device_id=DEVICE)
            assert dev is not None and dev.desired is not None
            stored = DesiredState.model_validate(dev.desired)
        assert stored.version == 50  # 50 changes, one version each

        def up_to_the_newest() -> list[DesiredState] | None:
            out = [decode(TopicKind.TWIN_DESIRED, p) for p, _ in listener.payloads()]
            got = [m for m in out if isinstance(m, DesiredState)]
            return got if got and got[-1].version == stored.version else None

        # Every publish was confirmed before its replica went on, so the last version is already in.
        states = wait_for(up_to_the_newest, timeout=10, what="the newest version delivered")
        versions = [m.version for m in states]
        assert versions == sorted(versions), versions
        content: dict[int, bytes] = {}
        for payload, _ in listener.payloads():
            v = decode(TopicKind.TWIN_DESIRED, payload).version  # type: ignore[union-attr]
            assert content.setdefault(v, payload) == payload, f"v{v} sent with two contents"

        # A device connecting now gets the retained state: the database's.
        late = Listener(broker, topic)
        try:
            retained = wait_for(
                lambda: [p for p, r in late.payloads() if r], timeout=10, what="the retained desired state"
            )
        finally:
            late.close()
        last = decode(TopicKind.TWIN_DESIRED, retained[-1])
        assert isinstance(last, DesiredState)
        assert last.model_dump(mode="json") == stored.model_dump(mode="json")
    finally:
        listener.close()
        for link in links:
            link.stop()
        for r in replicas:
            r.engine.dispose()
