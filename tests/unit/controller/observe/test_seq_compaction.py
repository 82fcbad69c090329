"""Retention compacts the dedup records below each device's ``upto`` (the declared-dropped runs only
once older than ``dropped_keep_s``), and a seq compacted away is still a duplicate; retention is the
leader's work and fenced."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlmodel import Session

from controller.db.engine import migrate
from controller.db.leader import ALWAYS_LEADER, FencedOut, Leadership
from controller.db.tables import utcnow
from controller.observe.retention import RetentionPolicy, RetentionService
from tests.support.ingest_replicas import Replica, batch, detections_per_seq, dropped, seq_rows, truth
from tests.support.waiting import wait_for

DEV = "compact"
LATER = timedelta(seconds=5)  # "now" for the retention pass: every row is older than seq_keep_s=0


@pytest.fixture
def replica(db_url: str) -> Iterator[Replica]:
    migrate(db_url)
    r = Replica(db_url).start()
    yield r
    r.close()


def retention(
    replica: Replica,
    *,
    keep_s: float = 0.0,
    dropped_keep_s: float = 3600.0,
    leadership: Leadership = ALWAYS_LEADER,
) -> RetentionService:
    return RetentionService(
        replica.engine,
        RetentionPolicy(seq_keep_s=keep_s, dropped_keep_s=dropped_keep_s, batch=7, pause_s=0.0),
        interval_s=3600,
        stop=replica.stop,
        leadership=leadership,
    )


def fill(replica: Replica) -> None:
    """1..39 and 46..60 stored, 40..45 declared dropped (by the event 46), 61 missing, 62..64 stored."""
    for seq in range(1, 40):
        replica.send(DEV, batch(seq))
    replica.send(DEV, dropped(46, 40, 45))
    for seq in [*range(47, 61), 62, 63, 64]:
        replica.send(DEV, batch(seq))
    wait_for(
        lambda: any((a.upto, a.ranges) == (60, [(62, 64)]) for a in replica.acks(DEV)),
        timeout=20,
        what="1..60 and 62..64 acked",
    )


def runs(replica: Replica) -> list[tuple[int, int]]:
    """The device's declared-dropped runs."""
    with replica.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT first, last FROM dropped_range WHERE device_id = :d ORDER BY first"), {"d": DEV}
        ).all()
    return [(int(a), int(b)) for a, b in rows]


def test_rows_below_upto_are_compacted_and_a_compacted_seq_stays_a_duplicate(replica: Replica) -> None:
    fill(replica)
    rep = retention(replica).run_once(now=utcnow() + LATER)
    assert seq_rows(replica.engine, DEV) == dict.fromkeys([62, 63, 64], False)
    assert runs(replica) == [(40, 45)]  # one row for the run, kept: younger than dropped_keep_s
    assert rep.seqs_compacted == 60 - 6

    # A resend of a compacted seq: a duplicate, stored nothing, and the ack still says everything.
    replica.send_and_ack(DEV, batch(10), lambda a: (a.upto, a.ranges) == (60, [(62, 64)]))
    assert detections_per_seq(replica.engine, DEV)[10] == 2
    assert 10 not in seq_rows(replica.engine, DEV)
    # A seq declared dropped that arrives after all: stored, and no longer counted dropped.
    replica.send_and_ack(DEV, batch(42), lambda a: a.upto == 60)
    assert detections_per_seq(replica.engine, DEV)[42] == 2
    assert runs(replica) == [(40, 41), (43, 45)]
    # The gap above upto still closes with the rows above it (never compacted).
    replica.send_and_ack(DEV, batch(61), lambda a: (a.upto, a.ranges) == (64, []))
    row = truth(replica.engine, DEV)
    assert row is not None
    assert (row.upto, row.stored, row.dropped, row.duplicates, row.max_seq) == (64, 59, 5, 1, 64)

    # The next pass compacts what upto passed since (61..64: 42 came below upto, where taking it out of
    # its run is the whole record), not the young runs.
    again = retention(replica).run_once(now=utcnow() + LATER)
    assert again.seqs_compacted == 4
    assert seq_rows(replica.engine, DEV) == {} and runs(replica) == [(40, 41), (43, 45)]

    # Seqs declared dropped that were stored and compacted long ago are not declared again.
    replica.send_and_ack(DEV, dropped(65, 2, 4), lambda a: (a.upto, a.ranges) == (65, []))
    assert seq_rows(replica.engine, DEV) == {65: False} and runs(replica) == [(40, 41), (43, 45)]
    row = truth(replica.engine, DEV)
    assert row is not None and (row.stored, row.dropped, row.max_seq) == (60, 5, 65)

    # Runs below upto older than dropped_keep_s go too (a message dropped that long ago cannot come);
    # the figures stay.
    retention(replica, dropped_keep_s=0.0).run_once(now=utcnow() + LATER)
    assert runs(replica) == []
    row = truth(replica.engine, DEV)
    assert row is not None and (row.stored, row.dropped, row.upto) == (60, 5, 65)


def test_recent_rows_are_kept(replica: Replica) -> None:
    fill(replica)
    before = seq_rows(replica.engine, DEV)
    rep = retention(replica, keep_s=3600).run_once()
    assert rep.seqs_compacted == 0 and seq_rows(replica.engine, DEV) == before


class FencedLeader:
    """A replica that still thinks it leads, while another took over: every fence check fails."""

    replica_id = "old-leader"

    def __init__(self, leading: bool = True) -> None:
        self.leading = leading
        self.fenced = 0

    def is_leader(self) -> bool:
        return self.leading

    def fence(self, session: Session) -> None:
        self.fenced += 1
        raise FencedOut("the leadership epoch moved")


def counts(replica: Replica) -> tuple[int, int]:
    with replica.engine.connect() as conn:
        dets = conn.execute(sa.text("SELECT COUNT(*) FROM detection")).scalar_one()
        seqs = conn.execute(sa.text("SELECT COUNT(*) FROM ingested_seq")).scalar_one()
    return int(dets), int(seqs)


def test_a_fenced_out_leader_deletes_nothing(replica: Replica) -> None:
    old = time.time() - 60 * 86400  # detections past their 30 days
    for seq in range(1, 21):
        replica.send(DEV, batch(seq, captured_at=old))
    wait_for(lambda: any(a.upto == 20 for a in replica.acks(DEV)), timeout=20, what="1..20 acked")
    before = counts(replica)
    assert before == (40, 20)

    fenced = FencedLeader()
    with pytest.raises(FencedOut):
        retention(replica, leadership=fenced).run_once(now=utcnow() + LATER)
    assert fenced.fenced == 1, "stopped at the first fenced transaction"
    assert counts(replica) == before

    follower = FencedLeader(leading=False)
    rep = retention(replica, leadership=follower).run_once(now=utcnow() + LATER)
    assert rep.skipped and follower.fenced == 0 and counts(replica) == before

    # The same pass on the leader deletes both.
    rep = retention(replica).run_once(now=utcnow() + LATER)
    assert (rep.detections, rep.seqs_compacted) == (40, 20) and counts(replica) == (0, 0)
