"""Controller replicas on a real Mosquitto: the share group deals the devices' bulk traffic out, each
message to one replica; availability reaches the leader alone, and a new leader gets the retained
births; two whole controllers on one PostgreSQL elect one leader and hand over when it stops."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from fastapi.testclient import TestClient
from paho.mqtt.enums import CallbackAPIVersion

from controller.app import create_app
from controller.link.bridge import OK, MqttBridge, PahoTransport
from controller.settings import ControllerSettings
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import (
    Availability,
    CommandResult,
    DetectionBatch,
    Message,
)
from fleet_protocol.signing import generate_private_key, save_private_key
from tests.support.databases import postgres_schema
from tests.support.fakes.agent import FakeAgent
from tests.support.messages import detection_batch
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ADMIN_HEADERS, ADMIN_TOKEN
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


class Replica:
    """One replica's bridge on the real broker, recording what its handlers get."""

    def __init__(self, broker: MosquittoBroker, topics: Topics, group: str, name: str) -> None:
        self.name = name
        self.topics = topics
        self.transport = PahoTransport(
            MqttEndpoint.parse(broker.url), client_id=f"replica-{name}-{uuid.uuid4().hex[:6]}"
        )
        self.bridge = MqttBridge(self.transport, topics, share_group=group)
        self._lock = threading.Lock()
        self.got: dict[TopicKind, list[tuple[str, Message]]] = {}
        for kind in (TopicKind.DETECTIONS, TopicKind.AVAILABILITY, TopicKind.COMMAND_RESULT):
            self.bridge.on(kind, self._recorder(kind))
        self._markers = 0

    def _recorder(self, kind: TopicKind) -> Callable[[str, Message], str]:
        def record(device_id: str, msg: Message) -> str:
            with self._lock:
                self.got.setdefault(kind, []).append((device_id, msg))
            return OK

        return record

    def received(self, kind: TopicKind) -> list[tuple[str, Message]]:
        with self._lock:
            return list(self.got.get(kind, []))

    def start(self) -> None:
        self.bridge.start()
        assert self.transport.wait_connected(10), f"replica {self.name} did not connect"

    def flush(self) -> None:
        """Wait until the broker has handled everything this replica sent before (its SUBSCRIBE or
        UNSUBSCRIBE) and delivered to it everything published before: a marker this replica publishes
        on a topic it always holds (command results) comes back to it after all of that."""
        self._markers += 1
        marker = f"{self.name}-{self._markers}"
        self.transport.publish(
            self.topics.device("sync", TopicKind.COMMAND_RESULT),
            encode(CommandResult(id=marker, ok=True)),
            1,
            False,
        )

        def back() -> bool:
            results = self.received(TopicKind.COMMAND_RESULT)
            return any(isinstance(m, CommandResult) and m.id == marker for _, m in results)

        wait_for(back, timeout=10, what=f"replica {self.name}'s marker {marker}")

    def stop(self) -> None:
        self.bridge.stop()


@pytest.fixture
def topics() -> Topics:
    # A prefix of this test's own: nothing another test publishes on the shared broker reaches it.
    return Topics(f"efrep-{uuid.uuid4().hex[:8]}/v1")


@pytest.fixture
def make_replica(broker: MosquittoBroker, topics: Topics) -> Iterator[Callable[..., Replica]]:
    group = f"g{uuid.uuid4().hex[:8]}"
    made: list[Replica] = []

    def make(name: str, *, leading: bool = False) -> Replica:
        r = Replica(broker, topics, group, name)
        r.bridge.set_leader(leading)
        r.start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


@pytest.fixture
def device(broker: MosquittoBroker) -> Iterator[mqtt.Client]:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"dev-{uuid.uuid4().hex[:8]}")
    client.connect(broker.host, broker.port)
    client.loop_start()
    yield client
    client.loop_stop()
    client.disconnect()


def publish(client: mqtt.Client, topic: str, msg: Any, *, retain: bool = False) -> None:
    client.publish(topic, encode(msg), qos=1, retain=retain).wait_for_publish(10)


def test_a_share_group_deals_each_detection_to_exactly_one_replica(
    make_replica: Callable[..., Replica], device: mqtt.Client, topics: Topics
) -> None:
    a, b = make_replica("a"), make_replica("b")
    a.flush()
    b.flush()  # both shared subscriptions are in place

    for i in range(200):
        publish(device, topics.device(f"d{i % 10}", TopicKind.DETECTIONS), detection_batch(i // 10 + 1))
    a.flush()
    b.flush()  # everything published before is delivered by now

    got_a = a.received(TopicKind.DETECTIONS)
    got_b = b.received(TopicKind.DETECTIONS)
    keys = [(d, m.seq) for d, m in got_a + got_b if isinstance(m, DetectionBatch)]
    assert len(keys) == 200 and len(set(keys)) == 200  # every message once, none twice
    assert set(keys) == {(f"d{i % 10}", i // 10 + 1) for i in range(200)}
    assert got_a and got_b, (len(got_a), len(got_b))  # both replicas share the load


def test_availability_reaches_the_leader_alone_and_a_new_leader_gets_the_retained_births(
    make_replica: Callable[..., Replica], device: mqtt.Client, topics: Topics
) -> None:
    a, b = make_replica("a", leading=True), make_replica("b")
    a.flush()
    b.flush()

    for d in ("d1", "d2"):
        publish(device, topics.device(d, TopicKind.AVAILABILITY), Availability(state="online"), retain=True)
    wait_for(lambda: len(a.received(TopicKind.AVAILABILITY)) == 2, timeout=10, what="the leader gets both")
    b.flush()
    assert b.received(TopicKind.AVAILABILITY) == []

    # The leadership moves from a to b.
    a.bridge.set_leader(False)
    a.flush()  # a's UNSUBSCRIBE is done
    b.bridge.set_leader(True)
    wait_for(
        lambda: sorted(d for d, _ in b.received(TopicKind.AVAILABILITY)) == ["d1", "d2"],
        timeout=10,
        what="the new leader gets the retained births",
    )
    publish(device, topics.device("d3", TopicKind.AVAILABILITY), Availability(state="offline"), retain=True)
    wait_for(lambda: "d3" in {d for d, _ in b.received(TopicKind.AVAILABILITY)}, timeout=10, what="b gets d3")
    a.flush()
    assert sorted(d for d, _ in a.received(TopicKind.AVAILABILITY)) == ["d1", "d2"]


def test_without_a_share_group_a_bridge_holds_every_subscription_as_before(topics: Topics) -> None:
    bridge = MqttBridge(PahoTransport(MqttEndpoint.parse("mqtt://127.0.0.1:1"), client_id="x"), topics)
    always, leader = bridge.subscriptions()
    assert always == topics.controller_subscriptions() and leader == []
    bridge.set_leader(False)  # one process leads always: nothing to drop
    assert bridge.leading


# --------------------------------------------------------------------------- whole controllers


@contextmanager
def fake_agent(broker: MosquittoBroker, device_id: str) -> Iterator[FakeAgent]:
    agent = FakeAgent(broker.host, broker.port, device_id, Topics())
    try:
        yield agent
    finally:
        with suppress(Exception):  # it may have dropped its connection on purpose
            agent.close()


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_schema() as url:
        yield url


def test_two_controllers_elect_one_leader_and_the_next_takes_over_with_the_retained_births(
    broker: MosquittoBroker, pg_url: str, tmp_path: Path
) -> None:
    key = tmp_path / "secret" / "signing.pem"
    save_private_key(generate_private_key(), key)
    group = f"g{uuid.uuid4().hex[:8]}"
    device_id = f"rep-{uuid.uuid4().hex[:6]}"

    def settings(name: str) -> ControllerSettings:
        return ControllerSettings(
            data_dir=tmp_path / name,
            database_url=pg_url,
            models_dir=tmp_path / "no-models",
            mqtt_url=broker.url,
            mqtt_share_group=group,
            replica_id=name,
            signing_key_file=key,
            admin_token=ADMIN_TOKEN,
            heartbeat_timeout_s=60,
            build_variants_on_start=False,
        )

    with ExitStack() as stack:
        # r1 in a stack of its own, to stop it mid-test.
        first_stack = stack.enter_context(ExitStack())
        first = first_stack.enter_context(TestClient(create_app(settings("r1")), headers=ADMIN_HEADERS))
        second = stack.enter_context(TestClient(create_app(settings("r2")), headers=ADMIN_HEADERS))
        for client in (first, second):
            wait_for(lambda c=client: c.get("/healthz").json()["mqtt"], timeout=10, what="connected")
        h1, h2 = first.get("/healthz").json(), second.get("/healthz").json()
        assert (h1["replica"], h1["leader"], h1["epoch"]) == ("r1", True, 1)
        assert (h2["replica"], h2["leader"]) == ("r2", False) and "epoch" not in h2
        assert first.get("/api/v1/keys/artifacts").json() == second.get("/api/v1/keys/artifacts").json()

        agent = stack.enter_context(fake_agent(broker, device_id))
        agent.publish(TopicKind.AVAILABILITY, Availability(state="online"), retain=True)

        def online(client: TestClient) -> bool:
            r = client.get(f"/api/v1/devices/{device_id}")
            return r.status_code == 200 and r.json()["status"] == "online"

        wait_for(lambda: online(second), timeout=10, what="the leader stored the birth (seen from r2)")

        first_stack.close()  # r1 stops cleanly: its lock is released, its replica row deleted
        wait_for(lambda: second.get("/healthz").json()["leader"], timeout=10, what="r2 takes over")
        assert second.get("/healthz").json()["epoch"] == 2
        # r2 now holds the availability subscription: the retained birth came again, and the Last
        # Will of the device reaches the new leader.
        agent.drop_connection()
        wait_for(lambda: not online(second), timeout=15, what="the new leader stored the Last Will")
