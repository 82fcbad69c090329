"""Detections and events: bounded queue → one batch writer thread → dedup, store, ack.

paho's thread decodes and validates (the bridge), the writer stores whole batches in one transaction
and acks after the commit. The two overlap: the writer's database time is spent in SQLite's C code
with the GIL released, while paho's thread decodes the next messages.

The truth is in the database, not in this process: controller replicas share a device's messages
round-robin (MQTT ``$share``), so no process sees all of them. A device's seqs are numbered per
incarnation (PROTOCOL.md "Incarnations"; '' for the legacy space of an older agent): dedup, acks and
counters are per (device, incarnation), a space. Each transaction locks the batch's devices'
``device_seq`` rows (in (device, incarnation) order), treats every seq up to a space's ``upto`` as a
duplicate, claims the rest in ``ingested_seq``, and counts what it stored, found twice or saw declared
dropped. The row also keeps the runs of seqs above ``upto`` that are stored or declared dropped
(``above``, whoever stored them): the commit merges its own seqs into them, moves ``upto`` over a run
that reaches it, and reads no ``ingested_seq`` row to do so. The ack it publishes after the commit is
built from that, so it is right whichever replica stored which seq; and a start reads no history.

Drop policy: when the queue is full, or one device already holds its share of it, the newest message
is dropped and counted. That is safe because the agent keeps every message in its outbox until an
``Ack`` covers it, and sends it again.

What one device can make this writer store is bounded: a new incarnation only after a birth named it
(a few per hour, ``crud.admit_incarnations``), a dropped range declared by an ``outbox_dropped`` event
only where the space has not covered it yet, below the report's own seq, and as one ``dropped_range``
row per run however long; at most ``gaps_max`` gaps above a space's ``upto`` (so the runs a commit
carries stay few, whatever seqs a device picks); the controller's own event kinds are refused from
devices.
"""

from __future__ import annotations

import gc
import logging
import math
import queue
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import chain
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller.db import crud
from controller.db.crud import SeqRow, Space, space_of
from controller.db.engine import db_json, db_text, session_scope
from controller.db.tables import (
    CONTROLLER_EVENT_KINDS,
    SOURCE_DEVICE,
    Detection,
    Event,
    UtcDateTime,
    utcnow,
)
from controller.link.batching import FairQueue, take_batch
from controller.link.bridge import (
    DROPPED_DEVICE_SHARE,
    DROPPED_QUEUE_FULL,
    DUPLICATE,
    INVALID,
    OK,
    STORE_FAILED,
    MqttBridge,
    RateLimitedLog,
)
from controller.link.budget import QueueShares
from controller.link.seqtrack import MAX_ACK_RANGES, NO_STATS, IntervalSet, SeqStats, advance
from fleet_protocol import TopicKind
from fleet_protocol.messages import Ack, DetectionBatch, EventKind, Message
from fleet_protocol.messages import Event as EventMsg

log = logging.getLogger(__name__)

MAX_DB_INT = 2**63 - 1
_INSERT_CHUNK = 5000
# Outcomes of this service, besides the bridge's.
# In an incarnation no birth started (or one over the per-hour cap): not stored, not acked.
UNKNOWN_INCARNATION = "unknown_incarnation"
# A seq that would open one more gap above its space's upto than ``gaps_max``: not stored, not acked
# (an agent sends it again once the gaps before it have filled).
GAPS_FULL = "gaps_full"
# Newest incarnations listed per device in its view (the figures count them all).
RECENT_INCARNATIONS = 10
# Rows in one multi-row detection INSERT (15 parameters each, within the database's limit).
_MULTI_ROWS_MAX = 1000

# The dedup claim on PostgreSQL: every new (device, incarnation, seq) of a commit as arrays.
_CLAIM_PG = sa.text(
    "INSERT INTO ingested_seq (device_id, incarnation, seq, kind, stored_at, dropped) "
    "SELECT v.device_id, v.incarnation, v.seq, v.kind, :stored_at, false FROM unnest("
    "CAST(:device_id AS varchar[]), CAST(:incarnation AS varchar[]), CAST(:seq AS bigint[]), "
    "CAST(:kind AS varchar[])) AS v(device_id, incarnation, seq, kind) "
    "ON CONFLICT DO NOTHING RETURNING device_id, incarnation, seq"
).bindparams(sa.bindparam("stored_at", type_=UtcDateTime()))

IngestMsg = DetectionBatch | EventMsg
# Detection columns in the order of the rows the writer builds.
_DET_COLUMNS = (
    "device_id",
    "seq",
    "camera",
    "frame",
    "captured_at",
    "stored_at",
    "model",
    "label",
    "class_id",
    "score",
    "x0",
    "y0",
    "x1",
    "y1",
    "track_id",
)
_DET_TIME_COLUMNS = ("captured_at", "stored_at")


@dataclass(frozen=True)
class StoredBatch:
    """What one ingest commit stored: handed to ``on_stored`` (live view, metrics) after the commit."""

    messages: list[tuple[str, IngestMsg]]  # (device id, message) stored for the first time
    stored_at: datetime
    write_s: float  # seconds spent writing the batch to the database


StoredCallback = Callable[[StoredBatch], None]


@dataclass(slots=True)
class _Item:
    device_id: str
    msg: IngestMsg
    received_at: float  # unix seconds

    @property
    def space(self) -> Space:
        return space_of(self.device_id, self.msg.incarnation)

    @property
    def kind(self) -> str:
        return TopicKind.DETECTIONS.value if isinstance(self.msg, DetectionBatch) else TopicKind.EVENTS.value


@dataclass
class _DeviceResult:
    stored: list[_Item] = field(default_factory=list)
    converted: set[int] = field(default_factory=set)  # stored seqs that had been declared dropped
    duplicates: list[_Item] = field(default_factory=list)
    declared: int = 0  # seqs newly declared dropped
    refused: list[tuple[_Item, str]] = field(default_factory=list)  # not stored, with the outcome
    ack: Ack | None = None  # built inside the transaction, published after its commit


def sane(msg: IngestMsg) -> str | None:
    """Why ``msg`` cannot be stored as-is (values the database columns cannot hold), or None."""
    if msg.seq > MAX_DB_INT:
        return f"seq {msg.seq} is too large"
    if isinstance(msg, DetectionBatch):
        for fr in msg.frames:
            if fr.frame > MAX_DB_INT:
                return f"frame {fr.frame} is too large"
            for d in fr.detections:
                if d.class_id > MAX_DB_INT:
                    return f"class_id {d.class_id} is too large"
                # Once per detection on the hot path: the schema already refuses non-finite boxes
                # (allow_inf_nan=False) and scores (bounds); this guards against a schema change.
                box = d.box
                if not math.isfinite(d.score + box.x0 + box.y0 + box.x1 + box.y1):
                    return "non-finite score or box"
    return None


def _ts(unix_s: float, fallback: float) -> datetime:
    try:
        return datetime.fromtimestamp(unix_s, UTC)
    except (OverflowError, OSError, ValueError):
        return datetime.fromtimestamp(fallback, UTC)


def _same(v: datetime) -> Any:
    return v


class _DetectionInsert:
    """The detection INSERT in the driver's own SQL, for rows built as tuples.

    SQLAlchemy Core runs each column's bind processor on every row; for detections only the two
    timestamps have one, and they repeat (one per frame, one per commit), so the writer converts each
    distinct timestamp once and hands the driver plain tuples. When any other column of the table gets
    a bind processor, ``usable`` is False and the writer goes back to the Core insert.

    On SQLite rows go in as multi-row ``VALUES`` statements of fixed sizes (few distinct statements, so
    the driver's statement cache keeps them prepared): one statement step for many rows, where
    ``executemany`` steps, and hands the GIL back and forth, once per row. On PostgreSQL psycopg's
    pipelined ``executemany`` is cheaper (measured: multi-row statements cost the controller 50 % more
    CPU per row there).
    """

    def __init__(self, dialect: sa.engine.Dialect, *, max_params: int) -> None:
        table: sa.Table = Detection.__table__  # type: ignore[attr-defined]
        processors = {
            name: table.c[name].type.dialect_impl(dialect).bind_processor(dialect) for name in _DET_COLUMNS
        }
        self.captured_to_db: Callable[[datetime], Any] = processors["captured_at"] or _same
        self.stored_to_db: Callable[[datetime], Any] = processors["stored_at"] or _same
        # SQLAlchemy's own statement up to VALUES (the table and columns, quoted as the dialect wants),
        # then positional parameters in the driver's style.
        compiled = sa.insert(table).compile(dialect=dialect, column_keys=list(_DET_COLUMNS))
        head, sep, _ = str(compiled).partition(" VALUES ")
        mark = {"qmark": "?", "format": "%s", "pyformat": "%s"}.get(dialect.paramstyle)
        group = "(" + ", ".join([mark or "?"] * len(_DET_COLUMNS)) + ")"
        self.sql = f"{head} VALUES {group}"
        # A Float column's processor (SQLite: to_float) returns a float unchanged, and the validated
        # message's floats are floats; any other processor means the driver needs converted values.
        self.usable = (
            mark is not None
            and bool(sep)
            and head.endswith("(" + ", ".join(_DET_COLUMNS) + ")")
            and all(
                p is None or isinstance(table.c[n].type, sa.Float)
                for n, p in processors.items()
                if n not in _DET_TIME_COLUMNS
            )
        )
        # Statement per row count, largest first: the rows of a batch are split greedily over them.
        largest = min(_MULTI_ROWS_MAX, max_params // len(_DET_COLUMNS)) if mark == "?" else 0
        self.multi = [
            (n, f"{head} VALUES " + ", ".join([group] * n))
            for n in (largest, largest // 10, largest // 100)
            if n > 1
        ]

        self.copy_sql: str | None = None  # PostgreSQL + psycopg: binary COPY (see use_copy)
        self._copy_types: list[int] = []

    def use_copy(self, s: Session) -> None:
        """On PostgreSQL through psycopg, insert with ``COPY ... (FORMAT BINARY)``: one stream of rows
        with no SQL text to build or parse per batch and no per-parameter adaptation, the client-side
        cost of a multi-row INSERT. Binary COPY needs each column's exact type: read from the
        catalogue, so it follows the table whatever the migrations made of it."""
        driver = s.connection().connection.driver_connection
        if not self.usable or s.get_bind().dialect.name != "postgresql" or not hasattr(driver, "pgconn"):
            return
        table: sa.Table = Detection.__table__  # type: ignore[attr-defined]
        oids = {
            str(name): int(oid)
            for name, oid in s.connection().execute(
                sa.text(
                    "SELECT attname, atttypid FROM pg_attribute "
                    "WHERE attrelid = CAST(:t AS regclass) AND attnum > 0 AND NOT attisdropped"
                ),
                {"t": table.name},
            )
        }
        if not set(_DET_COLUMNS) <= oids.keys():
            return
        prep = s.get_bind().dialect.identifier_preparer
        cols = ", ".join(prep.quote(c) for c in _DET_COLUMNS)
        self._copy_types = [oids[c] for c in _DET_COLUMNS]
        self.copy_sql = f"COPY {prep.format_table(table)} ({cols}) FROM STDIN (FORMAT BINARY)"

    def execute(self, s: Session, rows: list[tuple[Any, ...]]) -> None:
        if not rows:
            return
        conn = s.connection()
        if self.copy_sql is not None:
            driver: Any = conn.connection.driver_connection
            with driver.cursor() as cur, cur.copy(self.copy_sql) as cp:
                cp.set_types(self._copy_types)
                for r in rows:
                    cp.write_row(r)
            return
        start = 0
        for n, sql in self.multi:
            while len(rows) - start >= n:
                conn.exec_driver_sql(sql, tuple(chain.from_iterable(rows[start : start + n])))
                start += n
        if start < len(rows):
            conn.exec_driver_sql(self.sql, rows[start:])  # type: ignore[arg-type]


def declared_range(msg: EventMsg) -> tuple[int, int] | None:
    """The ``first..last`` an OUTBOX_DROPPED event declares, when it is well-formed: the space's own
    figures decide how much of it is taken (``IngestService``)."""
    if msg.kind != EventKind.OUTBOX_DROPPED:
        return None
    first, last = msg.data.get("first"), msg.data.get("last")
    if (
        not isinstance(first, int)
        or not isinstance(last, int)
        or isinstance(first, bool)
        or isinstance(last, bool)
    ):
        return None
    # The dropped messages were allocated before this event, from the same sequence.
    if not (1 <= first <= last < msg.seq):
        return None
    return first, last


def merge_runs(*runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-adjacent runs covering every run given."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(chain.from_iterable(runs)):
        if out and a <= out[-1][1] + 1:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def uncovered(first: int, last: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``first..last`` outside ``covered`` (sorted, disjoint runs)."""
    out: list[tuple[int, int]] = []
    at = first
    for a, b in covered:
        if b < at:
            continue
        if a > last:
            break
        if a > at:
            out.append((at, a - 1))
        at = max(at, b + 1)
        if at > last:
            return out
    if at <= last:
        out.append((at, last))
    return out


def _max_params(s: Session) -> int:
    """How many parameters one statement may carry on this database."""
    driver = s.connection().connection.driver_connection
    if isinstance(driver, sqlite3.Connection):
        return int(driver.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    if s.get_bind().dialect.name == "postgresql":
        return 65_535  # the wire protocol counts a statement's parameters in 16 bits
    return 999  # SQLite's historical limit: small, and safe on anything


# Objects allocated between young collections. CPython's default (700) promotes every decoded batch
# in flight (~140 objects per message, hundreds of messages per commit) to the old generation, and the
# full collections that follow walk the whole controller heap: measured, they cost more CPU than
# decoding, validating and storing together. Young garbage is then collected 30x less often (a few MB
# more at most); reference counting still frees everything that is not a cycle at once.
GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> None:
    """Raise the collector's young-generation threshold (process-wide; never lowers it)."""
    young, middle, old = gc.get_threshold()
    if young < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)
        log.info("gc young threshold %d -> %d", young, GC_YOUNG_THRESHOLD)


# Above this many devices the stats of a listing are read for every device at once, not by id.
_STATS_BY_ID_MAX = 500


def seq_stats(row: SeqRow | None) -> SeqStats:
    """One space's figures."""
    if row is None:
        return NO_STATS
    return SeqStats.of(
        upto=row.upto,
        max_seq=row.max_seq,
        stored=row.stored,
        dropped=row.dropped,
        duplicates=row.duplicates,
        incarnation=row.incarnation or None,
        started_at=row.started_at,
    )


def device_stats(rows: list[SeqRow], totals: crud.SpaceTotals | None = None) -> SeqStats:
    """A device's figures over its spaces (``rows`` oldest first), each space's among them; with
    ``totals``, ``rows`` are only its newest spaces and the counts are the totals'."""
    listed = SeqStats.total([seq_stats(r) for r in rows])
    if totals is None or not rows:
        return listed
    return SeqStats(
        stored=totals.stored,
        duplicates=totals.duplicates,
        dropped=totals.dropped,
        lost=totals.lost,
        acked_upto=listed.acked_upto,
        max_seq=listed.max_seq,
        incarnation=listed.incarnation,
        started_at=listed.started_at,
        incarnations=listed.incarnations,
        spaces=totals.spaces,
    )


class IngestService:
    """Owns the ingest queue and its writer thread; a device's dedup, acks and counters are rows."""

    def __init__(
        self,
        engine: Engine,
        bridge: MqttBridge,
        *,
        queue_max: int,
        batch_max: int,
        stop: threading.Event,
        on_stored: StoredCallback | None = None,
        linger_s: float = 0.0,
        device_queue_max: int | None = None,
        incarnations_per_hour: int = 6,
        gaps_max: int = 256,
    ) -> None:
        """``linger_s``: how long a commit waits for more messages after the first (batching.py);
        ``device_queue_max``: the most messages of one device in the queue at once (None: a tenth of
        the queue, at least the batch size); ``incarnations_per_hour``: new incarnations a device may
        start in an hour (each one only after its birth); ``gaps_max``: the most gaps a space may hold
        above its ``upto`` (each run of covered seqs above it stands after one)."""
        self._engine = engine
        self._shares = QueueShares(device_queue_max or max(batch_max, queue_max // 10))
        self._incarnations_per_hour = incarnations_per_hour
        self._gaps_max = min(gaps_max, MAX_ACK_RANGES)
        self._bad = RateLimitedLog(log)
        # Spaces whose device and device_seq rows this writer has seen exist (the writer thread's own).
        self._known_spaces: set[Space] = set()
        self._linger_s = linger_s
        self._bridge = bridge
        # Called on the ingest thread after each commit; it must not block (it only enqueues).
        self._on_stored = on_stored
        self._batch_max = batch_max
        self._queue: FairQueue[_Item] = FairQueue(queue_max, key=lambda item: item.device_id)
        self._stop = stop
        self._thread: threading.Thread | None = None
        self._det_insert: _DetectionInsert | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        tune_gc()
        self._thread = threading.Thread(target=self._run, name="controller-ingest", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("ingest worker did not stop within %.1fs", timeout)

    # ---------------------------------------------------------------- API-facing

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def stats(self, device_id: str) -> SeqStats:
        """One device's figures as committed, by every replica."""
        with Session(self._engine) as s:
            return self.stats_many(s, [device_id])[device_id]

    @staticmethod
    def stats_many(session: Session, device_ids: list[str]) -> dict[str, SeqStats]:
        """Many devices' figures in two queries (a device that never sent anything has zeros); each
        lists its ``RECENT_INCARNATIONS`` newest spaces, and counts them all."""
        rows, totals = crud.recent_device_seqs(
            session,
            device_ids=device_ids if len(device_ids) <= _STATS_BY_ID_MAX else None,
            recent=RECENT_INCARNATIONS,
        )
        return {d: device_stats(rows.get(d, []), totals.get(d)) for d in device_ids}

    # ---------------------------------------------------------------- bridge handler (paho thread)

    def submit(self, device_id: str, msg: Message) -> str | None:
        if not isinstance(msg, DetectionBatch | EventMsg):
            return INVALID
        why = sane(msg)
        if why is None and isinstance(msg, EventMsg) and msg.kind.value in CONTROLLER_EVENT_KINDS:
            why = f"event kind {msg.kind.value!r} is the controller's own"
        if why is not None:
            self._bad.warning(f"invalid:{device_id}", "dropping message from %s: %s", device_id, why)
            return INVALID
        if not self._shares.take(device_id):
            return DROPPED_DEVICE_SHARE
        try:
            self._queue.put_nowait(_Item(device_id, msg, time.time()))
        except queue.Full:
            self._shares.give_back([device_id])
            return DROPPED_QUEUE_FULL
        return None  # counted by the worker once stored (ok) or found duplicate

    # ---------------------------------------------------------------- worker

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = take_batch(self._queue, first, max_items=self._batch_max, linger_s=self._linger_s)
            self._shares.give_back([item.device_id for item in batch])
            try:
                self._process(batch)
            except Exception:
                # Not acked, so the agents send these again; the worker must survive.
                log.exception("ingest batch of %d failed", len(batch))

    def _process(self, batch: list[_Item]) -> None:
        t0 = time.perf_counter()
        try:
            results = self._store(batch)
        except Exception as exc:
            log.warning("ingest batch of %d failed (%s); storing one by one", len(batch), exc)
            results = {}
            for item in batch:
                try:
                    for space, res in self._store([item]).items():
                        merged = results.setdefault(space, _DeviceResult())
                        merged.stored += res.stored
                        merged.converted |= res.converted
                        merged.duplicates += res.duplicates
                        merged.declared += res.declared
                        merged.refused += res.refused
                        merged.ack = res.ack or merged.ack  # the later commit knows more
                except Exception:
                    self._bridge.counters.add(item.kind, STORE_FAILED)
                    log.exception(
                        "could not store %s seq %d from %s", item.kind, item.msg.seq, item.device_id
                    )
        write_s = time.perf_counter() - t0
        self._after_commit(results)
        if self._on_stored is not None:
            stored = [(dev, item.msg) for (dev, _), res in results.items() for item in res.stored]
            try:
                self._on_stored(StoredBatch(messages=stored, stored_at=utcnow(), write_s=write_s))
            except Exception:
                log.exception("on_stored callback failed")

    def _store(self, batch: list[_Item]) -> dict[Space, _DeviceResult]:
        by_space: dict[Space, dict[int, _Item]] = defaultdict(dict)
        results: dict[Space, _DeviceResult] = defaultdict(_DeviceResult)
        for item in batch:
            space = item.space
            seen = by_space[space]
            if item.msg.seq in seen:
                results[space].duplicates.append(item)
            else:
                seen[item.msg.seq] = item
        now = utcnow()
        with session_scope(self._engine) as s:
            truth = self._lock_truth(s, set(by_space), now)
            for space in [sp for sp in by_space if sp not in truth]:
                # No birth started this space (or the device is over its new incarnations for the hour).
                res = results[space]
                res.refused += [
                    (it, UNKNOWN_INCARNATION) for it in (*by_space.pop(space).values(), *res.duplicates)
                ]
                res.duplicates = []
                self._bad.warning(
                    f"{UNKNOWN_INCARNATION}:{space[0]}",
                    "%s sends in incarnation %s, which no birth started: not stored (it sends again)",
                    space[0],
                    space[1],
                )
            for space, items in by_space.items():
                self._admit(truth[space], items, results[space])
            claimed = self._claim(s, by_space, truth, now)
            det_rows: list[tuple[Any, ...]] = []
            det_insert = self._detection_insert(s)
            declarations: list[tuple[Space, tuple[int, int]]] = []
            covered: dict[Space, list[tuple[int, int]]] = {}
            for space, items in by_space.items():
                res = results[space]
                row = truth[space]
                # Only a space with seqs declared dropped (and not arrived since) can have one revived.
                self._sort_device(s, space, items, claimed, res, revive=row.dropped > 0)
                declarations += self._rows_device(s, space, res, now, det_rows, det_insert)
                # Duplicates above upto count too: they were stored before, so they are covered.
                seqs = [it.msg.seq for it in (*res.stored, *res.duplicates) if it.msg.seq > row.upto]
                covered[space] = merge_runs(row.above, [(q, q) for q in seqs])
            for space, rng in declarations:
                row = truth[space]
                new = self._declare_dropped(
                    s, space, rng, now, upto=row.upto, covered=covered[space], gaps_max=self._gaps_max
                )
                results[space].declared += sum(b - a + 1 for a, b in new)
                covered[space] = merge_runs(covered[space], new)
            for space in by_space:
                self._account(truth[space], results[space], covered[space])
            crud.save_device_seqs(s, rows=[truth[space] for space in by_space])
            # One INSERT for the detections of every device in the batch.
            if det_insert.usable:
                det_insert.execute(s, det_rows)
            else:
                table = Detection.__table__  # type: ignore[attr-defined]
                for i in range(0, len(det_rows), _INSERT_CHUNK):
                    chunk = [dict(zip(_DET_COLUMNS, r, strict=True)) for r in det_rows[i : i + _INSERT_CHUNK]]
                    s.execute(sa.insert(table), chunk)
        self._known_spaces |= set(by_space)
        return dict(results)

    def _lock_truth(self, s: Session, spaces: set[Space], now: datetime) -> dict[Space, SeqRow]:
        """The ``device_seq`` rows of the batch's devices (every space of theirs), locked until the
        commit; the legacy spaces among ``spaces`` created if new, and the incarnations this
        controller saw a birth name (within the per-hour cap: ``crud.admit_incarnations``). Any
        other space is missing from the answer: no birth started it.

        A space created here is new to the fleet (the insert happens once, whichever replica tries):
        a new incarnation becomes its device's current one, with a ``device_reset`` event when the
        device had sent in another space before.

        On SQLite the driver opens the transaction at the first write, so the read may come before it;
        it still sees the rows as the commit will find them: SQLite serves one controller process, with
        one ingest writer, the only one that writes these rows.
        """
        # Created before the rows are locked, in (device, incarnation) order, as every writer does:
        # inserting after locking could wait on another replica's insert while it waits on our lock.
        new = spaces - self._known_spaces
        startable = {
            sp for sp in new if sp[1] == crud.LEGACY or self._bridge.birth_incarnation(sp[0]) == sp[1]
        }
        if startable:
            _, refused = crud.admit_incarnations(
                s, spaces=sorted(startable), now=now, per_hour=self._incarnations_per_hour
            )
            for device_id, incarnation in refused:
                self._bad.warning(
                    f"incarnations:{device_id}",
                    "%s started more than %d incarnations in an hour: %s refused",
                    device_id,
                    self._incarnations_per_hour,
                    incarnation,
                )
        truth = crud.lock_device_seqs(s, device_ids={d for d, _ in spaces})
        # One deleted behind this writer's back (by hand: the controller never deletes them) is
        # created again by the next batch that may start it.
        self._known_spaces -= spaces - truth.keys()
        return truth

    def _admit(self, row: SeqRow, items: dict[int, _Item], res: _DeviceResult) -> None:
        """Take out of ``items`` (into ``res.refused``) the seqs that would leave the space more than
        ``gaps_max`` gaps above its ``upto``: the highest of them.

        The runs above ``upto`` are what every commit of the space carries (``DeviceSeq.above``) and
        what its acks list, so their number bounds the cost of a device's commits, whatever it sends.
        An agent's seqs rise by one, and a gap opens only where a message was lost on the way: a
        device with hundreds of gaps at once is not losing messages but choosing its seqs. What is
        refused here is not acked, so an agent sends it again after the gaps before it have filled.
        """
        fresh = sorted(q for q in items if q > row.upto)
        if not fresh or len(fresh) + len(row.above) <= self._gaps_max:
            return  # even each seq in a run of its own stays within the bound
        have = IntervalSet()
        have.add_range(0, row.upto)  # one run for everything up to upto: the runs past it are the gaps
        for a, b in row.above:
            have.add_range(a, b)
        refused: set[int] = set()
        # Lowest first: what is nearest upto fills the gaps that hold the rest back.
        for q in fresh:
            if q in have or q - 1 in have or q + 1 in have or have.runs - 1 < self._gaps_max:
                have.add(q)
            else:
                refused.add(q)
        if not refused:
            return
        for q in sorted(refused):
            res.refused.append((items.pop(q), GAPS_FULL))
        keep = []
        for it in res.duplicates:
            if it.msg.seq in refused:
                res.refused.append((it, GAPS_FULL))
            else:
                keep.append(it)
        res.duplicates = keep
        self._bad.warning(
            f"{GAPS_FULL}:{row.device_id}",
            "%s (incarnation %s) sent seqs that would leave more than %d gaps above %d: %d not stored "
            "(it sends them again)",
            row.device_id,
            row.incarnation or "legacy",
            self._gaps_max,
            row.upto,
            len(refused),
        )

    @staticmethod
    def _claim(
        s: Session, by_space: dict[Space, dict[int, _Item]], truth: dict[Space, SeqRow], now: datetime
    ) -> set[tuple[Space, int]]:
        """Insert the dedup record of every ``(device, incarnation, seq)`` above its space's ``upto``;
        returns those that were new.

        The primary key (device, incarnation, seq) is the dedup: a seq stored before (by this writer or any other)
        is not returned, and is then either a declared-dropped seq that arrived after all, or a duplicate.
        A seq up to ``upto`` is not even tried: its row may have been compacted away.
        """
        new = [
            (space, q, item.kind)
            for space, items in by_space.items()
            for q, item in items.items()
            if q > truth[space].upto
        ]
        if not new:
            return set()
        if s.get_bind().dialect.name == "postgresql":
            # One statement over arrays (the SQL text never changes, so it stays prepared), not a
            # multi-row VALUES rebuilt for every count.
            params = {
                "device_id": [sp[0] for sp, _, _ in new],
                "incarnation": [sp[1] for sp, _, _ in new],
                "seq": [q for _, q, _ in new],
                "kind": [k for _, _, k in new],
                "stored_at": now,
            }
            got = s.connection().execute(_CLAIM_PG, params).all()
        else:
            rows = [
                {
                    "device_id": sp[0],
                    "incarnation": sp[1],
                    "seq": q,
                    "kind": k,
                    "stored_at": now,
                    "dropped": False,
                }
                for sp, q, k in new
            ]
            t = crud.ingested_seq_table()
            ins = (
                crud.dialect_insert(s, t)
                .on_conflict_do_nothing()
                .returning(t.c.device_id, t.c.incarnation, t.c.seq)
            )
            got = s.execute(ins, rows).all()
        return {((str(d), str(i)), int(q)) for d, i, q in got}

    @staticmethod
    def _sort_device(
        s: Session,
        space: Space,
        items: dict[int, _Item],
        claimed: set[tuple[Space, int]],
        res: _DeviceResult,
        *,
        revive: bool,
    ) -> None:
        """Split one space's messages into stored (new, or declared dropped before) and duplicates."""
        stored = [q for q in items if (space, q) in claimed]
        seen_before = [q for q in items if (space, q) not in claimed]
        # A declared run is disjoint from the stored seqs: a claimed seq may lie inside one (an arrival
        # above upto), an unclaimed one only below upto, where its record may be compacted.
        revived = crud.take_dropped(s, space=space, seqs=items) if revive else set()
        res.converted |= revived
        stored += [q for q in seen_before if q in revived]
        res.duplicates += [items[q] for q in sorted(seen_before) if q not in revived]
        res.stored += [items[q] for q in sorted(stored)]

    def _detection_insert(self, s: Session) -> _DetectionInsert:
        if self._det_insert is None:
            self._det_insert = _DetectionInsert(s.get_bind().dialect, max_params=_max_params(s))
            self._det_insert.use_copy(s)
            if not self._det_insert.usable:
                log.warning("detection columns need per-row conversion; using the slower Core insert")
        return self._det_insert

    def _rows_device(
        self,
        s: Session,
        space: Space,
        res: _DeviceResult,
        now: datetime,
        det_rows: list[tuple[Any, ...]],
        det_insert: _DetectionInsert,
    ) -> list[tuple[Space, tuple[int, int]]]:
        """Append the stored detections' rows to ``det_rows``; add the stored events to the session;
        returns the dropped ranges the stored events declare."""
        declared: list[tuple[Space, tuple[int, int]]] = []
        device_id = space[0]
        usable = det_insert.usable
        # Timestamps in the driver's form, converted once per commit and once per frame, not per row.
        stored_db = det_insert.stored_to_db(now) if usable else now
        captured_to_db = det_insert.captured_to_db if usable else _same
        append = det_rows.append
        for item in res.stored:
            msg = item.msg
            if isinstance(msg, DetectionBatch):
                seq = msg.seq
                for fr in msg.frames:
                    captured = captured_to_db(_ts(fr.captured_at, item.received_at))
                    camera, model, frame = db_text(fr.camera), db_text(fr.model), fr.frame
                    for d in fr.detections:
                        box = d.box
                        append(
                            (
                                device_id,
                                seq,
                                camera,
                                frame,
                                captured,
                                stored_db,
                                model,
                                db_text(d.label),
                                d.class_id,
                                d.score,
                                box.x0,
                                box.y0,
                                box.x1,
                                box.y1,
                                d.track_id,
                            )
                        )
            else:
                s.add(
                    Event(
                        device_id=device_id,
                        seq=msg.seq,
                        ts=_ts(msg.ts, item.received_at),
                        kind=msg.kind.value,
                        severity=msg.severity.value,
                        camera=db_text(msg.camera),
                        message=db_text(msg.message) or "",
                        data=db_json(msg.data),
                        stored_at=now,
                        source=SOURCE_DEVICE,
                    )
                )
                rng = declared_range(msg)
                if rng is not None:
                    declared.append((space, rng))
        return declared

    @staticmethod
    def _declare_dropped(
        s: Session,
        space: Space,
        rng: tuple[int, int],
        now: datetime,
        *,
        upto: int,
        covered: list[tuple[int, int]],
        gaps_max: int,
    ) -> list[tuple[int, int]]:
        """Record the parts of ``rng`` not covered yet, one row per run; returns them.

        Only what the space has not covered is taken: every seq up to ``upto`` is (its record may be
        compacted), and so is every run in ``covered`` (stored, or declared before). A declaration that
        would leave more than ``gaps_max`` runs above ``upto`` is not taken (the event is stored)."""
        first, last = max(rng[0], upto + 1), rng[1]
        if first > last:
            return []
        new = uncovered(first, last, covered)
        after = merge_runs(covered, new)
        if len(after) - (1 if after and after[0][0] == upto + 1 else 0) > gaps_max:
            log.warning(
                "%s (incarnation %s) declared seqs %d..%d dropped: not taken, it would leave more than "
                "%d gaps above %d",
                space[0],
                space[1] or "legacy",
                first,
                last,
                gaps_max,
                upto,
            )
            return []
        crud.add_dropped_ranges(s, space=space, runs=new, now=now)
        if new:
            log.warning(
                "%s (incarnation %s) declared %d seqs dropped from its outbox (%d..%d)",
                space[0],
                space[1] or "legacy",
                sum(b - a + 1 for a, b in new),
                first,
                last,
            )
        return new

    @staticmethod
    def _account(row: SeqRow, res: _DeviceResult, islands: list[tuple[int, int]]) -> None:
        """Count the space's batch on its row, move ``upto`` and build the ack (inside the transaction):
        it names the space's incarnation, so an agent that started another meanwhile ignores it."""
        row.stored += len(res.stored)
        row.dropped += res.declared - len(res.converted)
        row.duplicates += len(res.duplicates)
        upto, ranges = advance(row.upto, islands)
        row.above = [r for r in islands if r[0] > upto]
        row.upto = upto
        row.max_seq = max(row.max_seq, islands[-1][1] if islands else upto)
        res.ack = Ack(incarnation=row.incarnation or None, upto=upto, ranges=ranges)

    def _after_commit(self, results: dict[Space, _DeviceResult]) -> None:
        # This process's own outcome counters (the fleet's are the device_seq rows).
        counters = self._bridge.counters
        for res in results.values():
            for item in res.stored:
                counters.add(item.kind, OK)
            for item in res.duplicates:
                counters.add(item.kind, DUPLICATE)
            for item, outcome in res.refused:
                counters.add(item.kind, outcome)
        # Acked after commit, and also for duplicates: a resend means the agent missed our last ack.
        for (device_id, _), res in results.items():
            ack = res.ack
            if ack is None:
                continue
            try:
                self._bridge.publish_message(device_id, TopicKind.ACKS, ack)
            except Exception:
                log.exception("could not publish ack to %s", device_id)
