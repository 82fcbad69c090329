"""Incarnations: a device's seqs are numbered per outbox (PROTOCOL.md "Incarnations"). Two incarnations
with overlapping seqs are both stored whole, each acked in its own space; a new incarnation is
recorded once as the device's current one, with one ``device_reset`` event, whoever sees it first (a
batch on one replica or another, or the birth); retention compacts each space below its own ``upto``."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from alembic import command
from sqlmodel import Session, col, select

from controller.db import crud
from controller.db.engine import alembic_config, make_engine, migrate
from controller.db.tables import Device, Event, utcnow
from controller.observe.retention import RetentionPolicy, RetentionService
from fleet_protocol import TopicKind, encode
from fleet_protocol.messages import Ack, Availability, DetectionBatch
from fleet_protocol.messages import Event as EventMsg
from tests.support.controller_app import Fleet
from tests.support.ingest_replicas import TOPICS, Replica, batch, dropped, truth
from tests.support.waiting import wait_for

postgres_only = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)


def new_incarnation() -> str:
    return uuid.uuid4().hex


def of(inc: str | None, msg: DetectionBatch | EventMsg) -> DetectionBatch | EventMsg:
    return msg.model_copy(update={"incarnation": inc})


def seqs_by_space(replica: Replica, device: str) -> dict[str, list[int]]:
    t = crud.ingested_seq_table()
    with replica.engine.connect() as conn:
        rows = conn.execute(
            sa.select(t.c.incarnation, t.c.seq)
            .where(t.c.device_id == device, t.c.dropped.is_(False))
            .order_by(t.c.incarnation, t.c.seq)
        ).all()
    out: dict[str, list[int]] = {}
    for inc, q in rows:
        out.setdefault(str(inc), []).append(int(q))
    return out


def resets(replica: Replica, device: str) -> list[dict[str, object]]:
    with Session(replica.engine) as s:
        rows = s.exec(
            select(Event)
            .where(col(Event.device_id) == device, col(Event.kind) == "device_reset")
            .order_by(col(Event.id))
        ).all()
    return [dict(r.data) for r in rows]


def current(replica: Replica, device: str) -> tuple[str | None, bool]:
    with Session(replica.engine) as s:
        dev = s.get(Device, device)
        assert dev is not None
        return dev.incarnation, dev.incarnation_started_at is not None


def born(replica: Replica, device: str, inc: str) -> None:
    """The device's birth naming ``inc``, as this replica's bridge sees it: ingest starts an
    incarnation only after a birth named it (the status service, absent here, would store the rest)."""
    replica.bridge.on(TopicKind.AVAILABILITY, lambda _d, _m: None)
    replica.bridge.handle_message(
        TOPICS.device(device, TopicKind.AVAILABILITY),
        encode(Availability(state="online", ts=time.time(), incarnation=inc)),
    )


def send_until(
    replica: Replica, device: str, msg: DetectionBatch | EventMsg, check: Callable[[Ack], bool]
) -> None:
    """Send ``msg``, then wait for an ack that passes ``check`` (the acks of earlier sends may come
    after it: one writer commits what it has queued in any grouping)."""
    replica.send(device, msg)
    wait_for(lambda: any(check(k) for k in replica.acks(device)), timeout=20, what=f"ack after {msg}")


@pytest.fixture
def replica(db_url: str) -> Iterator[Replica]:
    migrate(db_url)
    r = Replica(db_url).start()
    yield r
    r.close()


def test_a_reset_device_is_stored_whole_in_both_spaces_and_acked_per_space(replica: Replica) -> None:
    dev, a, b = "reflashed", new_incarnation(), new_incarnation()
    # An agent older than incarnations (legacy space), then upgraded with a fresh outbox (a), then
    # reflashed (b): each starts at seq 1 again.
    for q in range(1, 6):
        replica.send(dev, batch(q))
    send_until(replica, dev, batch(5), lambda k: (k.incarnation, k.upto) == (None, 5))
    born(replica, dev, a)
    for q in range(1, 9):
        replica.send(dev, of(a, batch(q)))
    wait_for(
        lambda: any((k.incarnation, k.upto) == (a, 8) for k in replica.acks(dev)), timeout=20, what="a 1..8"
    )
    born(replica, dev, b)
    for q in range(1, 4):
        replica.send(dev, of(b, batch(q)))
    send_until(replica, dev, of(b, dropped(5, 4, 4)), lambda k: (k.incarnation, k.upto) == (b, 5))

    assert seqs_by_space(replica, dev) == {"": [1, 2, 3, 4, 5], a: list(range(1, 9)), b: [1, 2, 3, 5]}
    # Nothing of a new space was a duplicate (only the one legacy resend was).
    rows = {x: truth(replica.engine, dev, x) for x in (None, a, b)}
    figures = {x: (r.upto, r.stored, r.duplicates, r.dropped) for x, r in rows.items() if r is not None}
    assert figures == {None: (5, 5, 1, 0), a: (8, 8, 0, 0), b: (5, 4, 0, 1)}
    # Every ack names the space of the batch it answers.
    assert {k.incarnation for k in replica.acks(dev)} == {None, a, b}

    assert current(replica, dev) == (b, True)
    assert resets(replica, dev) == [{"previous": None, "incarnation": a}, {"previous": a, "incarnation": b}]
    stats = replica.ingest.stats(dev)
    assert (stats.stored, stats.duplicates, stats.lost, stats.dropped) == (17, 1, 0, 1)
    assert (stats.incarnation, stats.acked_upto, stats.max_seq) == (b, 5, 5)
    assert [x.incarnation for x in stats.incarnations] == [None, a, b]


def test_a_gap_in_one_space_is_lost_there_only(replica: Replica) -> None:
    dev, a, b = "gappy", new_incarnation(), new_incarnation()
    born(replica, dev, a)
    for q in (1, 2, 4):
        replica.send(dev, of(a, batch(q)))
    send_until(replica, dev, of(a, batch(5)), lambda k: (k.upto, k.ranges) == (2, [(4, 5)]))
    # The new space's seqs 1..3 do not fill the old space's hole at 3.
    born(replica, dev, b)
    for q in (1, 2):
        replica.send(dev, of(b, batch(q)))
    send_until(replica, dev, of(b, batch(3)), lambda k: (k.incarnation, k.upto, k.ranges) == (b, 3, []))
    stats = replica.ingest.stats(dev)
    assert [(x.incarnation, x.lost) for x in stats.incarnations] == [(a, 1), (b, 0)]
    assert stats.lost == 1
    # The first incarnation a device shows is no reset: nothing came before it.
    assert resets(replica, dev) == [{"previous": a, "incarnation": b}]


def test_a_late_batch_of_an_older_incarnation_goes_to_its_own_space(replica: Replica) -> None:
    dev, a, b = "late", new_incarnation(), new_incarnation()
    born(replica, dev, a)
    send_until(replica, dev, of(a, batch(1)), lambda k: k.incarnation == a)
    born(replica, dev, b)
    send_until(replica, dev, of(b, batch(1)), lambda k: k.incarnation == b)
    send_until(replica, dev, of(a, batch(2)), lambda k: (k.incarnation, k.upto) == (a, 2))
    assert seqs_by_space(replica, dev) == {a: [1, 2], b: [1]}
    # Still b's device: an older space that speaks again is no new reset.
    assert current(replica, dev) == (b, True)
    assert len(resets(replica, dev)) == 1


@postgres_only
def test_replicas_racing_on_a_new_incarnation_record_one_reset(db_url: str) -> None:
    migrate(db_url)
    pair = [Replica(db_url, batch_max=5).start(), Replica(db_url, batch_max=5).start()]
    try:
        dev, a = "raced", new_incarnation()
        send_until(pair[0], dev, batch(1), lambda k: k.upto == 1)
        for round_ in range(5):
            b = new_incarnation()
            for r in pair:
                born(r, dev, b)
            start = threading.Barrier(2)

            def send(r: Replica, seqs: range, inc: str = b, start: threading.Barrier = start) -> None:
                start.wait()
                for q in seqs:
                    r.send(dev, of(inc, batch(q)))

            threads = [
                threading.Thread(target=send, args=(pair[0], range(1, 21, 2))),
                threading.Thread(target=send, args=(pair[1], range(2, 21, 2))),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wait_for(
                lambda inc=b: (row := truth(pair[0].engine, dev, inc)) is not None and row.upto == 20,
                timeout=20,
                what=f"round {round_}: 1..20 of the new incarnation acked",
            )
            a = b
        found = resets(pair[0], dev)
        assert len(found) == 5, found
        assert current(pair[0], dev)[0] == a
    finally:
        for r in pair:
            r.close()


def test_the_birth_records_a_new_incarnation_once_and_the_device_view_shows_it(fleet: Fleet) -> None:
    dev, a, b = "born", new_incarnation(), new_incarnation()
    fleet.send(dev, TopicKind.AVAILABILITY, Availability(state="online", ts=time.time(), incarnation=a))
    view = wait_for(
        lambda: (d := fleet.device_or_none(dev)) and d["incarnation"] == a and d, timeout=10, what="a"
    )
    assert view["incarnation_started_at"] is not None
    fleet.send(dev, TopicKind.DETECTIONS, of(a, batch(1)))
    fleet.wait_ack(dev, lambda k: (k.incarnation, k.upto) == (a, 1), "a's seq 1 acked")
    # Reflashed: the birth tells first, then the batches (and the birth again, retained or not).
    fleet.send(dev, TopicKind.AVAILABILITY, Availability(state="online", ts=time.time(), incarnation=b))
    wait_for(lambda: fleet.device(dev)["incarnation"] == b, timeout=10, what="b current")
    fleet.send(dev, TopicKind.DETECTIONS, of(b, batch(1)))
    fleet.wait_ack(dev, lambda k: (k.incarnation, k.upto) == (b, 1), "b's seq 1 acked")
    fleet.send(dev, TopicKind.AVAILABILITY, Availability(state="online", ts=time.time(), incarnation=b))
    r = fleet.client.get("/api/v1/events", params={"device": dev, "kind": "device_reset"})
    assert r.status_code == 200, r.text
    assert [e["data"] for e in r.json()] == [{"previous": a, "incarnation": b}]
    stats = fleet.device(dev)["stats"]
    assert [(x["incarnation"], x["stored"], x["duplicates"]) for x in stats["incarnations"]] == [
        (a, 1, 0),
        (b, 1, 0),
    ]


def test_retention_compacts_each_space_below_its_own_upto(replica: Replica) -> None:
    dev, a = "compacted", new_incarnation()
    for q in range(1, 11):
        replica.send(dev, batch(q))
    born(replica, dev, a)
    for q in (1, 2, 3, 5):
        replica.send(dev, of(a, batch(q)))
    wait_for(
        lambda: any((k.incarnation, k.upto, k.ranges) == (a, 3, [(5, 5)]) for k in replica.acks(dev)),
        timeout=20,
        what="a: 1..3 and 5",
    )
    retention = RetentionService(
        replica.engine,
        RetentionPolicy(seq_keep_s=0.0, batch=4, pause_s=0.0),
        interval_s=3600,
        stop=replica.stop,
    )
    rep = retention.run_once(now=utcnow() + timedelta(seconds=5))
    assert rep.seqs_compacted == 10 + 3
    assert seqs_by_space(replica, dev) == {a: [5]}
    # A compacted seq of either space is still a duplicate; the other space's same seq is not touched.
    send_until(replica, dev, batch(2), lambda k: (k.incarnation, k.upto) == (None, 10))
    send_until(replica, dev, of(a, batch(4)), lambda k: (k.incarnation, k.upto, k.ranges) == (a, 5, []))
    legacy, mine = truth(replica.engine, dev), truth(replica.engine, dev, a)
    assert legacy is not None and mine is not None
    assert (legacy.stored, legacy.duplicates, mine.stored, mine.duplicates) == (10, 1, 5, 0)


def test_the_migration_keeps_the_history_as_the_legacy_space_and_downgrades(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate(db_url, engine=engine, revision="0009")
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO device (id, labels, enrolled, status, desired_version, duplicates, "
                    "created_at) VALUES ('old', '{}', false, 'offline', 0, 0, CURRENT_TIMESTAMP)"
                )
            )
            conn.execute(
                sa.text(
                    "INSERT INTO ingested_seq (device_id, seq, kind, stored_at, dropped) "
                    "VALUES ('old', :q, 'detections', CURRENT_TIMESTAMP, false)"
                ),
                [{"q": q} for q in (1, 2, 3)],
            )
            conn.execute(
                sa.text(
                    "INSERT INTO device_seq (device_id, upto, max_seq, stored, dropped, duplicates) "
                    "VALUES ('old', 3, 3, 3, 0, 0)"
                )
            )
        migrate(db_url, engine=engine)
    finally:
        engine.dispose()
    replica = Replica(db_url).start()
    try:
        legacy = truth(replica.engine, "old")
        assert legacy is not None and (legacy.incarnation, legacy.started_at, legacy.upto) == ("", None, 3)
        # The legacy space goes on where it was; a new incarnation starts at 1 beside it.
        a = new_incarnation()
        send_until(replica, "old", batch(3), lambda k: (k.incarnation, k.upto) == (None, 3))
        born(replica, "old", a)
        send_until(replica, "old", of(a, batch(1)), lambda k: (k.incarnation, k.upto) == (a, 1))
        assert seqs_by_space(replica, "old") == {"": [1, 2, 3], a: [1]}
        assert resets(replica, "old") == [{"previous": None, "incarnation": a}]
    finally:
        replica.close()

    # Down again: one space per device, the legacy one (the others' dedup records go), and up once more.
    engine = make_engine(db_url)
    try:
        cfg = alembic_config(db_url)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0009")
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT device_id, seq FROM ingested_seq ORDER BY seq")).all()
        assert [tuple(r) for r in rows] == [("old", 1), ("old", 2), ("old", 3)]
        migrate(db_url, engine=engine)
    finally:
        engine.dispose()
