"""Retention: old detections, events and health history are deleted; health history is thinned with age;
the dedup records below each sequence space's ``upto`` are compacted.

One named background thread (a ``LeaderLoop``), woken every ``interval_s`` or stopped by the controller's
stop event. Every delete is a small batch in its own short transaction, with a pause in between, so that
the ingest writer (which shares the database, and on SQLite its single write lock) is never held up for
long. Among controller replicas this is the leader's work: a round starts only on the leader, and every
delete transaction is fenced (``Leadership.fence``), so a replica that lost the leadership cannot commit
one after another replica took over.

Compaction: ingest treats every seq up to a space's (a device's incarnation) ``device_seq.upto`` as a
duplicate without reading ``ingested_seq``, so the rows there are no longer needed for dedup and are
deleted once older than ``seq_keep_s`` (recent ones stay for whoever inspects what was stored). The
runs of seqs an agent declared dropped (``dropped_range``, one row per run) at or below ``upto`` go once
older than ``dropped_keep_s``: until then a late arrival of one of them is stored after all; after it,
such a message cannot still be on its way (the agent dropped it), and the space's figures keep the count.

Health downsampling by age (per device): everything younger than ``keep_all_s``; one sample per
``tier1_step_s`` (a minute) up to ``tier1_age_s`` (a day); one per ``tier2_step_s`` (ten minutes) beyond.
The first sample of each step is kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller.db import crud
from controller.db.leader import ALWAYS_LEADER, LeaderLoop, Leadership
from controller.db.tables import Detection, Event, HealthSample, utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    detections_days: float = 30.0
    events_days: float = 90.0
    health_days: float = 30.0
    keep_all_s: float = 3600.0
    tier1_age_s: float = 86400.0
    tier1_step_s: float = 60.0
    tier2_step_s: float = 600.0
    seq_keep_s: float = 86400.0  # dedup records below upto younger than this are kept
    dropped_keep_s: float = 7 * 86400.0  # declared-dropped runs below upto younger than this are kept
    batch: int = 1000
    pause_s: float = 0.02  # between batches: lets the ingest writer in


@dataclass
class RetentionReport:
    detections: int = 0
    events: int = 0
    health_expired: int = 0
    health_thinned: int = 0
    seqs_compacted: int = 0
    skipped: bool = False  # not the leader: nothing done


Fence = Callable[[Session], None]


def _delete(engine: Engine, stmt: sa.Delete, fence: Fence) -> int:
    """One delete in its own transaction, committed only if the fence lets it."""
    with Session(engine) as s:
        n = int(s.connection().execute(stmt).rowcount or 0)
        fence(s)
        s.commit()
    return n


def _delete_older(
    engine: Engine, table: sa.Table, column: str, cutoff: datetime, batch: int, fence: Fence
) -> int:
    ids = sa.select(table.c.id).where(table.c[column] < cutoff).limit(batch).scalar_subquery()
    return _delete(engine, sa.delete(table).where(table.c.id.in_(ids)), fence)


class RetentionService:
    def __init__(
        self,
        engine: Engine,
        policy: RetentionPolicy,
        *,
        interval_s: float,
        stop: threading.Event,
        leadership: Leadership = ALWAYS_LEADER,
    ) -> None:
        self._engine = engine
        self.policy = policy
        self._stop = stop
        self._leadership = leadership
        self.last: RetentionReport | None = None
        # A first pass soon after start, then every interval.
        self._loop = LeaderLoop(
            "controller-retention",
            self._pass,
            interval_s=interval_s,
            first_after_s=min(5.0, interval_s),
            leadership=leadership,
            stop=stop,
            what="retention pass",
            logger=log,
        )

    def start(self) -> None:
        self._loop.start()

    def join(self, timeout: float = 10.0) -> None:
        self._loop.join(timeout)

    def _pass(self) -> None:
        self.last = self.run_once()

    def _going(self) -> bool:
        return not self._stop.is_set() and self._leadership.is_leader()

    def _pause(self) -> bool:
        """Between batches; True when stopping, or when this replica no longer leads."""
        return self._stop.wait(self.policy.pause_s) or not self._leadership.is_leader()

    def _drain(self, table: sa.Table, column: str, cutoff: datetime) -> int:
        total = 0
        while True:
            n = _delete_older(self._engine, table, column, cutoff, self.policy.batch, self._leadership.fence)
            total += n
            if n < self.policy.batch or self._pause():
                return total

    def run_once(self, now: datetime | None = None) -> RetentionReport:
        """One pass; raises ``FencedOut`` when a transaction finds this replica no longer leads (that
        transaction is rolled back)."""
        if not self._leadership.is_leader():
            return RetentionReport(skipped=True)
        now = now or utcnow()
        p = self.policy
        rep = RetentionReport()
        det = Detection.__table__  # type: ignore[attr-defined]
        ev = Event.__table__  # type: ignore[attr-defined]
        hs = HealthSample.__table__  # type: ignore[attr-defined]
        rep.detections = self._drain(det, "captured_at", now - timedelta(days=p.detections_days))
        if self._going():
            rep.events = self._drain(ev, "ts", now - timedelta(days=p.events_days))
        if self._going():
            rep.health_expired = self._drain(hs, "ts", now - timedelta(days=p.health_days))
        if self._going():
            rep.health_thinned = self._thin_health(now)
        if self._going():
            rep.seqs_compacted = self._compact_seqs(now)
        if self._going():
            rep.seqs_compacted += self._compact_dropped(now)
        if rep.detections or rep.events or rep.health_expired or rep.health_thinned or rep.seqs_compacted:
            log.info(
                "retention: deleted %d detections, %d events, %d expired and %d thinned health samples, "
                "%d dedup records below upto",
                rep.detections,
                rep.events,
                rep.health_expired,
                rep.health_thinned,
                rep.seqs_compacted,
            )
        return rep

    def _compact_seqs(self, now: datetime) -> int:
        """Delete ``ingested_seq`` rows at or below their space's ``upto``, older than
        ``seq_keep_s``: in seq order, a batch at a time, up to the first row still too young (rows are
        stored roughly in seq order; one stored later waits for a later pass)."""
        p = self.policy
        t = crud.ingested_seq_table()
        ds = crud.device_seq_table()
        cutoff = now - timedelta(seconds=p.seq_keep_s)
        # upto only grows, and ingest never writes a row at or below it again (but a dropped one, kept
        # here): a value read now stays safe to compact below while ingest goes on.
        with self._engine.connect() as conn:
            spaces = conn.execute(
                sa.select(ds.c.device_id, ds.c.incarnation, ds.c.upto)
                .where(ds.c.upto > 0)
                .order_by(ds.c.device_id, ds.c.incarnation)
            ).all()
        deleted = 0
        for dev, inc, upto in spaces:
            mine = sa.and_(t.c.device_id == dev, t.c.incarnation == inc)
            after = 0
            while self._going():
                q = (
                    sa.select(t.c.seq, t.c.stored_at)
                    .where(mine, t.c.seq > after, t.c.seq <= upto, t.c.dropped.is_(False))
                    .order_by(t.c.seq)
                    .limit(p.batch)
                )
                with self._engine.connect() as conn:
                    rows = conn.execute(q).all()
                doomed: list[int] = []
                for seq, stored_at in rows:
                    if stored_at >= cutoff:
                        break
                    doomed.append(int(seq))
                if doomed:
                    stmt = sa.delete(t).where(
                        mine, t.c.seq.in_(doomed), t.c.dropped.is_(False), t.c.seq <= upto
                    )
                    deleted += _delete(self._engine, stmt, self._leadership.fence)
                if len(doomed) < p.batch:
                    break
                if self._pause():
                    return deleted
                after = doomed[-1]
        return deleted

    def _compact_dropped(self, now: datetime) -> int:
        """Delete the declared-dropped runs at or below their space's ``upto``, declared before
        ``dropped_keep_s``; counts the runs (rows), not their seqs."""
        t = crud.dropped_range_table()
        ds = crud.device_seq_table()
        upto = (
            sa.select(ds.c.upto)
            .where(ds.c.device_id == t.c.device_id, ds.c.incarnation == t.c.incarnation)
            .scalar_subquery()
        )
        cutoff = now - timedelta(seconds=self.policy.dropped_keep_s)
        return _delete(
            self._engine,
            sa.delete(t).where(t.c.declared_at < cutoff, t.c.last <= upto),
            self._leadership.fence,
        )

    def _thin_health(self, now: datetime) -> int:
        p = self.policy
        hs = HealthSample.__table__  # type: ignore[attr-defined]
        keep_all_from = now - timedelta(seconds=p.keep_all_s)
        tier2_before = now - timedelta(seconds=p.tier1_age_s)
        with self._engine.connect() as conn:
            devices = [r[0] for r in conn.execute(sa.select(hs.c.device_id).distinct())]
        deleted = 0
        for dev in devices:
            last_bucket: tuple[int, int] | None = None
            after: tuple[datetime, int] | None = None
            while not self._stop.is_set():
                q = sa.select(hs.c.id, hs.c.ts).where(hs.c.device_id == dev, hs.c.ts < keep_all_from)
                if after is not None:
                    q = q.where(sa.or_(hs.c.ts > after[0], sa.and_(hs.c.ts == after[0], hs.c.id > after[1])))
                q = q.order_by(hs.c.ts, hs.c.id).limit(p.batch * 5)
                with self._engine.connect() as conn:
                    rows = conn.execute(q).all()
                if not rows:
                    break
                doomed: list[int] = []
                for row_id, ts in rows:
                    step = p.tier2_step_s if ts < tier2_before else p.tier1_step_s
                    bucket = (int(step), int(ts.timestamp() // step))
                    if bucket == last_bucket:
                        doomed.append(int(row_id))
                    else:
                        last_bucket = bucket
                after = (rows[-1][1], int(rows[-1][0]))
                for i in range(0, len(doomed), p.batch):
                    chunk = doomed[i : i + p.batch]
                    deleted += _delete(
                        self._engine, sa.delete(hs).where(hs.c.id.in_(chunk)), self._leadership.fence
                    )
                    if self._pause():
                        return deleted
        return deleted
