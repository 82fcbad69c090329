"""The real agent against a real mosquitto, the real ped_ssdlite model and the real footage."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edge_agent.agent import Agent
from edge_agent.uplink.link import MqttLink
from fleet_protocol.codec import decode
from fleet_protocol.messages import Availability
from fleet_protocol.topics import TopicKind, Topics
from tests.support.edge_standin import (
    StandInController,
    agent_settings,
    camera_with,
    desired,
    load_manifest,
)
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import MODELS, REPO
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

PED = MODELS / "ped_ssdlite"


@pytest.fixture
def run_agent() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for a in started:
        a.shutdown()


def start(agent: Agent, registry: list[Agent]) -> Agent:
    registry.append(agent)
    agent.start()
    return agent


def retained_availability(broker: MosquittoBroker, device: str) -> Availability | None:
    """What a newcomer subscribing now gets as the retained availability."""
    got: list[Availability] = []
    done = threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2)

    def on_message(c: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        if m.retain:
            msg = decode(TopicKind.AVAILABILITY, bytes(m.payload))
            assert isinstance(msg, Availability)
            got.append(msg)
        done.set()

    client.on_message = on_message
    client.on_connect = lambda c, *a: c.subscribe(Topics().device(device, TopicKind.AVAILABILITY), 1)
    client.connect(broker.host, broker.port)
    client.loop_start()
    done.wait(2)
    client.disconnect()
    client.loop_stop()
    return got[-1] if got else None


def test_agent_fetches_model_then_streams_person_detections_acked_to_empty_outbox(
    broker: MosquittoBroker, tmp_path: Path, run_agent: list[Agent]
) -> None:
    manifest = load_manifest(PED)
    ctl = StandInController(broker.host, broker.port, "site-a", {manifest.sha256: PED / "model.onnx"})
    try:
        ctl.publish_desired(desired(1, {"cam1": camera_with(manifest)}))
        agent = start(Agent.from_settings(agent_settings("site-a", broker, tmp_path / "a")), run_agent)

        def running() -> bool:
            rep = ctl.latest_reported()
            return bool(rep and rep.desired_version == 1 and rep.cameras["cam1"].state == "running")

        wait_for(running, 40, "cam1 running ped_ssdlite")
        assert ctl.requests, "the model came over the artifact topics"
        assert (tmp_path / "a" / "models" / f"{manifest.sha256}.onnx").exists()

        wait_for(lambda: sum(1 for f in ctl.frames() if f.detections) >= 10, 30, "frames with persons")
        frames = ctl.frames()
        persons = [d for f in frames for d in f.detections]
        assert {d.label for d in persons} == {"person"}
        assert all(f.model == "ped_ssdlite:1" and f.width == 768 and f.height == 576 for f in frames)
        seqs = ctl.seqs_in_arrival_order()
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "detection seqs increase"

        birth = retained_availability(broker, "site-a")
        assert birth is not None and birth.state == "online"
        assert birth.capabilities is not None
        assert birth.capabilities.cameras == ["cam1"]
        assert "CPUExecutionProvider" in birth.capabilities.execution_providers

        # Camera absent from the desired state: inference stops, and with acks the outbox empties.
        ctl.publish_desired(desired(2, {}))

        def idle() -> bool:
            rep = ctl.latest_reported()
            return bool(rep and rep.desired_version == 2 and rep.cameras["cam1"].state == "idle")

        wait_for(idle, 20, "cam1 idle after desired v2")
        wait_for(lambda: agent.outbox.pending() == 0, 20, "outbox emptied by acks")
        kinds = {e.kind.value for e in ctl.events}
        assert {"agent_started", "camera_up", "model_download", "model_verify", "model_activate"} <= kinds
    finally:
        ctl.close()


@pytest.mark.parametrize(
    ("sig", "exit_code"), [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 0)], ids=["sigkill", "sigterm"]
)
def test_agent_process_ends_offline_whether_killed_or_stopped(
    broker: MosquittoBroker, tmp_path: Path, sig: signal.Signals, exit_code: int
) -> None:
    """SIGKILL: the broker delivers the Last Will; SIGTERM: the agent says offline itself and exits 0."""
    device = f"site-{sig.name.lower()}"
    config = tmp_path / "agent.yaml"
    config.write_text(f"device_id: {device}\nmqtt_url: {broker.url}\ndata_dir: {tmp_path / 'data'}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_agent", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def state() -> str | None:
            av = retained_availability(broker, device)
            return av.state if av else None

        wait_for(lambda: state() == "online", 30, "birth of the agent process")
        proc.send_signal(sig)
        assert proc.wait(15) == exit_code
        wait_for(lambda: state() == "offline", 15, "retained offline")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_broker_outage_loses_no_seq(
    own_broker: MosquittoBroker, tmp_path: Path, run_agent: list[Agent]
) -> None:
    manifest = load_manifest(PED)
    data = tmp_path / "b"
    # The model is already in the store (fetched earlier): this test is about the outage.
    (data / "models").mkdir(parents=True)
    shutil.copyfile(PED / "model.onnx", data / "models" / f"{manifest.sha256}.onnx")
    ctl = StandInController(own_broker.host, own_broker.port, "site-b", {})
    try:
        ctl.publish_desired(desired(1, {"cam1": camera_with(manifest)}))
        agent = start(Agent.from_settings(agent_settings("site-b", own_broker, data)), run_agent)
        wait_for(lambda: len(ctl.frames()) >= 5, 40, "detections before the outage")

        own_broker.stop()
        before = agent.outbox.pending()
        wait_for(lambda: agent.outbox.pending() >= before + 5, 20, "agent producing into its outbox offline")
        own_broker.start()

        ctl.publish_desired(desired(2, {}))  # the broker forgot everything; stop inference

        def all_delivered() -> bool:
            with ctl.lock:
                stored = set(ctl.stored)
            return agent.outbox.pending() == 0 and stored == set(range(1, agent.outbox.next_seq))

        wait_for(all_delivered, 40, "every seq delivered and acked after the outage")
        assert agent.outbox.next_seq - 1 > before + 5
    finally:
        ctl.close()


def test_refused_credentials_stop_the_agent_with_an_error_code(tmp_path: Path) -> None:
    locked = MosquittoBroker(tmp_path / "locked", extra_conf="allow_anonymous false\n")
    locked.start()
    try:
        agent = Agent.from_settings(agent_settings("site-locked", locked, tmp_path / "c", cameras=False))
        result: list[int] = []
        runner = threading.Thread(target=lambda: result.append(agent.run()), name="agent-run")
        runner.start()
        runner.join(30)
        assert not runner.is_alive(), "agent kept retrying a refused connection"
        assert result == [3]
    finally:
        locked.kill()


def test_garbage_on_every_agent_topic_is_dropped_and_the_agent_carries_on(
    broker: MosquittoBroker, tmp_path: Path, run_agent: list[Agent]
) -> None:
    ctl = StandInController(broker.host, broker.port, "site-g", {})
    try:
        agent = start(
            Agent.from_settings(agent_settings("site-g", broker, tmp_path / "g", cameras=False)), run_agent
        )
        link = agent.transport
        assert isinstance(link, MqttLink)
        # Junk sent before the broker's SUBACK would be dropped by the broker, not by the agent.
        wait_for(lambda: link.subscribed, 10, "agent subscribed to its topics")
        client = mqtt.Client(CallbackAPIVersion.VERSION2)
        client.connect(broker.host, broker.port)
        client.loop_start()
        topics = Topics()
        for kind in (TopicKind.TWIN_DESIRED, TopicKind.COMMANDS, TopicKind.ACKS, TopicKind.ARTIFACT_CHUNK):
            for junk in (b"", b"\xff\xfe", b"[1,2]", b'{"type":"desired","version":-1}'):
                client.publish(topics.device("site-g", kind), junk, qos=1).wait_for_publish(5)
        client.disconnect()
        client.loop_stop()
        ctl.publish_desired(desired(7, {}))

        def applied() -> bool:
            rep = ctl.latest_reported()
            return bool(rep and rep.desired_version == 7)

        wait_for(applied, 10, "a valid desired state applied after the garbage")
        errors = agent.commands.diagnostics()["protocol_errors"]
        assert sum(errors.values()) >= 12
        assert agent.fetcher.bad_chunks >= 4
    finally:
        ctl.close()
