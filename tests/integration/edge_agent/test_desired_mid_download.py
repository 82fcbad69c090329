"""A desired state that goes back to a stored model is applied while another model's download is stuck.

Real Mosquitto, the real agent (MqttLink, twin, fetcher) and two real models: ped_ssdlite (A) is in the
store and runs; the stand-in controller is asked for nanodet_coco (B, 15 MB in 64 KiB chunks) and sends
only its first chunks, then nothing more, as a slow site link would: B's transfer is under way and
far from done. A desired state going back to A then arrives. The agent reports A running for that
state while B's file is still incomplete, and keeps what arrived of B for a later resume.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.agent import Agent
from edge_agent.core.settings import ArtifactConfig
from fleet_protocol.messages import ArtifactRequest, EventKind
from tests.support.edge_standin import (
    StandInController,
    agent_settings,
    camera_with,
    desired,
    load_manifest,
)
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import MODELS
from tests.support.transfer_helpers import bitmap_have
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

A = MODELS / "ped_ssdlite"
B = MODELS / "nanodet_coco"
DEVICE = "mid-download-1"
CHUNK = 64 * 1024
SENT = 4  # chunks of B the stand-in sends before the link "stalls"


class StallingController(StandInController):
    """Sends the first :data:`SENT` chunks of any artifact and holds back the rest."""

    def _answer(self, req: ArtifactRequest) -> None:
        early = [i for i in req.chunks if i < SENT]
        if early:
            super()._answer(req.model_copy(update={"chunks": early}))


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for a in started:
        a.shutdown()


def test_going_back_to_a_stored_model_does_not_wait_for_a_download_in_progress(
    broker: MosquittoBroker, tmp_path: Path, agents: list[Agent]
) -> None:
    a, b = load_manifest(A), load_manifest(B)
    data = tmp_path / "agent"
    store = data / "models"
    store.mkdir(parents=True)
    shutil.copyfile(A / "model.onnx", store / f"{a.sha256}.onnx")
    ctl = StallingController(broker.host, broker.port, DEVICE, {b.sha256: B / "model.onnx"})
    try:
        settings = agent_settings(DEVICE, broker, data)
        # Long enough that the stalled transfer is never given up within the test: only the newer
        # desired state can end it.
        settings = settings.model_copy(update={"artifacts": ArtifactConfig(request_timeout_s=600)})
        agent = Agent.from_settings(settings)
        agents.append(agent)

        def reported(version: int, sha: str, state: str) -> bool:
            rep = ctl.latest_reported()
            cam = rep.cameras.get("cam1") if rep is not None else None
            return bool(
                rep and rep.desired_version == version and cam and cam.sha256 == sha and cam.state == state
            )

        ctl.publish_desired(desired(1, {"cam1": camera_with(a, chunk_size=CHUNK)}))
        agent.start()
        wait_for(lambda: reported(1, a.sha256, "running"), 40, "cam1 running A")

        ctl.publish_desired(desired(2, {"cam1": camera_with(b, chunk_size=CHUNK)}))
        wait_for(
            lambda: (bitmap_have(store, b.sha256) or "").count("1") == SENT,
            30,
            f"B's transfer under way ({SENT} chunks on disk)",
        )
        assert agent.pipeline.model_of("cam1").sha256 == a.sha256  # type: ignore[union-attr]

        ctl.publish_desired(desired(3, {"cam1": camera_with(a, chunk_size=CHUNK)}))
        wait_for(lambda: reported(3, a.sha256, "running"), 20, "cam1 reported running A for v3")

        # B never completed nor ran; what arrived of it stays on disk for a resume.
        assert not (store / f"{b.sha256}.onnx").exists()
        assert (store / f"{b.sha256}.part").exists()
        have = bitmap_have(store, b.sha256)
        assert have is not None and have.count("1") == SENT and len(have) > SENT
        with ctl.lock:
            activated = [e.data.get("sha256") for e in ctl.events if e.kind == EventKind.MODEL_ACTIVATE]
        assert b.sha256 not in activated
    finally:
        ctl.close()
