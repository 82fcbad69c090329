"""An agent killed with kill -9 in the middle of a model transfer resumes with only the missing chunks.

Real mosquitto, a real controller process serving nanodet_coco (15 MB, fp32 pinned, the ref signed)
in 64 KiB chunks (232 of them), a real agent process trusting the controller's key. A spy on the
broker watches the agent's chunk requests and kills the agent (SIGKILL, from the spy's own callback,
so the moment is set by the transfer and not by a sleep) once half of the chunks were asked for. The
agent's bitmap on disk then says which chunks it lacks; after a restart it must ask for those and
nothing else, and the model must verify and run.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_protocol.messages import ModelManifest
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE, MODELS
from tests.support.processes import AgentProcess, ControllerProcess, start_controller
from tests.support.transfer_helpers import TransferSpy, bitmap_have
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

DEVICE = "resume-1"
MODEL = "nanodet_coco"
CHUNK = 64 * 1024
WINDOW = 8


@pytest.fixture
def controller(tmp_path: Path, own_broker: MosquittoBroker) -> Iterator[ControllerProcess]:
    c = start_controller(tmp_path, own_broker, EDGEFLEET_CHUNK_SIZE=str(CHUNK))
    yield c
    c.stop()


def test_agent_killed_at_half_a_transfer_resumes_with_only_the_missing_chunks(
    tmp_path: Path, own_broker: MosquittoBroker, controller: ControllerProcess
) -> None:
    manifest = ModelManifest.model_validate_json((MODELS / MODEL / "manifest.json").read_text())
    total = math.ceil(manifest.size / CHUNK)
    spy = TransferSpy(own_broker.host, own_broker.port, DEVICE)
    agent: AgentProcess | None = None
    try:
        with controller.client() as api:
            r = api.post("/api/v1/devices", json={"id": DEVICE})
            assert r.status_code in (200, 201), r.text
            # The agent trusts the controller's artifact key (fetched from its API at start).
            agent = AgentProcess(
                tmp_path,
                DEVICE,
                own_broker.url,
                cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
                controller=controller,
                # A fixed window (no byte budget), so the kill at half the requests lands mid-transfer.
                artifacts={"window": WINDOW, "window_bytes": CHUNK},
            )
            store = agent.workdir / DEVICE / "models"

            r = api.put(
                f"/api/v1/devices/{DEVICE}/cameras/cam1/model",
                json={"model": MODEL, "version": "1", "variant": "fp32"},
            )
            assert r.status_code == 200, r.text
            ref = r.json()["cameras"]["cam1"]["model"]
            assert ref["chunk_size"] == CHUNK and ref["manifest"]["sha256"] == manifest.sha256

            victim = agent

            def kill() -> None:
                assert victim.proc is not None
                os.kill(victim.proc.pid, signal.SIGKILL)

            killed = spy.when_distinct_requested(total // 2, kill)
            agent.start()
            wait_for(
                killed.is_set,
                timeout=60,
                what=f"the agent to ask for {total // 2} of {total} chunks",
                log=agent.log,
            )
            agent.kill9()  # reaps it; the SIGKILL was already sent

            # What the killed agent left on disk: a partial file and the bitmap of the chunks it has.
            have = bitmap_have(store, manifest.sha256)
            assert have is not None and len(have) == total, "the partial transfer's bitmap survives"
            assert (store / f"{manifest.sha256}.part").exists()
            assert not (store / f"{manifest.sha256}.onnx").exists()
            missing = {i for i, c in enumerate(have) if c == "0"}
            assert total // 4 <= len(missing) <= total - total // 4, (
                f"killed in the middle: {total - len(missing)}/{total} chunks on disk"
            )
            missing_bytes = sum(min(CHUNK, manifest.size - i * CHUNK) for i in missing)

            # Everything the dead agent asked for has been sent (into its broker session) before the
            # restart, so what is asked and sent from here on is due to the restarted agent alone.
            wait_for(
                spy.all_requests_answered,
                timeout=30,
                what="the controller answering every request",
                log=agent.log,
            )
            mark = spy.mark()

            agent.start()

            def model_detections() -> list[dict[str, Any]] | None:
                assert agent is not None and agent.alive(), "the restarted agent exited"
                items: list[dict[str, Any]] = api.get(
                    "/api/v1/detections", params={"device": DEVICE, "limit": 100}
                ).json()["items"]
                return [d for d in items if d["model"].startswith(f"{MODEL}:")] or None

            dets = wait_for(
                model_detections, timeout=90, what=f"detections by {MODEL} through the API", log=agent.log
            )
            assert all(d["camera"] == "cam1" for d in dets)

        asked = spy.requested_since(mark)
        resent = spy.served_since(mark)
        asked_set = set(asked)
        assert asked_set <= missing, (
            f"after the restart the agent asked for chunks it had on disk: {sorted(asked_set - missing)[:10]}"
        )
        # The broker may hand the restarted agent a few chunks sent into its session while it was dead
        # (at most one window); every other missing chunk is asked for once.
        assert len(asked_set) >= len(missing) - WINDOW, (len(asked_set), len(missing))
        assert len(asked_set) < total, "never the whole file again"
        resent_bytes = sum(n for _, n in resent)
        assert resent_bytes <= missing_bytes + WINDOW * CHUNK, (resent_bytes, missing_bytes)
        assert spy.bad_frames == 0

        # The model file the agent verified and runs is byte-for-byte the controller's.
        final = store / f"{manifest.sha256}.onnx"
        assert hashlib.sha256(final.read_bytes()).hexdigest() == manifest.sha256
        assert not (store / f"{manifest.sha256}.part").exists()
        assert not (store / f"{manifest.sha256}.bitmap").exists()
    finally:
        spy.close()
        if agent is not None:
            agent.stop()
