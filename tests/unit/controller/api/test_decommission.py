"""Decommission and re-enrol: a retired device gets no desired state (its retained
one is cleared), what it still sends is refused and counted, its history stays readable, its broker
credentials are revoked; enrolling it again brings it back, and its fresh agent's new incarnation is
stored from seq 1 beside the old history."""

from __future__ import annotations

import time
import uuid
from typing import Any

from controller.link.bridge import OK, MqttBridge
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import Availability, Heartbeat
from tests.support.controller_app import FakeTransport, Fleet, FleetFactory
from tests.support.messages import detection_batch
from tests.support.waiting import wait_for

DEV = "retired-1"


class RecordingBroker:
    """A broker admin that does what it is asked, and remembers it."""

    def __init__(self) -> None:
        self.issued: list[str] = []
        self.revoked: list[str] = []

    def issue(self, device_id: str, password: str) -> None:
        self.issued.append(device_id)

    def revoke(self, device_id: str) -> None:
        self.revoked.append(device_id)

    def stop(self) -> None:  # the runtime stops its broker admin at shutdown
        pass


class RefusingBroker(RecordingBroker):
    def revoke(self, device_id: str) -> None:
        from controller.link.broker_auth import BrokerAdminError

        raise BrokerAdminError("the broker refused deleteClient: timeout")


def heartbeat() -> Heartbeat:
    return Heartbeat(ts=time.time(), uptime_s=1.0, cpu_pct=1.0, memory_pct=1.0, disk_pct=1.0)


def detections(fleet: Fleet) -> list[dict[str, Any]]:
    r = fleet.client.get("/api/v1/detections", params={"device": DEV, "limit": 1000})
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def events(fleet: Fleet, kind: str) -> list[dict[str, Any]]:
    r = fleet.client.get("/api/v1/events", params={"device": DEV, "kind": kind})
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()
    return found


def desired_topic(fleet: Fleet) -> str:
    return fleet.topics.device(DEV, TopicKind.TWIN_DESIRED)


def test_unknown_and_repeated_decommissions_are_clear_errors(fleet: Fleet) -> None:
    r = fleet.client.post("/api/v1/devices/nope/decommission")
    assert r.status_code == 404 and r.json() == {"detail": "device 'nope' is not known"}
    assert fleet.client.post("/api/v1/devices", json={"id": DEV}).status_code == 201
    assert fleet.client.post(f"/api/v1/devices/{DEV}/decommission").status_code == 200
    r = fleet.client.post(f"/api/v1/devices/{DEV}/decommission")
    assert r.status_code == 409
    assert "already decommissioned" in r.json()["detail"] and "enroll it again" in r.json()["detail"]


def test_a_decommissioned_device_keeps_its_history_gets_nothing_and_is_refused(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet()
    broker = RecordingBroker()
    runtime = fleet.client.app.state.runtime  # type: ignore[attr-defined]
    runtime.broker_admin = broker
    assert fleet.client.post("/api/v1/devices", json={"id": DEV}).status_code == 201
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    old = uuid.uuid4().hex
    fleet.send(DEV, TopicKind.AVAILABILITY, Availability(state="online", ts=time.time(), incarnation=old))
    fleet.send(DEV, TopicKind.HEARTBEAT, heartbeat())
    for seq in (1, 2, 3):
        fleet.send(DEV, TopicKind.DETECTIONS, detection_batch(seq).model_copy(update={"incarnation": old}))
    fleet.wait_ack(DEV, lambda a: a.upto == 3, "1..3 stored")
    wait_for(lambda: fleet.device(DEV)["status"] == "online", timeout=10, what="online")
    published = len(fleet.transport.on_topic(desired_topic(fleet)))

    r = fleet.client.post(f"/api/v1/devices/{DEV}/decommission")
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["status"] == "decommissioned" and view["decommissioned_at"] is not None
    assert broker.revoked == [DEV]
    # Its retained desired state and birth are cleared on the broker: an empty retained payload each.
    last = fleet.transport.on_topic(desired_topic(fleet))[-1]
    assert (last.payload, last.retain) == (b"", True)
    birth = fleet.transport.on_topic(fleet.topics.device(DEV, TopicKind.AVAILABILITY))[-1]
    assert (birth.payload, birth.retain) == (b"", True)
    (ev,) = events(fleet, "decommissioned")
    assert ev["data"] == {"credentials_revoked": True, "incarnation": old}

    # What it still sends (a broker without credentials lets it) is refused and counted, not stored.
    acks = len(fleet.acks(DEV))
    fleet.send(DEV, TopicKind.DETECTIONS, detection_batch(4).model_copy(update={"incarnation": old}))
    fleet.send(DEV, TopicKind.HEARTBEAT, heartbeat())
    fleet.send(DEV, TopicKind.AVAILABILITY, Availability(state="online", ts=time.time()))
    counters = fleet.counters()
    assert counters["detections"].get("refused_decommissioned") == 1
    assert counters["heartbeat"].get("refused_decommissioned") == 1
    assert counters["availability"].get("refused_decommissioned") == 1
    assert len(fleet.acks(DEV)) == acks
    assert fleet.device(DEV)["status"] == "decommissioned"
    # No desired state goes out: not for a change of its assignment, nor for its labels.
    fleet.client.delete(f"/api/v1/devices/{DEV}/cameras/cam1/model")
    assert fleet.client.put(f"/api/v1/devices/{DEV}/labels", json={"labels": {"a": "b"}}).status_code == 200
    assert len(fleet.transport.on_topic(desired_topic(fleet))) == published + 1  # the clearing one only

    # Its history stays readable.
    assert sorted({d["seq"] for d in detections(fleet)}) == [1, 2, 3]
    r = fleet.client.get(f"/api/v1/devices/{DEV}/health")
    assert r.status_code == 200 and len(r.json()) == 1
    assert fleet.device(DEV)["stats"]["stored"] == 3
    listed = {d["id"]: d["status"] for d in fleet.client.get("/api/v1/devices").json()}
    assert listed[DEV] == "decommissioned"


def test_enrolling_again_brings_it_back_with_a_new_incarnation_beside_the_old_history(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet()
    broker = RecordingBroker()
    runtime = fleet.client.app.state.runtime  # type: ignore[attr-defined]
    runtime.broker_admin = broker
    assert fleet.client.post("/api/v1/devices", json={"id": DEV}).status_code == 201
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    old, new = uuid.uuid4().hex, uuid.uuid4().hex
    fleet.send(DEV, TopicKind.AVAILABILITY, Availability(state="online", ts=time.time(), incarnation=old))
    for seq in (1, 2):
        fleet.send(DEV, TopicKind.DETECTIONS, detection_batch(seq).model_copy(update={"incarnation": old}))
    fleet.wait_ack(DEV, lambda a: a.upto == 2, "1..2 stored")
    assert fleet.client.post(f"/api/v1/devices/{DEV}/decommission").status_code == 200

    r = fleet.client.post("/api/v1/devices", json={"id": DEV})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["status"] == "offline" and body["decommissioned_at"] is None
    assert body["mqtt_password"] and broker.issued == [DEV, DEV]
    # Its desired state is on the broker again (retained, signed for it).
    last = fleet.transport.on_topic(desired_topic(fleet))[-1]
    assert last.payload != b"" and last.retain

    # The reinstalled agent: a new outbox, seqs from 1 in a new incarnation; nothing is a duplicate.
    fleet.send(DEV, TopicKind.AVAILABILITY, Availability(state="online", ts=time.time(), incarnation=new))
    for seq in (1, 2, 3):
        fleet.send(DEV, TopicKind.DETECTIONS, detection_batch(seq).model_copy(update={"incarnation": new}))
    fleet.wait_ack(DEV, lambda a: (a.incarnation, a.upto) == (new, 3), "the new incarnation's 1..3 stored")
    view = wait_for(lambda: (d := fleet.device(DEV))["status"] == "online" and d, timeout=10, what="online")
    assert view["incarnation"] == new
    spaces = [(x["incarnation"], x["stored"], x["duplicates"]) for x in view["stats"]["incarnations"]]
    assert spaces == [(old, 2, 0), (new, 3, 0)]
    assert len(detections(fleet)) == 5  # the old history and the new
    assert [e["data"] for e in events(fleet, "device_reset")] == [{"previous": old, "incarnation": new}]


def test_a_refusing_broker_leaves_the_device_as_it_was(make_fleet: FleetFactory) -> None:
    fleet = make_fleet()
    assert fleet.client.post("/api/v1/devices", json={"id": DEV}).status_code == 201
    runtime = fleet.client.app.state.runtime  # type: ignore[attr-defined]
    runtime.broker_admin = RefusingBroker()
    r = fleet.client.post(f"/api/v1/devices/{DEV}/decommission")
    assert r.status_code == 503 and r.json() == {"detail": "the broker refused deleteClient: timeout"}
    assert fleet.device(DEV)["status"] == "offline" and events(fleet, "decommissioned") == []
    fleet.send(DEV, TopicKind.DETECTIONS, detection_batch(1))
    fleet.wait_ack(DEV, lambda a: a.upto == 1, "still taken")


def test_a_database_read_older_than_this_replicas_own_decommission_does_not_undo_it() -> None:
    bridge = MqttBridge(FakeTransport(), Topics())
    handled: list[str] = []
    bridge.on(TopicKind.HEARTBEAT, lambda device, msg: handled.append(device) or OK)
    bridge.start()
    topic = Topics().device("d1", TopicKind.HEARTBEAT)
    before = time.monotonic()
    bridge.refuse("d1")
    # The status worker's read began before the decommission committed: it does not list d1 yet.
    bridge.set_refused([], read_at=before)
    bridge.handle_message(topic, encode(heartbeat()))
    assert handled == [] and bridge.counters.get("heartbeat", "refused_decommissioned") == 1
    # A read from after it is the truth again (here: enrolled again on another replica).
    bridge.set_refused([], read_at=time.monotonic())
    bridge.handle_message(topic, encode(heartbeat()))
    assert handled == ["d1"]
