"""The live relay between replicas over a real mosquitto: what replica B stored (detections, zone and
line events) reaches a live client on replica A; nothing is relayed while no other replica watches;
bad relay lines are refused and counted."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from controller.link.bridge import PahoTransport
from controller.link.ingest import StoredBatch
from controller.observe.live import LiveFilter, LiveHub
from controller.observe.live_relay import LiveRelay
from fleet_protocol.codec import encode
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import CrossDirection, Event, EventKind, LineCrossing, ZoneTransit
from tests.support.messages import detection_batch
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

PREFIX = "edgefleet/v1"


class Replica:
    def __init__(self, broker: MosquittoBroker, name: str) -> None:
        self.stop = threading.Event()
        self.hub = LiveHub()
        self.transport = PahoTransport(
            MqttEndpoint(host=broker.host, port=broker.port), client_id=f"relay-test-{name}-{time.time_ns()}"
        )
        self.relay = LiveRelay(self.hub, self.transport, prefix=PREFIX, replica_id=name, stop=self.stop)

    def close(self) -> None:
        self.stop.set()
        self.relay.join(5)


@pytest.fixture
def pair(broker: MosquittoBroker) -> Iterator[tuple[Replica, Replica]]:
    a, b = Replica(broker, "ra"), Replica(broker, "rb")
    a.relay.start()
    b.relay.start()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_batch_stored_on_b_reaches_a_live_client_on_a_and_nothing_flows_unwatched(
    pair: tuple[Replica, Replica],
) -> None:
    a, b = pair
    # Nobody watches: B relays nothing.
    b.relay.on_stored(
        StoredBatch(
            messages=[("dev1", detection_batch(1, ["person"]))], stored_at=datetime.now(UTC), write_s=0
        )
    )
    assert b.relay.relayed_out == 0

    loop = asyncio.new_event_loop()
    try:
        client = a.hub.add(LiveFilter(device="dev1"), loop)
        wait_for(b.relay.someone_listens, timeout=10, what="B hears that A has a live client")
        assert not a.relay.someone_listens()  # B has no client: A would relay nothing
        b.relay.on_stored(
            StoredBatch(
                messages=[
                    ("dev1", detection_batch(2, ["person", "car"])),
                    ("dev2", detection_batch(7, ["dog"])),
                ],
                stored_at=datetime.now(UTC),
                write_s=0,
            )
        )
        got: list[dict[str, object]] = []

        def arrived() -> bool:
            got.extend(client.take()[1])
            return len(got) >= 2

        wait_for(arrived, timeout=10, what="B's stored detections on A's live client")
        assert [(g["device"], g["seq"], g["label"]) for g in got] == [
            ("dev1", 2, "person"),
            ("dev1", 2, "car"),
        ]
        assert b.relay.relayed_out == 2 and a.relay.relayed_in == 2

        # A line that does not decode is refused and counted; the good one beside it still arrives.
        b.transport.publish(
            f"{PREFIX}/_controller/live/rb",
            b'{"replica": "rb", "stored_at": "2026-12-03T10:00:00+00:00"}\n'
            b"dev1 {not json}\n"
            b"dev1 " + detection_batch(3, ["bus"]).model_dump_json().encode(),
            0,
            False,
        )

        def seq3() -> bool:
            got.extend(client.take()[1])
            return any(g["seq"] == 3 for g in got)

        wait_for(seq3, timeout=10, what="seq 3 relayed")
        assert a.relay.refused_in == 1

        # The client goes: A withdraws, and B stops relaying.
        a.hub.remove(client)
        wait_for(lambda: not b.relay.someone_listens(), timeout=10, what="B hears that A stopped watching")
        before = b.relay.relayed_out
        b.relay.on_stored(
            StoredBatch(
                messages=[("dev1", detection_batch(4, ["person"]))], stored_at=datetime.now(UTC), write_s=0
            )
        )
        assert b.relay.relayed_out == before
    finally:
        loop.close()


def test_a_zone_or_line_event_stored_on_b_reaches_a_live_client_on_a_and_other_events_stay(
    pair: tuple[Replica, Replica],
) -> None:
    a, b = pair
    now = time.time()
    crossing = LineCrossing(line="door", track_id=7, label="person", direction=CrossDirection.IN, at=now)
    entered = ZoneTransit(zone="desk", track_id=8, label="person", at=now)

    def event(seq: int, kind: EventKind, data: dict[str, object]) -> Event:
        return Event(seq=seq, ts=now, kind=kind, camera="cam1", data=data)

    loop = asyncio.new_event_loop()
    try:
        client = a.hub.add(LiveFilter(device="dev1"), loop)
        wait_for(b.relay.someone_listens, timeout=10, what="B hears that A has a live client")
        b.relay.on_stored(
            StoredBatch(
                messages=[
                    ("dev1", event(1, EventKind.CAMERA_UP, {})),  # not a live client's: stays on B
                    ("dev1", event(2, EventKind.LINE_CROSSED, crossing.model_dump(mode="json"))),
                    ("dev1", event(3, EventKind.ZONE_ENTERED, entered.model_dump(mode="json"))),
                ],
                stored_at=datetime.now(UTC),
                write_s=0,
            )
        )
        assert b.relay.relayed_out == 2
        got: list[dict[str, object]] = []

        def arrived() -> bool:
            got.extend(client.take()[1])
            return len(got) >= 2

        wait_for(arrived, timeout=10, what="B's stored zone and line events on A's live client")
        assert [(g["type"], g["seq"], g["track_id"]) for g in got] == [
            ("line_event", 2, 7),
            ("zone_event", 3, 8),
        ]

        # An event line of a kind no live client is sent is refused and counted.
        b.transport.publish(
            f"{PREFIX}/_controller/live/rb",
            b'{"replica": "rb", "stored_at": "2026-12-03T10:00:00+00:00"}\n'
            b"dev1 event " + encode(event(4, EventKind.CAMERA_UP, {})),
            0,
            False,
        )
        wait_for(lambda: a.relay.refused_in == 1, timeout=10, what="the camera_up line refused")
        assert a.relay.relayed_in == 2
    finally:
        loop.close()
