"""With real processes: forged chunks injected into a real transfer do not fail it, and a
device asking for a model that is not in its desired state gets nothing.

Real mosquitto (anonymous: any client may publish on a device's chunk topic, which is all a forger needs), a
real controller process serving nanodet_coco (15 MB, fp32 pinned, its ref signed with the chunk hashes)
in 64 KiB chunks, and a real agent process trusting the controller's key. As soon as the agent asks
for its first chunks, a forger floods well-formed frames for every index: other bytes, with the
chunk sha256 computed over them, so each frame is self-consistent. The agent must refuse them against
the signed list, keep the controller's chunks, verify the file and run the model.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol import TopicKind, Topics, encode, encode_chunk
from fleet_protocol.messages import ArtifactRequest, ModelManifest
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE, MODELS
from tests.support.processes import AgentProcess, ControllerProcess, start_controller
from tests.support.transfer_helpers import TransferSpy
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

DEVICE = "forgery-1"
STRANGER = "forgery-2"
MODEL = "nanodet_coco"
CHUNK = 64 * 1024


@pytest.fixture
def controller(tmp_path: Path, own_broker: MosquittoBroker) -> Iterator[ControllerProcess]:
    c = start_controller(tmp_path, own_broker, EDGEFLEET_CHUNK_SIZE=str(CHUNK))
    yield c
    c.stop()


class Client:
    """A bare MQTT client: publishes what it is given, records the payloads of one topic."""

    def __init__(self, broker: MosquittoBroker, client_id: str, listen: str | None = None) -> None:
        self.got: list[bytes] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
        self._c.on_message = lambda c, u, m: self._record(bytes(m.payload))
        self._c.on_connect = lambda c, u, f, rc, p: (
            c.subscribe(listen, 1) if listen else None,
            self._ready.set(),
        )
        self._c.connect(broker.host, broker.port)
        self._c.loop_start()
        wait_for(self._ready.is_set, timeout=10, what=f"{client_id} connected")
        time.sleep(0.2)  # the subscription settles

    def _record(self, payload: bytes) -> None:
        with self._lock:
            self.got.append(payload)

    def publish(self, topic: str, payload: bytes) -> None:
        self._c.publish(topic, payload, qos=1)

    def close(self) -> None:
        self._c.disconnect()
        self._c.loop_stop()


def _log_tail(agent: AgentProcess) -> str:
    return agent.log.read_text(errors="replace")[-4000:] if agent.log.exists() else "(no log)"


def test_forged_chunks_during_a_real_transfer_do_not_fail_it_and_strangers_get_nothing(
    tmp_path: Path, own_broker: MosquittoBroker, controller: ControllerProcess
) -> None:
    manifest = ModelManifest.model_validate_json((MODELS / MODEL / "manifest.json").read_text())
    total = math.ceil(manifest.size / CHUNK)
    topics = Topics()
    spy = TransferSpy(own_broker.host, own_broker.port, DEVICE)
    forger = Client(own_broker, "forger")
    stranger = Client(own_broker, STRANGER, listen=topics.device(STRANGER, TopicKind.ARTIFACT_CHUNK))
    agent: AgentProcess | None = None
    try:
        with controller.client() as api:
            for d in (DEVICE, STRANGER):
                r = api.post("/api/v1/devices", json={"id": d})
                assert r.status_code in (200, 201), r.text

            # A device with nothing assigned asks for the model (its sha256 is no secret): nothing comes.
            ask = ArtifactRequest(sha256=manifest.sha256, chunks=list(range(8)), chunk_size=CHUNK)
            stranger.publish(topics.device(STRANGER, TopicKind.ARTIFACT_REQUEST), encode(ask))

            def refused() -> bool:
                counters = api.get("/api/v1/stats/ingest").json()["counters"]
                return bool(counters.get("artifacts/request", {}).get("not_assigned"))

            wait_for(refused, timeout=20, what="the stranger's request refused")

            agent = AgentProcess(
                tmp_path,
                DEVICE,
                own_broker.url,
                cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
                controller=controller,
            )
            store = agent.workdir / DEVICE / "models"
            r = api.put(
                f"/api/v1/devices/{DEVICE}/cameras/cam1/model",
                json={"model": MODEL, "version": "1", "variant": "fp32"},
            )
            assert r.status_code == 200, r.text
            ref = r.json()["cameras"]["cam1"]["model"]
            assert ref["chunk_size"] == CHUNK and len(ref["manifest"]["chunk_hashes"]) == total

            chunk_topic = topics.device(DEVICE, TopicKind.ARTIFACT_CHUNK)
            junk = bytes([0x5A]) * CHUNK

            def forge() -> None:  # on the spy's network thread: publishing only queues
                for i in range(total):
                    data = junk[: min(CHUNK, manifest.size - i * CHUNK)]
                    forger.publish(chunk_topic, encode_chunk(manifest.sha256, i, total, data))

            forged = spy.when_distinct_requested(1, forge)
            agent.start()
            wait_for(forged.is_set, timeout=60, what="the agent's first chunk request (and the forgery)")

            def model_detections() -> list[dict[str, Any]] | None:
                assert agent is not None and agent.alive(), f"the agent exited\n{_log_tail(agent)}"
                items: list[dict[str, Any]] = api.get(
                    "/api/v1/detections", params={"device": DEVICE, "limit": 100}
                ).json()["items"]
                return [d for d in items if d["model"].startswith(f"{MODEL}:")] or None

            try:
                wait_for(model_detections, timeout=90, what=f"detections by {MODEL} through the API")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- agent log tail ---\n{_log_tail(agent)}") from None
            models = api.get(f"/api/v1/devices/{DEVICE}").json()["models"]
            assert models["cam1"]["state"] == "running", models

        final = store / f"{manifest.sha256}.onnx"
        assert hashlib.sha256(final.read_bytes()).hexdigest() == manifest.sha256
        log = agent.log.read_text(errors="replace")
        assert "not the signed manifest's" in log, "the forged frames reached the transfer and were refused"
        assert "sha256 mismatch" not in log  # never got into the file
        assert stranger.got == [], "a device got chunks of a model it was not assigned"
    finally:
        spy.close()
        forger.close()
        stranger.close()
        if agent is not None:
            agent.stop()
