"""Ingest's truth is in the database: two controller replicas (two ``IngestService`` writers on one
PostgreSQL) sharing one device's messages round-robin ack everything, store each seq once and report
the fleet's figures; a restarted writer acks from the database without reading the history; the API's
figures are the database's, whichever process stored the messages."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlmodel import Session

from controller.db import crud
from controller.db.engine import make_engine, migrate
from controller.link.seqtrack import MAX_ACK_RANGES
from fleet_protocol import TopicKind
from tests.support.controller_app import Fleet, FleetFactory
from tests.support.ingest_replicas import (
    DETS,
    Replica,
    batch,
    covered,
    detections_per_seq,
    dropped,
    seq_rows,
    truth,
)
from tests.support.waiting import wait_for

postgres_only = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)


@pytest.fixture
def replicas(db_url: str) -> Iterator[list[Replica]]:
    migrate(db_url)
    pair = [Replica(db_url, batch_max=20), Replica(db_url, batch_max=20)]
    for r in pair:
        r.start()
    yield pair
    for r in pair:
        r.close()


@postgres_only
@pytest.mark.parametrize("split", ["round_robin", "random"])
def test_two_replicas_sharing_devices_ack_everything_and_store_each_seq_once(
    replicas: list[Replica], split: str, caplog: pytest.LogCaptureFixture
) -> None:
    # More seqs than one ack can list as ranges: a replica that acked only what it stored itself would
    # leave the newest seqs unacked for ever (an ack of one replica's odd seqs is 1 range per seq).
    n = 2 * MAX_ACK_RANGES + 200
    devices = ["rr-a", "rr-b", "rr-c"]  # batches hold several devices: their rows lock in one order
    rng = random.Random(13)
    twice: dict[str, int] = dict.fromkeys(devices, 0)
    with caplog.at_level(logging.WARNING, logger="controller.link.ingest"):
        for seq in range(1, n + 1):
            for i, dev in enumerate(devices):
                if split == "round_robin":
                    replicas[(seq + i) % 2].send(dev, batch(seq))
                else:
                    pick = rng.random()
                    if pick < 0.05:  # a redelivery that reaches both replicas
                        replicas[0].send(dev, batch(seq))
                        replicas[1].send(dev, batch(seq))
                        twice[dev] += 1
                    else:
                        replicas[pick < 0.5].send(dev, batch(seq))

        everything = set(range(1, n + 1))

        def all_acked() -> bool:
            return all(covered(replicas[0].acks(d) + replicas[1].acks(d)) == everything for d in devices)

        wait_for(all_acked, timeout=120, what=f"the union of both replicas' acks covers 1..{n}", interval=0.2)
    assert "storing one by one" not in caplog.text, "a batch failed (a deadlock between replicas?)"

    engine = replicas[0].engine
    for dev in devices:
        both = replicas[0].acks(dev) + replicas[1].acks(dev)
        # The last commit saw every seq, whichever replica stored it: its ack says everything.
        assert max(a.upto for a in both) == n
        for r in replicas:
            ups = [a.upto for a in r.acks(dev)]
            assert ups == sorted(ups), "a replica's acks never go back"
        rows = seq_rows(engine, dev)
        assert sorted(rows) == list(range(1, n + 1)) and not any(rows.values())
        per_seq = detections_per_seq(engine, dev)
        assert per_seq == dict.fromkeys(range(1, n + 1), DETS), "every batch stored exactly once"
        row = truth(engine, dev)
        assert row is not None
        assert (row.upto, row.max_seq, row.stored, row.dropped) == (n, n, n, 0)
        assert row.duplicates == twice[dev]
        stats = replicas[1].ingest.stats(dev)
        assert (stats.stored, stats.lost, stats.duplicates, stats.acked_upto) == (n, 0, twice[dev], n)

    # An agent resending an old seq to either replica gets an ack that covers everything.
    for r in replicas:
        ack = r.send_and_ack(devices[0], batch(5), lambda a: True)
        assert (ack.upto, ack.ranges) == (n, [])
    row = truth(engine, devices[0])
    assert row is not None and row.duplicates == twice[devices[0]] + 2


@postgres_only
def test_an_ack_lists_what_other_replicas_stored_above_a_gap(replicas: list[Replica]) -> None:
    a, b = replicas
    dev = "gap"
    for seq in (1, 2, 4, 5):
        a.send_and_ack(dev, batch(seq), lambda ack: True)
    b.send_and_ack(dev, batch(7), lambda ack: (ack.upto, ack.ranges) == (2, [(4, 5), (7, 7)]))
    b.send_and_ack(dev, batch(3), lambda ack: (ack.upto, ack.ranges) == (5, [(7, 7)]))
    a.send_and_ack(dev, batch(6), lambda ack: (ack.upto, ack.ranges) == (7, []))
    stats = a.ingest.stats(dev)
    assert (stats.stored, stats.lost, stats.max_seq, stats.acked_upto) == (7, 0, 7, 7)


def test_a_restarted_writer_acks_from_the_database_without_reading_the_history(db_url: str) -> None:
    migrate(db_url)
    dev = "restart"
    first = Replica(db_url).start()
    try:
        for seq in [*range(1, 21), *range(22, 31)]:  # 21 is still on its way
            first.send(dev, batch(seq))
        first.send(dev, dropped(33, 31, 32))
        wait_for(lambda: covered(first.acks(dev)) == set(range(1, 34)) - {21}, timeout=20, what="stored")
    finally:
        first.close()

    second = Replica(db_url)
    statements: list[str] = []
    sa.event.listen(second.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    second.start()
    try:
        assert statements == [], "the start read nothing from the database"
        second.send_and_ack(dev, batch(21), lambda a: (a.upto, a.ranges) == (33, []))
        second.send_and_ack(dev, batch(10), lambda a: a.upto == 33)  # stored before the restart
        second.send_and_ack(dev, batch(32), lambda a: a.upto == 33)  # declared dropped, arrives after all
        second.send_and_ack(dev, batch(34), lambda a: (a.upto, a.ranges) == (34, []))
        rows = seq_rows(second.engine, dev)
        # 32 came below upto: taken out of its declared run, which is all the record it needs there.
        assert sorted(rows) == [q for q in range(1, 35) if q not in (31, 32)] and not any(rows.values())
        with second.engine.connect() as conn:
            runs = conn.execute(
                sa.text("SELECT first, last FROM dropped_range WHERE device_id = :d"), {"d": dev}
            )
            assert [tuple(r) for r in runs] == [(31, 31)]
        assert sorted(detections_per_seq(second.engine, dev)) == [
            q for q in range(1, 35) if q not in (31, 33)
        ]
        stats = second.ingest.stats(dev)
        # stored: 1..30, the event 33, 32 (arrived after all) and 34; dropped: 31 only.
        assert (stats.stored, stats.dropped, stats.duplicates, stats.lost) == (33, 1, 1, 0)
    finally:
        second.close()


def test_the_api_reports_the_fleet_figures_whoever_stored_them(make_fleet: FleetFactory, db_url: str) -> None:
    fleet: Fleet = make_fleet()  # started first: nothing it could have read at its start
    other = Replica(db_url).start()  # another controller's ingest on the same database
    try:
        for seq in range(1, 11):
            other.send("api-a", batch(seq))
        wait_for(lambda: any(a.upto == 10 for a in other.acks("api-a")), timeout=20, what="1..10 stored")
        other.send_and_ack("api-a", batch(4), lambda a: a.upto == 10)  # a duplicate
        other.send_and_ack("api-b", dropped(3, 1, 2), lambda a: a.upto == 3)
    finally:
        other.close()
    fleet.send("api-a", TopicKind.DETECTIONS, batch(11))
    fleet.wait_ack("api-a", lambda a: (a.upto, a.ranges) == (11, []), "the API's own controller acks 1..11")

    stats = fleet.device("api-a")["stats"]
    spaces = stats.pop("incarnations")
    assert stats == {
        "stored": 11,
        "duplicates": 1,
        "lost": 0,
        "dropped": 0,
        "acked_upto": 11,
        "max_seq": 11,
        "incarnation_count": 1,
    }
    # One space: the legacy one of an agent that names no incarnation.
    assert [(x["incarnation"], x["started_at"] is not None, x["stored"]) for x in spaces] == [
        (None, True, 11)
    ]
    r = fleet.client.get("/api/v1/devices")
    assert r.status_code == 200, r.text
    listed = {d["id"]: d["stats"] for d in r.json()}
    assert listed["api-a"] == stats | {"incarnations": spaces}
    assert (listed["api-b"]["stored"], listed["api-b"]["dropped"], listed["api-b"]["acked_upto"]) == (1, 2, 3)
    body = fleet.client.get("/api/v1/stats/ingest").json()
    assert body["fleet"] == {
        "devices": 2,
        "incarnations": 2,
        "stored": 12,
        "duplicates": 1,
        "dropped": 2,
        "lost": 0,
        "acked": 14,
    }
    # This process's own outcome counters still say what it handled itself: one batch.
    assert body["counters"]["detections"] == {"ok": 1}


def test_the_migration_fills_device_seq_from_the_history(db_url: str) -> None:
    history = {  # device: (stored seqs, declared dropped seqs, duplicates counted on the device row)
        "m-a": ([1, 2, 3, 5, 6], [4], 10),
        "m-b": ([2, 3], [], 3),
        "m-c": ([1], [2, 3], 0),
    }
    engine = make_engine(db_url)
    try:
        migrate(db_url, engine=engine, revision="0007")
        with engine.begin() as conn:
            for dev, (seqs, drops, dups) in history.items():
                conn.execute(
                    sa.text(
                        "INSERT INTO device (id, labels, enrolled, status, desired_version, duplicates, "
                        "created_at) VALUES (:d, '{}', false, 'offline', 0, :dups, CURRENT_TIMESTAMP)"
                    ),
                    {"d": dev, "dups": dups},
                )
                conn.execute(
                    sa.text(
                        "INSERT INTO ingested_seq (device_id, seq, kind, stored_at, dropped) "
                        "VALUES (:d, :q, 'detections', CURRENT_TIMESTAMP, :x)"
                    ),
                    [{"d": dev, "q": q, "x": False} for q in seqs]
                    + [{"d": dev, "q": q, "x": True} for q in drops],
                )
        migrate(db_url, engine=engine)
        with Session(engine) as s:
            got = {
                (d, r.incarnation): (r.upto, r.max_seq, r.stored, r.dropped, r.duplicates)
                for d, rows in crud.device_seqs(s).items()
                for r in rows
            }
        # Every row there was is the legacy space ('') after 0010.
        assert got == {
            ("m-a", ""): (6, 6, 5, 1, 10),  # 4 was declared dropped: covered
            ("m-b", ""): (0, 3, 2, 0, 3),  # seq 1 never came: upto acks nothing
            ("m-c", ""): (3, 3, 1, 2, 0),
        }
    finally:
        engine.dispose()


def test_many_devices_figures_are_read_at_once_and_match_one_by_one(db_url: str) -> None:
    migrate(db_url)
    r = Replica(db_url).start()
    try:
        for dev in ("many-a", "many-b"):
            for seq in (1, 2, 4):
                r.send(dev, batch(seq))

        def both_stored() -> bool:
            return all(any(a.ranges == [(4, 4)] for a in r.acks(d)) for d in ("many-a", "many-b"))

        wait_for(both_stored, timeout=20, what="1, 2 and 4 stored for both devices")
        ids = ["many-a", *(f"never-{i}" for i in range(600)), "many-b"]  # more than are looked up by id
        with Session(r.engine) as s:
            many = r.ingest.stats_many(s, ids)
            few = r.ingest.stats_many(s, ["many-b", "never-1"])
        assert list(many) == ids
        assert many["many-a"] == many["many-b"] == few["many-b"] == r.ingest.stats("many-a")
        assert (many["many-a"].stored, many["many-a"].lost, many["many-a"].acked_upto) == (3, 1, 2)
        assert many["never-7"] == few["never-1"] and few["never-1"].max_seq == 0
    finally:
        r.close()
