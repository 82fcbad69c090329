"""The bridge keeps every handler of a topic kind: all run, each remover removes only its own, and one
outcome is counted per message. The runtime wires command results so that each reaches the command
service and the status service once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlmodel import Session, col, select

from controller.db.tables import Device, Event
from controller.link.bridge import (
    DROPPED_QUEUE_FULL,
    DUPLICATE,
    ERROR,
    INVALID,
    OK,
    UNKNOWN_KIND,
    UNKNOWN_TOPIC,
    MqttBridge,
    combine_outcomes,
)
from controller.runtime import ControllerRuntime
from fleet_protocol import TopicKind, Topics, decode, encode
from fleet_protocol.messages import (
    Availability,
    Command,
    CommandName,
    CommandResult,
    Heartbeat,
    Message,
)
from tests.support.controller_app import FakeTransport, FleetFactory
from tests.support.waiting import wait_for

DEV = "dev-1"


@pytest.fixture
def bridge() -> tuple[MqttBridge, FakeTransport]:
    transport = FakeTransport()
    b = MqttBridge(transport, Topics())
    b.start()
    return b, transport


def _send(transport: FakeTransport, kind: TopicKind, msg: Any) -> None:
    transport.inject(Topics().device(DEV, kind), encode(msg))


class Recorder:
    def __init__(self, name: str, calls: list[str], outcome: str | None = OK) -> None:
        self.name, self.calls, self.outcome = name, calls, outcome

    def __call__(self, device_id: str, msg: Message) -> str | None:
        self.calls.append(self.name)
        return self.outcome


def test_every_handler_of_a_kind_runs_in_order(bridge: tuple[MqttBridge, FakeTransport]) -> None:
    b, transport = bridge
    calls: list[str] = []
    b.on(TopicKind.AVAILABILITY, Recorder("a", calls))
    b.on(TopicKind.AVAILABILITY, Recorder("b", calls, None))
    b.on(TopicKind.HEARTBEAT, Recorder("other kind", calls))
    _send(transport, TopicKind.AVAILABILITY, Availability(state="online"))
    assert calls == ["a", "b"]
    assert b.counters.get("availability", OK) == 1  # one message, counted once


def test_a_remover_removes_only_its_own_registration(bridge: tuple[MqttBridge, FakeTransport]) -> None:
    b, transport = bridge
    calls: list[str] = []
    same = Recorder("same", calls)
    remove_first = b.on(TopicKind.AVAILABILITY, same)
    remove_second = b.on(TopicKind.AVAILABILITY, same)  # the same handler twice: two registrations
    remove_other = b.on(TopicKind.AVAILABILITY, Recorder("other", calls))
    remove_first()
    remove_first()  # idempotent: the second registration of `same` stays
    _send(transport, TopicKind.AVAILABILITY, Availability(state="online"))
    assert calls == ["same", "other"]
    remove_other()
    calls.clear()
    _send(transport, TopicKind.AVAILABILITY, Availability(state="online"))
    assert calls == ["same"]
    remove_second()
    calls.clear()
    _send(transport, TopicKind.AVAILABILITY, Availability(state="online"))
    assert calls == []  # no handler left: an unexpected topic again, as if none had been added
    assert b.counters.get("availability", UNKNOWN_TOPIC) == 1
    assert b.counters.get(UNKNOWN_KIND, UNKNOWN_TOPIC) == 0


@pytest.mark.parametrize(
    ("outcomes", "counted"),
    [
        ([OK, None], OK),
        ([None, OK], OK),
        ([None, None], None),  # every handler left it to a worker: nothing counted now
        ([OK, DUPLICATE], DUPLICATE),
        ([DUPLICATE, OK], DUPLICATE),
        ([OK, DROPPED_QUEUE_FULL], DROPPED_QUEUE_FULL),  # stored by one, dropped by the other
        ([DROPPED_QUEUE_FULL, INVALID], DROPPED_QUEUE_FULL),  # equally bad: the first
        ([INVALID, DROPPED_QUEUE_FULL, OK], INVALID),
    ],
)
def test_one_combined_outcome_is_counted(
    bridge: tuple[MqttBridge, FakeTransport], outcomes: list[str | None], counted: str | None
) -> None:
    b, transport = bridge
    calls: list[str] = []
    for i, outcome in enumerate(outcomes):
        b.on(TopicKind.HEARTBEAT, Recorder(str(i), calls, outcome))
    _send(transport, TopicKind.HEARTBEAT, Heartbeat(ts=1.0, uptime_s=1.0))
    assert len(calls) == len(outcomes)
    counts = b.counters.snapshot().get("heartbeat", {})
    assert counts == ({counted: 1} if counted else {})


def test_a_failing_handler_does_not_stop_the_others(bridge: tuple[MqttBridge, FakeTransport]) -> None:
    b, transport = bridge
    calls: list[str] = []

    def broken(device_id: str, msg: Message) -> str | None:
        raise RuntimeError("boom")

    b.on(TopicKind.AVAILABILITY, broken)
    b.on(TopicKind.AVAILABILITY, Recorder("after", calls))
    _send(transport, TopicKind.AVAILABILITY, Availability(state="online"))
    assert calls == ["after"]
    assert b.counters.snapshot()["availability"] == {ERROR: 1}


def test_combine_outcomes_ranks_failures_over_success() -> None:
    assert combine_outcomes(None, None) is None
    assert combine_outcomes(OK, "store_failed") == "store_failed"
    assert combine_outcomes("store_failed", ERROR) == ERROR
    assert combine_outcomes(ERROR, DROPPED_QUEUE_FULL) == ERROR


def test_handlers_may_be_added_while_messages_flow(bridge: tuple[MqttBridge, FakeTransport]) -> None:
    b, transport = bridge
    stop = threading.Event()
    calls: list[str] = []

    def flood() -> None:
        while not stop.is_set():
            _send(transport, TopicKind.AVAILABILITY, Availability(state="online"))

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        removers = [b.on(TopicKind.AVAILABILITY, Recorder(str(i), calls)) for i in range(50)]
        for remove in removers:
            remove()
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive()
    counts = b.counters.snapshot()["availability"]
    assert ERROR not in counts and counts.get(UNKNOWN_TOPIC, 0) + counts.get(OK, 0) > 0


# --------------------------------------------------------------------------- the runtime's wiring


def test_a_command_result_reaches_commands_and_status_once(make_fleet: FleetFactory) -> None:
    fleet = make_fleet()
    runtime: ControllerRuntime = fleet.client.app.state.runtime  # type: ignore[attr-defined]
    answers: list[CommandResult] = []
    asker = threading.Thread(
        target=lambda: answers.append(
            runtime.commands.request(DEV, CommandName.SNAPSHOT, {"camera": "cam1"}, timeout=20)
        ),
        daemon=True,
    )
    asker.start()
    topic = fleet.topics.device(DEV, TopicKind.COMMANDS)
    published = wait_for(lambda: fleet.transport.on_topic(topic), timeout=10, what="the snapshot command")
    command = decode(TopicKind.COMMANDS, published[0].payload)
    assert isinstance(command, Command)
    jpeg = "QUJDREVG"  # base64 of 6 bytes
    fleet.send(
        DEV, TopicKind.COMMAND_RESULT, CommandResult(id=command.id, ok=True, result={"jpeg_base64": jpeg})
    )
    asker.join(20)
    # The command service got the whole result, picture included.
    assert [a.result for a in answers] == [{"jpeg_base64": jpeg}]
    # A later message through the same status queue: once it is applied, the result is too.
    fleet.send(DEV, TopicKind.HEARTBEAT, Heartbeat(ts=1.0, uptime_s=1.0, cpu_pct=42.0))

    def heartbeat_applied() -> bool:
        with Session(runtime.engine) as s:
            dev = s.get(Device, DEV)
            return dev is not None and (dev.last_health or {}).get("cpu_pct") == 42.0

    wait_for(heartbeat_applied, timeout=20, what="the heartbeat after the result applied")
    with Session(runtime.engine) as s:
        events = s.exec(
            select(Event).where(col(Event.device_id) == DEV, col(Event.kind) == "command_result")
        ).all()
    assert len(events) == 1, [e.data for e in events]
    logged = events[0].data["result"]
    assert "jpeg_base64" not in logged and logged["jpeg_bytes"] == 6  # the size, not the picture
    assert runtime.bridge.counters.snapshot()[TopicKind.COMMAND_RESULT.value] == {OK: 1}
