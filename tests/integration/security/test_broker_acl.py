"""Per-device broker credentials against a real Mosquitto with the dynamic-security plugin, administered
by a real controller: what one device may and may not do, a real agent on its issued credentials, and
revocation cutting a connected device off."""

from __future__ import annotations

import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from controller.link.broker_auth import device_acls, verify_password
from controller.settings import ControllerSettings
from edge_agent.agent import EXIT_FATAL_LINK
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import Box, Detection, DetectionBatch, FrameDetections
from fleet_protocol.topics import SPECS
from tests.support.dynsec import ADMIN_PASSWORD, ADMIN_USER, Device
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE
from tests.support.processes import AgentProcess, ControllerProcess
from tests.support.waiting import wait_for

TOPICS = Topics()


def _batch(seq: int, label: str) -> bytes:
    now = time.time()
    return encode(
        DetectionBatch(
            seq=seq,
            sent_at=now,
            frames=[
                FrameDetections(
                    camera="cam1",
                    frame=seq,
                    captured_at=now,
                    width=640,
                    height=480,
                    model="m",
                    inference_ms=1.0,
                    detections=[
                        Detection(label=label, class_id=0, score=0.9, box=Box(x0=1, y0=2, x1=30, y1=40))
                    ],
                )
            ],
        )
    )


def _enroll(api: Any, device_id: str) -> dict[str, Any]:
    r = api.post("/api/v1/devices", json={"id": device_id, "labels": {"site": "acl"}})
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    assert body["mqtt_username"] == device_id and body["mqtt_password"], body
    return body


def _detections(api: Any, device_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = api.get("/api/v1/detections", params={"device": device_id}).json()["items"]
    return items


def test_a_device_cannot_act_as_or_read_another_device(
    controller: ControllerProcess, secured_broker: MosquittoBroker
) -> None:
    with controller.client() as api:
        cred_a = _enroll(api, "acl-a")
        cred_b = _enroll(api, "acl-b")
        # The password is shown once: no listing carries it, nor its hash; the database keeps a hash.
        listing = api.get("/api/v1/devices/acl-a").text
        assert cred_a["mqtt_password"] not in listing and "mqtt_password" not in listing
        db = controller.workdir / "controller" / "edgefleet.db"
        with sqlite3.connect(db) as conn:
            (stored,) = conn.execute("SELECT mqtt_password_hash FROM device WHERE id = 'acl-a'").fetchone()
        assert verify_password(cred_a["mqtt_password"], stored) and cred_a["mqtt_password"] not in stored
        for f in db.parent.glob("edgefleet.db*"):  # the WAL too
            assert cred_a["mqtt_password"].encode() not in f.read_bytes()

        # B's desired state is retained on the broker (the controller publishes it on assignment).
        r = api.put("/api/v1/devices/acl-b/cameras/cam1/model", json={"model": "ped_ssdlite", "version": "1"})
        assert r.status_code == 200, r.text

        a = Device(secured_broker, "acl-a", cred_a["mqtt_password"])
        b = Device(secured_broker, "acl-b", cred_b["mqtt_password"])
        try:
            assert a.connect() == 0 and b.connect() == 0

            # A may not subscribe to everything, nor to B's topics.
            assert not a.subscribe("#")
            assert not a.subscribe(TOPICS.device("acl-b", TopicKind.COMMANDS))
            assert not a.subscribe(TOPICS.device("acl-b", TopicKind.TWIN_DESIRED))
            assert not a.subscribe(TOPICS.all_devices(TopicKind.TWIN_DESIRED))
            # ... but may subscribe to its own.
            assert a.subscribe(TOPICS.device("acl-a", TopicKind.COMMANDS))
            for kind in (TopicKind.TWIN_DESIRED, TopicKind.COMMANDS):
                assert b.subscribe(TOPICS.device("acl-b", kind))
            wait_for(
                lambda: b.got("acl-b/twin/desired"), timeout=10, what="B receives its retained desired state"
            )

            # A command to B (sent as the controller would) reaches B and nobody else.
            ctl = Device(secured_broker, ADMIN_USER, ADMIN_PASSWORD, client_id="acl-test-controller")
            try:
                assert ctl.connect() == 0
                ctl.publish(TOPICS.device("acl-b", TopicKind.COMMANDS), b'{"not":"checked by the broker"}')
            finally:
                ctl.close()
            wait_for(lambda: b.got("acl-b/commands"), timeout=10, what="B receives its command")

            # A publishes detections as B, then on its own topic. Only A's arrive: once A's are stored,
            # the forged one (sent before it on the same connection) would have been too.
            a.publish(TOPICS.device("acl-b", TopicKind.DETECTIONS), _batch(1, "forged"))
            a.publish(TOPICS.device("acl-a", TopicKind.DETECTIONS), _batch(1, "genuine"))
            stored_a = wait_for(
                lambda: _detections(api, "acl-a"), timeout=15, what="A's own detection stored"
            )
            assert [d["label"] for d in stored_a] == ["genuine"]
            assert _detections(api, "acl-b") == []
            assert not a.got("acl-b"), "A received something of B's"
            assert not b.disconnected.is_set()

            _forgeries_never_reach_a_subscriber(secured_broker, a)
            assert not a.disconnected.is_set() and not b.disconnected.is_set()
        finally:
            a.close()
            b.close()

        # A's password does not open B's account, and A cannot take B's client id (session takeover).
        assert Device(secured_broker, "acl-b", cred_a["mqtt_password"]).connect() != 0
        assert Device(secured_broker, "acl-a", cred_a["mqtt_password"], client_id="acl-b").connect() != 0
        # No anonymous access at all.
        assert Device(secured_broker, None, None, client_id="anonymous").connect() != 0


def _forgeries_never_reach_a_subscriber(broker: MosquittoBroker, a: Device) -> None:
    """A wire-tap subscribed to everything as the broker admin: device A (acl-a) publishes on every
    topic kind of device B (acl-b), retained where the kind is, and on its own controller-to-device
    topics (its own retained desired state above all). The broker must drop each: the tap sees none,
    while A's control message on its own allowed topic, sent after them on the same connection, gets
    through (so the tap works, and the broker, which keeps one connection's messages in order, has
    handled every forgery by then). A second tap subscribing afterwards gets the retained messages,
    B's desired state among them, and no forged one."""
    marker = f"forged-{uuid.uuid4().hex}".encode()
    forgeries: list[tuple[str, bool]] = [
        (TOPICS.device("acl-b", kind), spec.retain) for kind, spec in SPECS.items()
    ] + [(TOPICS.device("acl-a", kind), spec.retain) for kind, spec in SPECS.items() if not spec.from_agent]
    assert (TOPICS.device("acl-a", TopicKind.TWIN_DESIRED), True) in forgeries
    tap = Device(broker, ADMIN_USER, ADMIN_PASSWORD, client_id="acl-test-tap")
    late_tap = Device(broker, ADMIN_USER, ADMIN_PASSWORD, client_id="acl-test-late-tap")
    try:
        assert tap.connect() == 0 and tap.subscribe("#")
        for topic, retain in forgeries:
            a.publish(topic, marker + b" on " + topic.encode(), retain=retain)
        control = f"control-{uuid.uuid4().hex}".encode()
        a.publish(TOPICS.device("acl-a", TopicKind.EVENTS), control)
        wait_for(lambda: tap.carrying(control), timeout=10, what="A's control message seen by the tap")
        assert tap.carrying(marker) == [], "forged frames reached a subscriber"

        assert late_tap.connect() == 0 and late_tap.subscribe("#")
        control = f"control-{uuid.uuid4().hex}".encode()
        a.publish(TOPICS.device("acl-a", TopicKind.EVENTS), control)
        wait_for(lambda: late_tap.carrying(control), timeout=10, what="the late tap's control message")
        assert late_tap.got("acl-b/twin/desired"), "the late tap got no retained message (B's desired)"
        assert late_tap.carrying(marker) == [], "a forged message was retained"
    finally:
        tap.close()
        late_tap.close()


def test_agent_on_its_issued_credentials_works_and_revoking_cuts_it_off(
    tmp_path: Path, controller: ControllerProcess, secured_broker: MosquittoBroker
) -> None:
    device = "acl-agent"
    with controller.client() as api:
        cred = _enroll(api, device)
        password_file = tmp_path / "mqtt-password"
        password_file.write_text(cred["mqtt_password"] + "\n")
        password_file.chmod(0o600)
        r = api.put(
            f"/api/v1/devices/{device}/cameras/cam1/model", json={"model": "ped_ssdlite", "version": "1"}
        )
        assert r.status_code == 200, r.text
        agent = AgentProcess(
            tmp_path,
            device,
            secured_broker.url,
            cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
            public_key=cred["artifact_public_key"],
            mqtt_username=cred["mqtt_username"],
            mqtt_password_file=str(password_file),
        )
        agent.start()
        try:
            wait_for(
                lambda: agent.alive() and _detections(api, device),
                timeout=90,
                what=f"detections of the agent stored (log: {agent.log})",
            )
            assert api.get(f"/api/v1/devices/{device}").json()["status"] == "online"
            assert cred["mqtt_password"] not in agent.log.read_text()

            # Revoke: the broker drops the connection now (the Last Will marks it offline) and refuses
            # the password from then on, so the agent gives up (bad credentials are not retried).
            r = api.post(f"/api/v1/devices/{device}/revoke")
            assert r.status_code == 200, r.text
            assert r.json()["id"] == device
            wait_for(
                lambda: api.get(f"/api/v1/devices/{device}").json()["status"] == "offline",
                timeout=20,
                what="revoked device shown offline",
            )
            wait_for(lambda: not agent.alive(), timeout=60, what="agent refused by the broker and stopped")
            assert agent.proc is not None and agent.proc.returncode == EXIT_FATAL_LINK
            assert "broker refused the connection" in agent.log.read_text()
            assert Device(secured_broker, device, cred["mqtt_password"]).connect() != 0

            # Enrolling again issues a new password, and only the new one works.
            again = _enroll(api, device)
            assert again["mqtt_password"] != cred["mqtt_password"]
            assert Device(secured_broker, device, cred["mqtt_password"]).connect() != 0
            fresh = Device(secured_broker, device, again["mqtt_password"])
            assert fresh.connect() == 0
            fresh.close()
        finally:
            agent.stop()


def test_revoking_needs_dynsec_mode(tmp_path: Path, broker: MosquittoBroker) -> None:
    c = ControllerProcess(tmp_path, broker.url)
    c.start()
    try:
        with c.client() as api:
            body = api.post("/api/v1/devices", json={"id": "plain-1"}).json()
            assert body["mqtt_username"] is None and body["mqtt_password"] is None
            r = api.post("/api/v1/devices/plain-1/revoke")
            assert r.status_code == 409 and "EDGEFLEET_MQTT_BROKER_AUTH" in r.text
    finally:
        c.stop()


def test_device_acls_follow_the_topic_specs() -> None:
    acls = device_acls(TOPICS, "acl-x")
    allowed = {(a["acltype"], a["topic"]) for a in acls if a["allow"]}
    for kind, spec in SPECS.items():
        topic = TOPICS.device("acl-x", kind)
        if spec.from_agent:
            assert ("publishClientSend", topic) in allowed
            assert ("subscribePattern", topic) not in allowed
        else:
            assert ("subscribePattern", topic) in allowed and ("publishClientReceive", topic) in allowed
            assert ("publishClientSend", topic) not in allowed
    # Only its own topics, no wildcard allowed; everything else denied below them.
    assert all("acl-x" in t and "+" not in t and "#" not in t for _, t in allowed)
    denied = [a for a in acls if not a["allow"]]
    assert {a["topic"] for a in denied} == {"#"} and all(a["priority"] < 0 for a in denied)


def test_dynsec_mode_needs_an_admin_user(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="mqtt_admin_username"):
        ControllerSettings(data_dir=tmp_path, mqtt_url="mqtt://127.0.0.1:1883", mqtt_broker_auth="dynsec")
    settings = ControllerSettings(
        data_dir=tmp_path,
        mqtt_url="mqtt://ctl:secret@127.0.0.1:1883",
        mqtt_broker_auth="dynsec",
    )
    user, password = settings.mqtt_admin()
    assert user == "ctl" and password is not None and password.get_secret_value() == "secret"
    assert "secret" not in repr(settings) and "secret" not in settings.redacted_mqtt_url()
