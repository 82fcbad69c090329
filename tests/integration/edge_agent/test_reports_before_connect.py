"""What the agent reports before its link first connects reaches the controller once the broker is up.

Real Mosquitto, the real agent (its MqttLink, twin, publisher and on-disk outbox), the real ped_ssdlite
model and footage. The agent starts while its broker is not running, from a desired state it kept on
disk and a model already in its store: it applies that state and reports it, records events (started,
camera up, model active), all with no link. Once the broker comes up, a subscriber gets the reported
state of what the device runs and every one of those events.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.agent import Agent
from fleet_protocol.codec import encode
from fleet_protocol.messages import EventKind
from tests.support.edge_standin import (
    StandInController,
    agent_settings,
    camera_with,
    desired,
    load_manifest,
    signed_state,
)
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import MODELS
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

PED = MODELS / "ped_ssdlite"
DEVICE = "early-1"


@pytest.fixture
def later_broker(tmp_path: Path) -> Iterator[MosquittoBroker]:
    """A Mosquitto with its port chosen but not started: the agent's broker is not reachable yet."""
    b = MosquittoBroker(tmp_path / "mosquitto")
    yield b
    b.kill()


def test_reports_made_before_the_link_connects_arrive_once_it_does(
    tmp_path: Path, later_broker: MosquittoBroker
) -> None:
    manifest = load_manifest(PED)
    data = tmp_path / "agent"
    (data / "models").mkdir(parents=True)
    shutil.copyfile(PED / "model.onnx", data / "models" / f"{manifest.sha256}.onnx")
    state = signed_state(desired(7, {"cam1": camera_with(manifest)}), DEVICE)
    (data / "desired.json").write_bytes(encode(state))

    agent = Agent.from_settings(agent_settings(DEVICE, later_broker, data))
    ctl: StandInController | None = None
    try:
        agent.start()
        # The state is applied and reported, and the activation recorded, with no broker to take them.
        wait_for(
            lambda: agent.twin.applied_version == 7 and agent.pipeline.model_of("cam1") is not None,
            40,
            "the kept desired state applied offline",
        )
        wait_for(lambda: agent.outbox.pending() >= 3, 20, "events recorded offline (started, camera, model)")
        assert not agent.transport.connected

        later_broker.start()
        ctl = StandInController(later_broker.host, later_broker.port, DEVICE, {})

        def reported_running() -> bool:
            assert ctl is not None
            rep = ctl.latest_reported()
            return bool(
                rep
                and rep.desired_version == 7
                and rep.cameras["cam1"].state == "running"
                and rep.cameras["cam1"].sha256 == manifest.sha256
            )

        wait_for(reported_running, 30, "the reported state made offline, at the subscriber")

        def kinds() -> set[EventKind]:
            assert ctl is not None
            with ctl.lock:
                return {e.kind for e in ctl.events}

        wanted = {EventKind.AGENT_STARTED, EventKind.CAMERA_UP, EventKind.MODEL_ACTIVATE}
        wait_for(lambda: wanted <= kinds(), 30, "the events recorded offline, at the subscriber")
    finally:
        if ctl is not None:
            ctl.close()
        agent.shutdown()
