"""The controller with its real MQTT bridge against a real mosquitto."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controller.app import create_app
from controller.settings import ControllerSettings
from fleet_protocol import ProtocolError, TopicKind, Topics, decode, decode_chunk
from fleet_protocol.messages import (
    Ack,
    ArtifactRequest,
    Availability,
    Box,
    Capabilities,
    DesiredState,
    Detection,
    DetectionBatch,
    FrameDetections,
    Heartbeat,
)
from tests.support.controller_app import TINY_MODEL_BYTES, AppFactory
from tests.support.fakes.agent import FakeAgent
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ADMIN_HEADERS, ADMIN_TOKEN
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

AgentFactory = Callable[..., FakeAgent]


def batch(seq: int) -> DetectionBatch:
    frame = FrameDetections(
        camera="cam1",
        frame=seq,
        captured_at=time.time(),
        width=640,
        height=480,
        model="tiny:1",
        inference_ms=5.0,
        detections=[Detection(label="person", class_id=0, score=0.8, box=Box(x0=0, y0=0, x1=5, y1=5))],
    )
    return DetectionBatch(seq=seq, sent_at=time.time(), frames=[frame])


def last_ack(agent: FakeAgent) -> Ack | None:
    """The newest well-formed ack (a test may have put garbage on the acks topic itself)."""
    for raw in reversed(agent.got(TopicKind.ACKS)):
        try:
            ack = decode(TopicKind.ACKS, raw)
        except ProtocolError:
            continue
        assert isinstance(ack, Ack)
        return ack
    return None


def send_until_acked(agent: FakeAgent, seqs: list[int], check: Callable[[Ack], bool]) -> Ack:
    """What the agent's outbox does: resend un-acked messages until an ack covers them."""

    def attempt() -> Ack | None:
        ack = last_ack(agent)
        if ack is not None and check(ack):
            return ack
        for s in seqs:
            if ack is None or not ack.covers(s):
                agent.publish(TopicKind.DETECTIONS, batch(s))
        return None

    return wait_for(attempt, timeout=15, what=f"ack covering {seqs}", interval=0.3)


def get_device(client: TestClient, device_id: str) -> dict[str, Any] | None:
    r = client.get(f"/api/v1/devices/{device_id}")
    return r.json() if r.status_code == 200 else None  # type: ignore[no-any-return]


def test_device_traffic_reaches_the_api_and_is_acked(make_app: AppFactory, agents: AgentFactory) -> None:
    client = make_app()
    agent = agents("it-dev-1")
    agent.publish(
        TopicKind.AVAILABILITY,
        Availability(state="online", agent_version="9.9", capabilities=Capabilities(cpu_count=4)),
        retain=True,
    )
    wait_for(
        lambda: (d := get_device(client, "it-dev-1")) and d["status"] == "online", timeout=10, what="online"
    )

    def heartbeat_seen() -> bool:
        agent.publish(TopicKind.HEARTBEAT, Heartbeat(ts=time.time(), cpu_pct=12.0), qos=0)
        d = get_device(client, "it-dev-1")
        return bool(d and d["last_health"] and d["last_health"]["cpu_pct"] == 12.0)

    wait_for(heartbeat_seen, timeout=10, what="heartbeat stored", interval=0.3)
    ack = send_until_acked(agent, [1, 2, 3], lambda a: a.upto >= 3)
    assert ack.upto == 3 and ack.ranges == []
    items = client.get("/api/v1/detections", params={"device": "it-dev-1"}).json()["items"]
    assert sorted(i["seq"] for i in items) == [1, 2, 3]
    dev = get_device(client, "it-dev-1")
    assert dev is not None and dev["agent_version"] == "9.9" and dev["stats"]["lost"] == 0


def test_last_will_marks_device_offline(make_app: AppFactory, agents: AgentFactory) -> None:
    client = make_app()
    agent = agents("it-dev-lwt")
    agent.publish(TopicKind.AVAILABILITY, Availability(state="online"), retain=True)
    wait_for(
        lambda: (d := get_device(client, "it-dev-lwt")) and d["status"] == "online", timeout=10, what="online"
    )
    agent.drop_connection()
    dev = wait_for(
        lambda: (d := get_device(client, "it-dev-lwt")) and d["status"] == "offline" and d,
        timeout=15,
        what="offline via LWT",
    )
    assert dev["offline_since"] is not None


def test_garbage_on_every_topic_is_counted_and_app_keeps_serving(
    make_app: AppFactory, agents: AgentFactory
) -> None:
    client = make_app()
    agent = agents("it-dev-junk", will=False)
    for kind in TopicKind:
        agent.publish_raw(agent.topics.device("it-dev-junk", kind), b"\x00garbage{")
    agent.publish_raw("edgefleet/v1/devices/it-dev-junk/unknown-kind", b"{}")
    from_agent = [
        "availability",
        "heartbeat",
        "detections",
        "events",
        "twin/reported",
        "commands/result",
        "artifacts/request",
    ]

    def all_counted() -> bool:
        counters = client.get("/api/v1/stats/ingest").json()["counters"]
        return all(counters.get(k, {}).get("invalid") == 1 for k in from_agent)

    wait_for(all_counted, timeout=10, what="garbage counted on every agent topic")
    health = client.get("/healthz").json()
    assert health.pop("replica")  # this process's replica id
    assert health == {"status": "ok", "db": True, "mqtt": True, "leader": True}
    send_until_acked(agent, [1], lambda a: a.upto == 1)


def test_restarted_controller_acks_already_stored_seqs(
    make_app: AppFactory, agents: AgentFactory, tmp_path: Path, models_dir: Path, broker: MosquittoBroker
) -> None:
    settings = ControllerSettings(
        data_dir=tmp_path / "data", models_dir=models_dir, mqtt_url=broker.url, admin_token=ADMIN_TOKEN
    )
    agent = agents("it-dev-restart", will=False)
    with TestClient(create_app(settings), headers=ADMIN_HEADERS) as first:
        wait_for(lambda: first.get("/healthz").json()["mqtt"], timeout=10, what="first connected")
        send_until_acked(agent, [1, 2, 3], lambda a: a.upto == 3)
    n_acks = len(agent.got(TopicKind.ACKS))
    second = make_app()  # same data_dir → same SQLite database
    assert second.get("/api/v1/devices/it-dev-restart").json()["stats"]["stored"] == 3

    def reacked() -> Ack | None:
        if len(agent.got(TopicKind.ACKS)) > n_acks:
            return last_ack(agent)
        agent.publish(TopicKind.DETECTIONS, batch(3))  # the agent resends: it never saw the last ack
        return None

    ack = wait_for(reacked, timeout=15, what="ack from the restarted controller", interval=0.3)
    assert ack.upto == 3
    assert second.get("/api/v1/devices/it-dev-restart").json()["stats"]["duplicates"] >= 1
    assert len(second.get("/api/v1/detections", params={"device": "it-dev-restart"}).json()["items"]) == 3


def test_model_assignment_reaches_the_device_and_chunks_are_served(
    make_app: AppFactory, agents: AgentFactory
) -> None:
    client = make_app(chunk_size=64 * 1024)
    agent = agents("it-dev-model", will=False)
    client.post("/api/v1/devices", json={"id": "it-dev-model"})
    r = client.put("/api/v1/devices/it-dev-model/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    raw = wait_for(lambda: agent.got(TopicKind.TWIN_DESIRED), timeout=10, what="desired state")[-1]
    desired = decode(TopicKind.TWIN_DESIRED, raw)
    assert isinstance(desired, DesiredState) and desired.version == 1
    ref = desired.cameras["cam1"].model
    assert ref is not None
    agent.publish(
        TopicKind.ARTIFACT_REQUEST,
        ArtifactRequest(
            sha256=ref.manifest.sha256, chunks=list(range(ref.chunk_count)), chunk_size=ref.chunk_size
        ),
    )
    frames = wait_for(
        lambda: c if len(c := agent.got(TopicKind.ARTIFACT_CHUNK)) == ref.chunk_count else None,
        timeout=10,
        what="all chunks",
    )
    parts = dict(sorted((h.index, d) for h, d in map(decode_chunk, frames)))
    assert b"".join(parts.values()) == TINY_MODEL_BYTES


def test_desired_state_survives_a_broker_restart(
    tmp_path: Path, models_dir: Path, own_broker: MosquittoBroker, agents: AgentFactory
) -> None:
    settings = ControllerSettings(
        data_dir=tmp_path / "data", models_dir=models_dir, mqtt_url=own_broker.url, admin_token=ADMIN_TOKEN
    )
    with TestClient(create_app(settings), headers=ADMIN_HEADERS) as client:
        wait_for(lambda: client.get("/healthz").json()["mqtt"], timeout=10, what="connected")
        client.post("/api/v1/devices", json={"id": "it-dev-persist"})
        client.put(
            "/api/v1/devices/it-dev-persist/cameras/cam1/model", json={"model": "tiny", "version": "1"}
        )
        own_broker.stop()  # persistence false: the retained desired state is gone with it
        own_broker.start()
        wait_for(lambda: client.get("/healthz").json()["mqtt"], timeout=20, what="reconnected")
        # A device connecting only now gets the desired state from the retained copy republished on reconnect.
        late = FakeAgent(own_broker.host, own_broker.port, "it-dev-persist", Topics(), will=False)
        try:
            raw = wait_for(
                lambda: late.got(TopicKind.TWIN_DESIRED), timeout=10, what="retained desired state"
            )[-1]
            desired = decode(TopicKind.TWIN_DESIRED, raw)
            assert isinstance(desired, DesiredState) and desired.version == 1 and "cam1" in desired.cameras
        finally:
            late.close()


def test_bad_credentials_are_refused_without_retrying(tmp_path: Path, models_dir: Path) -> None:
    pwfile = tmp_path / "passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(pwfile), "edge", "right"], check=True, capture_output=True
    )
    pwfile.chmod(0o600)
    # As root, mosquitto drops to user 'mosquitto', which cannot read a file under pytest's tmp dir.
    as_root = "user root\n" if os.geteuid() == 0 else ""
    broker = MosquittoBroker(
        tmp_path / "secure", extra_conf=f"allow_anonymous false\npassword_file {pwfile}\n{as_root}"
    )
    broker.start()
    try:
        url = f"mqtt://edge:wrong@{broker.host}:{broker.port}"
        settings = ControllerSettings(
            data_dir=tmp_path / "data", models_dir=models_dir, mqtt_url=url, admin_token=ADMIN_TOKEN
        )
        with TestClient(create_app(settings), headers=ADMIN_HEADERS) as client:
            transport = client.app.state.runtime.bridge.transport  # type: ignore[attr-defined]
            wait_for(lambda: transport.refused, timeout=10, what="refused CONNACK noticed")
            health = client.get("/healthz").json()
            assert health["mqtt"] is False and health["db"] is True
            # Without retrying: over the next 3 s (a reconnect loop would try every second or so) the
            # broker refuses no second CONNECT.
            time.sleep(3)
            refusals = broker.log.read_text().count("not authorised")
            assert refusals == 1, broker.log.read_text()[-2000:]
        good = ControllerSettings(
            data_dir=tmp_path / "data2",
            models_dir=models_dir,
            mqtt_url=url.replace("wrong", "right"),
            admin_token=ADMIN_TOKEN,
        )
        with TestClient(create_app(good), headers=ADMIN_HEADERS) as client:
            wait_for(
                lambda: client.get("/healthz").json()["mqtt"],
                timeout=10,
                what="connected with right password",
            )
    finally:
        broker.kill()
