"""Command results recorded once: the agent sends a result again after a cut, QoS 1
may deliver it twice, and replicas all receive it; the event log keeps one ``command_result`` per
command id and device, marked ``late`` when its request had given up. On SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa
from sqlmodel import Session, col, select

from controller.db.tables import Event, utcnow
from controller.link.commands import CommandError, command_result_event
from controller.runtime import ControllerRuntime
from fleet_protocol import TopicKind, decode
from fleet_protocol.messages import Command, CommandName, CommandResult, Heartbeat
from tests.support.controller_app import Fleet, FleetFactory
from tests.support.waiting import wait_for

DEV = "dev-1"


def runtime_of(fleet: Fleet) -> ControllerRuntime:
    return fleet.client.app.state.runtime  # type: ignore[attr-defined,no-any-return]


def results(fleet: Fleet, device: str = DEV) -> list[dict[str, Any]]:
    with Session(runtime_of(fleet).engine) as s:
        rows = s.exec(
            select(Event).where(col(Event.device_id) == device, col(Event.kind) == "command_result")
        ).all()
    return [r.data for r in rows]


def settle(fleet: Fleet, mark: float) -> None:
    """Wait until everything sent before now is applied: a heartbeat behind it in the same status queue."""
    fleet.send(DEV, TopicKind.HEARTBEAT, Heartbeat(ts=mark, uptime_s=mark, cpu_pct=mark))

    def applied() -> bool:
        return (fleet.device(DEV).get("last_health") or {}).get("cpu_pct") == mark

    wait_for(applied, timeout=20, what=f"heartbeat {mark} applied")


def test_a_result_delivered_again_is_recorded_once(make_fleet: FleetFactory) -> None:
    fleet = make_fleet()
    first = CommandResult(id="c1", ok=True, result={"x": 1})
    # Twice at once (one status batch), then again later (a resend after a cut: another batch).
    fleet.send(DEV, TopicKind.COMMAND_RESULT, first)
    fleet.send(DEV, TopicKind.COMMAND_RESULT, first)
    settle(fleet, 1.0)
    fleet.send(DEV, TopicKind.COMMAND_RESULT, first)
    # Other ids, and the same id from another device, are results of their own.
    fleet.send(DEV, TopicKind.COMMAND_RESULT, CommandResult(id="c2", ok=False, error="busy"))
    fleet.send("dev-2", TopicKind.COMMAND_RESULT, first)
    settle(fleet, 2.0)
    assert sorted(d["id"] for d in results(fleet)) == ["c1", "c2"]
    assert [d["id"] for d in results(fleet, "dev-2")] == ["c1"]
    assert all("late" not in d for d in results(fleet))


def test_a_command_id_with_a_nul_is_recorded_once_and_breaks_no_later_result(
    make_fleet: FleetFactory,
) -> None:
    # PostgreSQL cannot read a JSON "\u0000" as text: stored as sent, it failed every later look-up.
    fleet = make_fleet()
    odd = CommandResult(id="a\x00b", ok=True)
    fleet.send(DEV, TopicKind.COMMAND_RESULT, odd)
    settle(fleet, 1.0)
    fleet.send(DEV, TopicKind.COMMAND_RESULT, odd)
    fleet.send(DEV, TopicKind.COMMAND_RESULT, CommandResult(id="c3", ok=True))
    settle(fleet, 2.0)
    assert sorted(d["id"] for d in results(fleet)) == ["a\ufffdb", "c3"]


def test_a_result_after_its_request_gave_up_is_recorded_late_and_once(make_fleet: FleetFactory) -> None:
    fleet = make_fleet()
    commands = runtime_of(fleet).commands
    with pytest.raises(CommandError) as exc:
        commands.request(DEV, CommandName.DIAGNOSTICS, timeout=0.2)
    assert exc.value.reason == "timeout"
    (published,) = fleet.transport.on_topic(fleet.topics.device(DEV, TopicKind.COMMANDS))
    cmd = decode(TopicKind.COMMANDS, published.payload)
    assert isinstance(cmd, Command)

    late = CommandResult(id=cmd.id, ok=True, result={"device_id": DEV})
    fleet.send(DEV, TopicKind.COMMAND_RESULT, late)
    settle(fleet, 1.0)
    fleet.send(DEV, TopicKind.COMMAND_RESULT, late)  # sent again: still one event, still late
    settle(fleet, 2.0)
    (data,) = results(fleet)
    assert data["id"] == cmd.id and data["late"] is True and data["result"] == {"device_id": DEV}
    assert commands.late == 1

    # A result its request is waiting for is not late.
    answers: list[CommandResult] = []
    asker = threading.Thread(
        target=lambda: answers.append(commands.request(DEV, CommandName.DIAGNOSTICS, timeout=20)), daemon=True
    )
    asker.start()
    sent = wait_for(
        lambda: fleet.transport.on_topic(fleet.topics.device(DEV, TopicKind.COMMANDS))[1:],
        timeout=10,
        what="the second command",
    )
    second = decode(TopicKind.COMMANDS, sent[0].payload)
    assert isinstance(second, Command)
    fleet.send(DEV, TopicKind.COMMAND_RESULT, CommandResult(id=second.id, ok=True))
    asker.join(20)
    assert [a.id for a in answers] == [second.id]
    settle(fleet, 3.0)
    by_id = {d["id"]: d for d in results(fleet)}
    assert set(by_id) == {cmd.id, second.id} and "late" not in by_id[second.id]
    assert commands.late == 1


def _waiting_for_a_result_lock(engine: sa.Engine) -> int:
    """Sessions waiting on the command-result lock (its SQL names it), on this server."""
    with engine.connect() as conn:
        n = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND NOT l.granted "
                "AND a.query LIKE '%edgefleet-command-result%' AND a.query NOT LIKE '%pg_locks%'"
            )
        ).scalar_one()
    return int(n)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_replicas_recording_one_result_at_once_add_one_event(make_fleet: FleetFactory) -> None:
    """Every replica gets every result: the second to look waits for the first, then sees its row."""
    fleet = make_fleet()
    engine = runtime_of(fleet).engine
    msg = CommandResult(id="c-race", ok=True)
    found: list[Event | None] = []

    def replica_b() -> None:
        with Session(engine) as b:
            ev = command_result_event(b, DEV, msg, received_at=utcnow())
            found.append(ev)
            if ev is not None:
                b.add(ev)
            b.commit()

    with Session(engine) as a:
        ev = command_result_event(a, DEV, msg, received_at=utcnow())
        assert ev is not None
        a.add(ev)
        a.flush()  # replica A has added the row, not committed it yet
        t = threading.Thread(target=replica_b, daemon=True)
        t.start()
        wait_for(lambda: _waiting_for_a_result_lock(engine) >= 1, timeout=10, what="replica B waiting for A")
        assert t.is_alive() and found == []
        a.commit()
    t.join(10)
    assert not t.is_alive() and found == [None]
    assert [d["id"] for d in results(fleet)] == ["c-race"]
