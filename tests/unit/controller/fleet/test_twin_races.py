"""Two controller replicas on one PostgreSQL, racing each other.

Any replica may serve a device's assignment: versions stay distinct, one version never carries two
contents, and the retained desired state the broker ends with is the database's. A rollout's ticks
and the operator's actions take turns on the rollout's row: a gate is judged once, and when a pause
answers the rollout admits nobody more.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from controller.db import crud
from controller.db.tables import Rollout, RolloutDevice
from fleet_protocol import TopicKind, decode
from fleet_protocol.messages import DesiredState
from tests.support.controller_app import FakeTransport, Published
from tests.support.databases import database_url
from tests.support.fleet_replicas import (
    FAST_GATE,
    Replica,
    add_devices,
    make_replica,
    prepare,
)


@pytest.fixture
def pg_url(tmp_path: Path, models_dir: Path) -> Iterator[str]:
    with database_url("postgresql", tmp_path / "db") as url:
        prepare(url, models_dir)
        yield url


@pytest.fixture
def two(pg_url: str, tmp_path: Path) -> Iterator[list[Replica]]:
    made: list[Replica] = []
    yield made
    for r in made:
        r.engine.dispose()


class Broker:
    """Where the replicas' publishes arrive, in the order they arrive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.arrived: list[Published] = []

    def arrive(self, p: Published) -> None:
        with self._lock:
            self.arrived.append(p)


def transit_s() -> float:
    """How long a message takes to reach the broker: up to a busy link's 20 ms."""
    return random.uniform(0.0, 0.02)


class LinkToBroker(FakeTransport):
    """A replica's connection: each message takes a random few milliseconds to reach the broker.

    ``publish`` returns at once (the message is on its way); ``publish_confirmed`` returns once it
    arrived, as a PUBACK would say.
    """

    def __init__(self, broker: Broker) -> None:
        super().__init__()
        self._broker = broker
        self._in_flight: list[threading.Timer] = []

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        super().publish(topic, payload, qos, retain)
        timer = threading.Timer(transit_s(), self._broker.arrive, (Published(topic, payload, qos, retain),))
        self._in_flight.append(timer)
        timer.start()

    def publish_confirmed(self, topic: str, payload: bytes, qos: int, retain: bool, timeout_s: float) -> bool:
        super().publish(topic, payload, qos, retain)
        time.sleep(transit_s())
        self._broker.arrive(Published(topic, payload, qos, retain))
        return True

    def settle(self) -> None:
        for t in self._in_flight:
            t.join(5)


def test_concurrent_assignments_over_two_replicas_give_one_content_per_version_and_the_broker_the_db(
    pg_url: str, tmp_path: Path, two: list[Replica]
) -> None:
    broker = Broker()
    links = [LinkToBroker(broker), LinkToBroker(broker)]
    two.extend(make_replica(pg_url, tmp_path / "keys", transport=link) for link in links)
    add_devices(two[0].engine, ["d1"])
    asked: dict[int, float] = {}  # version → the threshold its caller set
    errors: list[BaseException] = []
    lock = threading.Lock()

    def change(i: int) -> None:
        threshold = round(0.01 * (i + 1), 2)  # every change differs from every other
        try:
            state = two[i % 2].twin.assign(
                device_id="d1", camera="cam1", model="tiny", version="1", threshold=threshold
            )
            with lock:
                assert state.version not in asked, f"v{state.version} issued twice"
                asked[state.version] = threshold
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    def client(k: int) -> None:
        for i in range(k, 50, 10):
            change(i)

    threads = [threading.Thread(target=client, args=(k,), name=f"api-{k}") for k in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for link in links:
        link.settle()
    assert not errors, errors
    assert len(asked) == 50  # 50 changes, 50 distinct versions

    with Session(two[0].engine) as s:
        dev = crud.get_device(s, device_id="d1")
        assert dev is not None and dev.desired is not None
        stored = DesiredState.model_validate(dev.desired)
    assert stored.version == dev.desired_version == max(asked)
    assert stored.cameras["cam1"].threshold == asked[stored.version]

    topic = two[0].topics.device("d1", TopicKind.TWIN_DESIRED)
    arrived = [p.payload for p in broker.arrived if p.topic == topic]
    states = [m for p in arrived if isinstance(m := decode(TopicKind.TWIN_DESIRED, p), DesiredState)]
    assert len(states) == len(arrived)
    versions = [m.version for m in states]
    assert versions == sorted(versions), versions  # never an older version after a newer one
    payload_of: dict[int, bytes] = {}
    for v, payload, m in zip(versions, arrived, states, strict=True):
        assert payload_of.setdefault(v, payload) == payload, f"v{v} sent with two contents"
        assert m.cameras["cam1"].threshold == asked[v]
    # The retained message (the last to arrive) is the database's state, byte for byte as signed.
    last = states[-1]
    assert last.model_dump(mode="json") == stored.model_dump(mode="json")


# --------------------------------------------------------------------------- rollouts


class Stall:
    """Holds one replica's tick for a while after it read its rollout: the first time it reads
    ``device`` rows (after the rollout, before the commit), the statement waits ``hold_s``."""

    def __init__(self, engine: Engine, hold_s: float = 0.5) -> None:
        self.reached = threading.Event()
        self._hold_s = hold_s
        self._armed = True
        self._engine = engine

    def __enter__(self) -> Stall:
        sa.event.listen(self._engine, "before_cursor_execute", self._maybe_hold)
        return self

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(self._engine, "before_cursor_execute", self._maybe_hold)

    def _maybe_hold(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if self._armed and statement.lstrip().startswith("SELECT") and "FROM device" in statement:
            self._armed = False
            self.reached.set()
            time.sleep(self._hold_s)


def _canary_running(engine: Engine) -> None:
    """The canary (d1) applied what the rollout sent it and runs it."""
    with Session(engine) as s:
        dev = crud.get_device(s, device_id="d1")
        assert dev is not None
        dev.reported_version = dev.desired_version
        dev.reported = {"cameras": {"cam1": {"model": "tiny:1", "state": "running"}}}
        s.add(dev)
        s.commit()


def _started_rollout(url: str, keys: Path, two: list[Replica]) -> None:
    two.extend([make_replica(url, keys), make_replica(url, keys)])
    add_devices(two[0].engine, ["d1", "d2", "d3", "d4"], labels={"site": "a"})
    two[0].rollouts.create(
        name="dep", model="tiny", version="1", selector="site=a", waves=[1, "100%"], gate=FAST_GATE
    )
    two[0].rollouts.tick()  # the canary, d1, is admitted and sent the deployment
    _canary_running(two[0].engine)


def _snapshot(engine: Engine) -> tuple[Rollout, dict[str, str]]:
    with Session(engine) as s:
        ro = s.exec(select(Rollout)).one()
        return ro, {m.device_id: m.state for m in s.exec(select(RolloutDevice)).all()}


def test_two_ticks_on_two_replicas_judge_a_gate_once(
    pg_url: str, tmp_path: Path, two: list[Replica], caplog: pytest.LogCaptureFixture
) -> None:
    _started_rollout(pg_url, tmp_path / "keys", two)
    caplog.set_level(logging.INFO, logger="controller.fleet.rollouts")
    a, b = two
    # Two replicas that both believe they lead (the old leader not yet fenced off) tick at once.
    with Stall(a.engine) as stall:
        ta = threading.Thread(target=a.rollouts.tick, name="tick-a")
        ta.start()
        assert stall.reached.wait(10)
        tb = threading.Thread(target=b.rollouts.tick, name="tick-b")
        tb.start()
        ta.join(30)
        tb.join(30)
    judged = [r.getMessage() for r in caplog.records if "gate passed" in r.getMessage()]
    assert judged == ["rollout 1: wave 1 gate passed"], judged
    ro, members = _snapshot(a.engine)
    assert [g["wave"] for g in ro.gates] == [0] and ro.current_wave == 1
    assert members["d1"] == "active"


def test_a_pause_racing_a_tick_on_another_replica_stops_the_admissions_when_it_answers(
    pg_url: str, tmp_path: Path, two: list[Replica]
) -> None:
    _started_rollout(pg_url, tmp_path / "keys", two)
    a, b = two
    a.rollouts.tick()  # the canary's gate passes: the next tick admits the rest
    ro, members = _snapshot(a.engine)
    assert ro.current_wave == 1 and set(members) == {"d1"}

    with Stall(a.engine) as stall:
        ta = threading.Thread(target=a.rollouts.tick, name="tick-a")
        ta.start()
        assert stall.reached.wait(10)
        b.rollouts.pause("dep")  # the operator, served by the other replica
        _, when_paused = _snapshot(b.engine)
        ta.join(30)
    ro, final = _snapshot(a.engine)
    assert ro.state == "paused"
    # The tick that held the rollout finished first, or saw the pause: nothing admitted after it.
    assert final == when_paused
    a.rollouts.tick()
    assert _snapshot(a.engine)[1] == final
