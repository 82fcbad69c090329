"""A device whose byte-rate cap is below what its agent asks for still downloads the model, paced at the
cap: chunks over the cap wait for it on the controller instead of being dropped.

Real mosquitto, a real controller process (its artifact server, with a per-device cap of 512 KiB/s and a
burst of 8 MiB, chunks of 1 MiB: each chunk past the burst waits two seconds for the cap), and the
agent's own link and fetcher with their default window and request timeout. A spy on the broker sees
what crossed the wire. The achieved rate is a figure for bench/transfer.py (``--cap``), not for here.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edge_agent.core.settings import ArtifactConfig, MqttEndpoint
from edge_agent.uplink.artifacts import ArtifactFetcher
from edge_agent.uplink.link import MqttLink
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import ArtifactRef, Availability, ModelManifest
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import MODELS
from tests.support.processes import ControllerProcess, bearer, start_controller
from tests.support.transfer_helpers import TransferSpy

pytestmark = pytest.mark.integration

DEVICE = "capped-1"
MODEL = "ped_ssdlite"
CHUNK = 2**20
RATE = 512 * 1024
BURST = 8 * 2**20


@pytest.fixture
def controller(tmp_path: Path, own_broker: MosquittoBroker) -> Iterator[ControllerProcess]:
    c = start_controller(
        tmp_path,
        own_broker,
        EDGEFLEET_CHUNK_SIZE=str(CHUNK),
        EDGEFLEET_ARTIFACT_DEVICE_BYTES_PER_S=str(RATE),
        EDGEFLEET_ARTIFACT_DEVICE_BURST_BYTES=str(BURST),
    )
    yield c
    c.stop()


def chunk_outcomes(controller: ControllerProcess) -> dict[str, float]:
    text = httpx.get(f"{controller.url}/metrics", headers=bearer(controller.token), timeout=10).text
    found = re.findall(
        r'edgefleet_mqtt_messages_total\{kind="artifacts/chunk",outcome="([a-z_]+)"\} (\S+)', text
    )
    return {outcome: float(n) for outcome, n in found}


def test_a_device_capped_below_its_agent_s_window_gets_the_model_at_the_cap_with_nothing_dropped(
    tmp_path: Path, own_broker: MosquittoBroker, controller: ControllerProcess
) -> None:
    manifest = ModelManifest.model_validate_json((MODELS / MODEL / "manifest.json").read_text())
    total = -(-manifest.size // CHUNK)
    assert manifest.size > BURST + 3 * CHUNK, "the cap must bind for several chunks"
    spy = TransferSpy(own_broker.host, own_broker.port, DEVICE)
    link = MqttLink(MqttEndpoint.parse(own_broker.url), device_id=DEVICE, topics=Topics())
    config = ArtifactConfig()
    fetcher = ArtifactFetcher(
        tmp_path / "store",
        lambda req: link.publish(TopicKind.ARTIFACT_REQUEST, encode(req)),
        window=config.window,
        window_bytes=config.window_bytes,
        request_timeout_s=config.request_timeout_s,
        max_retries=config.max_retries,
    )
    link.set_callbacks(
        birth=lambda: Availability(state="online", ts=time.time()),
        on_connected=lambda: None,
        on_fatal=lambda why: None,
    )
    link.on_chunk(fetcher.on_chunk)
    try:
        with controller.client() as api:
            assert api.post("/api/v1/devices", json={"id": DEVICE}).status_code in (200, 201)
            r = api.put(
                f"/api/v1/devices/{DEVICE}/cameras/cam1/model",
                json={"model": MODEL, "version": "1", "variant": "fp32"},
            )
            assert r.status_code == 200, r.text
        ref = ArtifactRef.model_validate(r.json()["cameras"]["cam1"]["model"])
        assert ref.chunk_size == CHUNK and ref.manifest.sha256 == manifest.sha256
        link.start()
        assert link.wait_connected(10)

        t0 = time.monotonic()
        path = fetcher.fetch(ref, threading.Event())
        elapsed = time.monotonic() - t0

        assert hashlib.sha256(path.read_bytes()).hexdigest() == manifest.sha256
        # The cap was in force (the transfer could not have been faster), and yet nothing was dropped:
        # every chunk was sent once and asked for no more than the agent's timer made it.
        assert elapsed >= 0.9 * (manifest.size - BURST) / RATE
        outcomes = chunk_outcomes(controller)
        assert outcomes.get("dropped_bytes_cap", 0) == 0, outcomes
        assert outcomes.get("delayed_bytes_cap", 0) > 0, outcomes
        assert sorted(i for i, _ in spy.served) == list(range(total)), "each chunk sent exactly once"
        assert spy.bad_frames == 0
    finally:
        spy.close()
        link.stop()
