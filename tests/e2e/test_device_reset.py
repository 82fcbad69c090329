"""A reflashed device loses nothing: a controller process and an agent process
running the real person detector on the real footage; the agent is stopped, its data folder deleted
(its outbox with it) and started again. Its new outbox numbers from seq 1 in a new incarnation: every
batch of both incarnations is stored, none taken for a duplicate, the device view shows the new
incarnation and one ``device_reset`` event says what happened."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.databases import DATABASES
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE
from tests.support.processes import AgentProcess, ControllerProcess, start_controller
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

DEVICE = "e2e-reflashed"
BATCHES = 12  # seqs each incarnation must have stored before it is wiped or checked


@pytest.fixture
def controller(
    tmp_path: Path, broker: MosquittoBroker, controller_db: str | None
) -> Iterator[ControllerProcess]:
    c = start_controller(tmp_path, broker, controller_db)
    yield c
    c.stop()


@pytest.fixture
def agent(tmp_path: Path, broker: MosquittoBroker, controller: ControllerProcess) -> Iterator[AgentProcess]:
    a = AgentProcess(
        tmp_path,
        DEVICE,
        broker.url,
        cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
        controller=controller,
        # Small batches, so that a few seconds of footage make many seqs.
        outbox={"batch_max_frames": 2, "batch_max_delay_s": 0.2},
    )
    yield a
    a.stop()


def spaces(api: httpx.Client) -> list[dict[str, Any]]:
    r = api.get(f"/api/v1/devices/{DEVICE}")
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()["stats"]["incarnations"]
    return found


def whole(space: dict[str, Any]) -> bool:
    """Every seq from 1 to the highest stored, acked, none lost or dropped."""
    return (
        space["max_seq"] >= BATCHES
        and space["stored"] == space["max_seq"] == space["acked_upto"]
        and space["lost"] == space["dropped"] == 0
    )


@pytest.mark.parametrize("controller_db", DATABASES, indirect=True)
def test_a_wiped_agent_starts_a_new_incarnation_and_nothing_of_either_is_lost(
    controller: ControllerProcess, agent: AgentProcess
) -> None:
    with controller.client() as api:
        assert api.post("/api/v1/devices", json={"id": DEVICE}).status_code in (200, 201)
        r = api.put(
            f"/api/v1/devices/{DEVICE}/cameras/cam1/model", json={"model": "ped_ssdlite", "version": "1"}
        )
        assert r.status_code == 200, r.text
        agent.start()

        def first_whole() -> list[dict[str, Any]] | None:
            assert agent.alive(), agent.log.read_text()[-3000:]
            found = spaces(api)
            return found if len(found) == 1 and whole(found[0]) else None

        (first,) = wait_for(first_whole, timeout=90, what=f"{BATCHES} seqs of the first incarnation stored")
        old = first["incarnation"]
        assert old is not None and api.get(f"/api/v1/devices/{DEVICE}").json()["incarnation"] == old

        # The reflash: the agent stops, its data folder (outbox, models) goes, the same agent starts.
        agent.stop()
        shutil.rmtree(agent.workdir / DEVICE)
        agent.start()

        def both_whole() -> list[dict[str, Any]] | None:
            assert agent.alive(), agent.log.read_text()[-3000:]
            found = spaces(api)
            return found if len(found) == 2 and all(whole(s) for s in found) else None

        before, after = wait_for(
            both_whole, timeout=120, what=f"{BATCHES} seqs of the new incarnation stored"
        )
        # The first incarnation is as it was left: every seq it sent is stored, from 1 on.
        assert before["incarnation"] == old and before["max_seq"] >= first["max_seq"]
        assert after["incarnation"] not in (None, old)
        # The new one started again at 1: nothing of it was taken for a duplicate of the old one.
        assert before["duplicates"] == after["duplicates"] == 0

        view = api.get(f"/api/v1/devices/{DEVICE}").json()
        assert view["incarnation"] == after["incarnation"] and view["incarnation_started_at"] is not None
        r = api.get("/api/v1/events", params={"device": DEVICE, "kind": "device_reset"})
        assert r.status_code == 200, r.text
        assert [e["data"] for e in r.json()] == [{"previous": old, "incarnation": after["incarnation"]}]
        assert view["stats"]["lost"] == 0 and view["stats"]["duplicates"] == 0
