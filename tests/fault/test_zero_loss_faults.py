"""Break real things mid-stream and count: every seq the agent published is stored exactly once.

Each test prints one ``FAULT …`` line with its figures (copied into RELIABILITY.md); run with
``.venv/bin/pytest tests/fault -q -s`` to see them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.databases import DATABASES
from tests.support.faults import FaultStack, Figures, in_flight, outbox_state
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e  # real broker, controller, agents, model and footage

BROKER_OUTAGE_S = 30


def _zero_loss(fig: Figures) -> None:
    assert fig.lost == 0, fig
    assert fig.stored_twice == 0, fig
    assert fig.outbox_dropped_agent == 0, fig
    assert fig.stored == fig.published, fig


def test_broker_stopped_30s_mid_stream(rig: FaultStack) -> None:
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
    _zero_loss(rig.converge(agent, "a broker stopped 30s", wire_complete=False))


# On both databases: a controller killed mid-transaction must lose nothing on PostgreSQL either.
@pytest.mark.parametrize("controller_db", DATABASES, indirect=True)
def test_controller_kill9_mid_stream(rig: FaultStack) -> None:
    """The controller is frozen (SIGSTOP) until batches it was sent sit unacked in the agent's outbox,
    then killed (-9) with them unhandled: the agent must send them again, to a dead controller and then
    to the restarted one, and each is stored exactly once."""
    rig.deploy("fault-b")
    agent = rig.agent("fault-b")
    agent.start()
    rig.wait_streaming(agent)
    rig.controller.pause()  # connected, but no ingest and no ack from here on
    held = wait_for(
        lambda: len(s := in_flight(agent)) >= 3 and s, timeout=30, what="batches sent and held unacked"
    )
    wait_for(lambda: held <= set(rig.tap.seqs), timeout=10, what="the held batches crossed the broker")
    rig.controller.kill9()
    held = in_flight(agent)  # no controller: nothing can be acked any more
    assert held, "the outbox had sent, unacked rows at the kill"
    mark = rig.tap.mark()
    # Unacked after ack_timeout_s (3 s): sent again while the controller is dead.
    wait_for(lambda: held <= set(rig.tap.since(mark)), timeout=30, what="the held batches resent")
    rig.controller.start()
    rig.wait_streaming(agent)
    fig = rig.converge(agent, f"b controller kill -9 ({len(held)} held at the kill)")
    _zero_loss(fig)
    assert fig.wire_msgs > fig.wire_distinct, fig


def test_agent_kill9_mid_stream(rig: FaultStack) -> None:
    """Acks are held (the controller frozen by SIGSTOP) so that the agent's outbox has sent, unacked
    rows when it is killed (-9); the restarted agent sends them again (before the controller could
    ack anything: a resend, not a first send), and each is stored exactly once."""
    rig.deploy("fault-c")
    agent = rig.agent("fault-c")
    agent.start()
    rig.wait_streaming(agent)
    rig.controller.pause()
    wait_for(lambda: len(in_flight(agent)) >= 3, timeout=30, what="batches sent and held unacked")
    agent.kill9()
    held = in_flight(agent)  # read from the dead agent's outbox on disk: pending at the kill
    assert held, "the outbox had sent, unacked rows at the kill"
    wait_for(lambda: held <= set(rig.tap.seqs), timeout=10, what="the held batches crossed the broker")
    mark = rig.tap.mark()
    agent.start()
    wait_for(lambda: held <= set(rig.tap.since(mark)), timeout=60, what="the restarted agent resent them")
    rig.controller.resume()
    rig.wait_streaming(agent)
    fig = rig.converge(agent, f"c agent kill -9 ({len(held)} held at the kill)")
    _zero_loss(fig)
    assert fig.wire_msgs > fig.wire_distinct, fig


@pytest.fixture
def proxy(rig: FaultStack) -> Iterator[TcpProxy]:
    p = TcpProxy(rig.broker.host, rig.broker.port)
    p.start()
    yield p
    p.stop()


def test_link_blackholed_without_closing(rig: FaultStack, proxy: TcpProxy) -> None:
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


def test_outbox_bound_drops_oldest_counted_and_reported(rig: FaultStack) -> None:
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
    fig = rig.converge(agent, "e outbox bound (max_messages=10)", wire_complete=False)
    assert fig.lost == 0, fig
    assert fig.stored_twice == 0, fig
    assert fig.outbox_dropped_agent >= 10, fig
    # A batch stored whose ack was lost (the broker link was down) can later be dropped and declared
    # by the agent: the controller keeps it as stored, so its drop count may be the smaller one.
    assert fig.outbox_dropped_controller <= fig.outbox_dropped_agent, fig
    assert fig.stored + fig.outbox_dropped_controller == fig.published, fig


def test_agent_restarted_offline_runs_from_disk_and_catches_up(rig: FaultStack, tmp_path: Path) -> None:
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
    fig = rig.converge(agent, "offline restart (broker down)", wire_complete=False)
    _zero_loss(fig)
    offline_batches = rig._db_one(
        "SELECT COUNT(*) FROM ingested_seq WHERE device_id = :d AND kind = 'detections' "
        "AND NOT dropped AND seq BETWEEN :first AND :last",
        "fault-offline",
        first=restarted_at,
        last=offline_last,
    )
    assert offline_batches >= 5, "the detections made offline arrived"


LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)


@pytest.mark.parametrize(("skew", "skew_s"), [("+1h", 3600), ("-1h", -3600)], ids=["ahead", "behind"])
def test_agent_clock_an_hour_off(rig: FaultStack, skew: str, skew_s: int) -> None:
    """The agent's wall clock an hour ahead of or behind the controller's (libfaketime; monotonic
    clocks untouched, as on a device whose NTP is off): everything arrives, once, and the controller
    keeps the device online and stores the agent's own capture times."""
    if LIBFAKETIME is None:
        pytest.fail("libfaketime missing: install the Debian package 'faketime' (tests/run.sh does as root)")
    device = f"fault-clock-{'ahead' if skew_s > 0 else 'behind'}"
    rig.deploy(device)
    agent = rig.agent(device)
    agent.env = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": skew, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    agent.start()
    rig.wait_streaming(agent, batches=5)
    # The fault hit: the capture times stored are the agent's, an hour off the controller's clock.
    items = rig.call("GET", "/api/v1/detections", params={"device": device, "limit": 50})["items"]
    assert items, "detections stored"
    offsets = [datetime.fromisoformat(d["captured_at"]).timestamp() - time.time() for d in items]
    assert all(abs(o - skew_s) < 600 for o in offsets), offsets
    assert rig.device(device)["status"] == "online"
    _zero_loss(rig.converge(agent, f"clock {skew}"))
