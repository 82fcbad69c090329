"""Break real things mid-stream and count: every seq the agent published is stored exactly once.

Each test prints one ``FAULT …`` line with its figures (copied into RELIABILITY.md); run with
``.venv/bin/pytest tests/fault -q -s`` to see them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.databases import DATABASES
from tests.fault.conftest import Figures, Rig, outbox_state
from tests.fault.tcp_proxy import TcpProxy
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e  # real broker, controller, agents, model and footage

BROKER_OUTAGE_S = 30


def _zero_loss(fig: Figures) -> None:
    assert fig.lost == 0, fig
    assert fig.stored_twice == 0, fig
    assert fig.outbox_dropped_agent == 0, fig
    assert fig.stored == fig.published, fig


def test_broker_stopped_30s_mid_stream(rig: Rig) -> None:
    rig.deploy("fault-a")
    agent = rig.agent("fault-a")
    agent.start()
    rig.wait_streaming(agent)
    rig.broker.stop()
    before = outbox_state(agent)["next_seq"]
    time.sleep(BROKER_OUTAGE_S)  # the fault is defined as 30 s of outage
    assert agent.alive()
    assert outbox_state(agent)["next_seq"] > before, "the agent kept producing while the broker was down"
    rig.broker.start()
    rig.wait_streaming(agent)
    _zero_loss(rig.converge(agent, "a broker stopped 30s"))


# On both databases: a controller killed mid-transaction must lose nothing on PostgreSQL either.
@pytest.mark.parametrize("controller_db", DATABASES, indirect=True)
def test_controller_kill9_mid_stream(rig: Rig) -> None:
    rig.deploy("fault-b")
    agent = rig.agent("fault-b")
    agent.start()
    rig.wait_streaming(agent)
    rig.controller.kill9()
    before = outbox_state(agent)["next_seq"]
    wait_for(lambda: outbox_state(agent)["next_seq"] >= before + 3, timeout=30, what="agent keeps producing")
    rig.controller.start()
    rig.wait_streaming(agent)
    _zero_loss(rig.converge(agent, "b controller kill -9"))


def test_agent_kill9_mid_stream(rig: Rig) -> None:
    rig.deploy("fault-c")
    agent = rig.agent("fault-c")
    agent.start()
    rig.wait_streaming(agent)
    agent.kill9()
    agent.start()
    rig.wait_streaming(agent)
    _zero_loss(rig.converge(agent, "c agent kill -9"))


@pytest.fixture
def proxy(rig: Rig) -> Iterator[TcpProxy]:
    p = TcpProxy(rig.broker.host, rig.broker.port)
    p.start()
    yield p
    p.stop()


def test_link_blackholed_without_closing(rig: Rig, proxy: TcpProxy) -> None:
    rig.deploy("fault-d")
    agent = rig.agent("fault-d", mqtt_url=proxy.url)
    agent.start()
    rig.wait_streaming(agent)
    assert rig.device("fault-d")["status"] == "online"
    log_mark = agent.log.stat().st_size
    accepted = proxy.accepted
    proxy.blackhole()
    # The controller notices the silent device (heartbeat timeout or the broker's Last Will)...
    wait_for(lambda: rig.device("fault-d")["status"] == "offline", timeout=30, what="device offline")
    # ...and the agent notices the dead link on its own (keepalive) and tries again.
    wait_for(
        lambda: "disconnected from" in agent.log.read_text()[log_mark:] and proxy.accepted > accepted,
        timeout=30,
        what="agent dropped the half-open link and reconnected",
    )
    proxy.heal()
    wait_for(lambda: rig.device("fault-d")["status"] == "online", timeout=30, what="device online again")
    rig.wait_streaming(agent)
    _zero_loss(rig.converge(agent, "d link blackholed"))


def test_outbox_bound_drops_oldest_counted_and_reported(rig: Rig) -> None:
    rig.deploy("fault-e")
    agent = rig.agent("fault-e", outbox={"max_messages": 10})
    agent.start()
    rig.wait_streaming(agent)
    wait_for(lambda: outbox_state(agent)["pending"] <= 2, timeout=20, what="outbox nearly empty")
    rig.broker.stop()
    # Far more than 10 messages while the broker is away.
    wait_for(
        lambda: outbox_state(agent)["dropped"] >= 10,
        timeout=60,
        what="the outbox bound dropping the oldest",
    )
    assert agent.alive(), agent.log.read_text()[-3000:]
    assert outbox_state(agent)["pending"] <= 10
    rig.broker.start()
    rig.wait_streaming(agent)
    fig = rig.converge(agent, "e outbox bound (max_messages=10)")
    assert fig.lost == 0, fig
    assert fig.stored_twice == 0, fig
    assert fig.outbox_dropped_agent >= 10, fig
    # A batch stored whose ack was lost (the broker link was down) can later be dropped and declared
    # by the agent: the controller keeps it as stored, so its drop count may be the smaller one.
    assert fig.outbox_dropped_controller <= fig.outbox_dropped_agent, fig
    assert fig.stored + fig.outbox_dropped_controller == fig.published, fig


def test_agent_restarted_offline_runs_from_disk_and_catches_up(rig: Rig, tmp_path: Path) -> None:
    rig.deploy("fault-offline")
    agent = rig.agent("fault-offline")
    agent.start()
    rig.wait_streaming(agent)
    rig.broker.stop()
    agent.stop()
    restarted_at = outbox_state(agent)["next_seq"]
    agent.start()  # no broker: desired state and model come from the agent's own disk

    def produced_offline() -> bool:
        assert agent.alive(), agent.log.read_text()[-3000:]
        return outbox_state(agent, since=restarted_at)["pending_detections"] >= 5

    wait_for(produced_offline, timeout=60, what="detections produced while offline, kept in the outbox")
    offline_last = outbox_state(agent)["next_seq"] - 1
    rig.broker.start()
    fig = rig.converge(agent, "offline restart (broker down)")
    _zero_loss(fig)
    offline_batches = rig._db_one(
        "SELECT COUNT(*) FROM ingested_seq WHERE device_id = :d AND kind = 'detections' "
        "AND NOT dropped AND seq BETWEEN :first AND :last",
        "fault-offline",
        first=restarted_at,
        last=offline_last,
    )
    assert offline_batches >= 5, "the detections made offline arrived"
