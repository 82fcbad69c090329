"""Acceptance: a flipped byte in a chunk, a tampered manifest and an unsigned manifest are each refused
and reported, and the model already running keeps producing detections.

A real agent (real onnxruntime, real footage) runs ped_ssdlite (model A) from a real mosquitto; the
stand-in controller then asks it to run nanodet_coco (model B) through a bad reference or bad bytes.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edge_agent.agent import Agent
from fleet_protocol.codec import encode_chunk
from fleet_protocol.messages import ArtifactRef, CameraDesired, CameraReported, Event, FrameDetections
from tests.support.edge_standin import (
    StandInController,
    agent_settings,
    camera_with,
    desired,
    load_manifest,
    signed_ref,
)
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import MODELS
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

MODEL_A = MODELS / "ped_ssdlite"
MODEL_B = MODELS / "nanodet_coco"
A_KEY = "ped_ssdlite:1"
BAD_CHUNK = 3


@dataclass
class StandInSite:
    """An in-process agent (the test reads its fetcher and pipeline) and the stand-in controller that
    serves it hand-made, tampered refs and chunks: not a tests.support.stack.Stack, whose controller
    is real and signs only good refs."""

    agent: Agent
    ctl: StandInController


@pytest.fixture
def site(broker: MosquittoBroker, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StandInSite]:
    """An agent running model A on cam1, detections flowing; model B is served by the stand-in."""
    device = f"sig-{request.node.callspec.id}"
    a, b = load_manifest(MODEL_A), load_manifest(MODEL_B)
    data = tmp_path / "agent"
    # Model A is already in the store: these tests are about what happens to B.
    (data / "models").mkdir(parents=True)
    shutil.copyfile(MODEL_A / "model.onnx", data / "models" / f"{a.sha256}.onnx")
    ctl = StandInController(broker.host, broker.port, device, {b.sha256: MODEL_B / "model.onnx"})
    agent = Agent.from_settings(agent_settings(device, broker, data))
    try:
        ctl.publish_desired(desired(1, {"cam1": camera_with(a)}))
        agent.start()

        def a_running() -> bool:
            rep = ctl.latest_reported()
            return bool(rep and rep.desired_version == 1 and rep.cameras["cam1"].state == "running")

        wait_for(a_running, 40, "cam1 running model A")
        wait_for(lambda: len(ctl.frames()) >= 3, 30, "detections from model A")
        yield StandInSite(agent, ctl)
    finally:
        agent.shutdown()
        ctl.close()


def flip_in_transit_then_at_the_source(sha: str, index: int, total: int, data: bytes, n: int) -> bytes:
    """Chunk BAD_CHUNK with one byte flipped: first in transit (its checksum no longer matches), then,
    when asked again, as if the controller's copy were corrupt (checksum made over the wrong bytes)."""
    if index != BAD_CHUNK:
        return encode_chunk(sha, index, total, data)
    bad = bytearray(data)
    bad[100] ^= 0x01
    if n == 1:
        good = encode_chunk(sha, index, total, data)
        return good[: -len(data)] + bytes(bad)
    return encode_chunk(sha, index, total, bytes(bad))


def tampered_labels(ref: ArtifactRef) -> ArtifactRef:
    return ref.model_copy(update={"manifest": ref.manifest.model_copy(update={"labels": ["person"] * 80})})


def tampered_sha256(ref: ArtifactRef) -> ArtifactRef:
    # Points the signed manifest at other bytes: the attack the signature exists to stop.
    return ref.model_copy(update={"manifest": ref.manifest.model_copy(update={"sha256": "0f" * 32})})


def unsigned(ref: ArtifactRef) -> ArtifactRef:
    return ref.model_copy(update={"signature": None, "key_id": None})


CASES = {
    "flipped-byte": (None, "sha256 mismatch for nanodet_coco"),
    "tampered-labels": (tampered_labels, "manifest tampered or signed by another key"),
    "tampered-sha256": (tampered_sha256, "manifest tampered or signed by another key"),
    "unsigned": (unsigned, "unsigned artifact"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_model_b_is_refused_and_reported_while_model_a_keeps_detecting(
    site: StandInSite, case: str
) -> None:
    agent, ctl = site.agent, site.ctl
    spoil, reason = CASES[case]
    ref = signed_ref(load_manifest(MODEL_B))
    if spoil is None:
        ctl.chunk_hook = flip_in_transit_then_at_the_source
    else:
        ref = spoil(ref)
    ctl.publish_desired(desired(2, {"cam1": CameraDesired(model=ref)}))

    def refused() -> CameraReported | None:
        rep = ctl.latest_reported()
        if rep and rep.desired_version == 2 and rep.cameras["cam1"].state == "failed":
            return rep.cameras["cam1"]
        return None

    cam = wait_for(refused, 60, f"model B refused ({case})")
    assert reason in (cam.error or "")
    assert cam.model == A_KEY, "the reported state says model A still runs"

    def failure_event() -> Event | None:
        with ctl.lock:
            return next((e for e in ctl.events if e.kind == "model_failed"), None)

    event = wait_for(failure_event, 20, "MODEL_FAILED event")
    assert event.camera == "cam1" and reason in event.message
    assert event.data["model"] == "nanodet_coco:1" and event.data["kept"] == A_KEY

    if spoil is None:
        # The in-transit flip was caught by the chunk checksum and asked again; the bytes that then
        # came with a matching checksum were caught by the whole-file sha256.
        assert agent.fetcher.bad_chunks >= 1
        with ctl.lock:
            assert ctl.served[(ref.manifest.sha256, BAD_CHUNK)] >= 2
    else:
        with ctl.lock:
            assert ctl.requests == [], "refused before a single chunk was asked for"
    store = agent.fetcher.store
    assert not agent.fetcher.has(ref.manifest.sha256)
    assert not list(store.glob("*.part")), "nothing of model B is left on disk"

    # Model A keeps detecting after the refusal.
    seen = len(ctl.frames())

    def more_from_a() -> list[FrameDetections] | None:
        later = ctl.frames()[seen:]
        return later if len(later) >= 5 else None

    later = wait_for(more_from_a, 30, "detections from model A after the refusal")
    assert {f.model for f in later} == {A_KEY}
    model = agent.pipeline.model_of("cam1")
    assert model is not None and model.key == A_KEY
