"""The on-disk outbox: every detection batch and event stays here until the controller acks it.

SQLite in WAL mode with ``synchronous=FULL``: a commit is on disk when ``append`` returns, so a
power cut loses nothing that was handed to the outbox. The next sequence number lives in the same
database and is bumped in the same transaction as the row it numbers, so seqs stay monotonic across
restarts without gaps. See PROTOCOL.md, "Sequence numbers, outbox, acks".

The outbox's incarnation (PROTOCOL.md "Incarnations") names its seq space: a uuid4 made in the
transaction that creates the database, so a wiped data folder (a reflash, a new disk) starts a new space
at seq 1 instead of repeating seqs the controller holds. An outbox created before incarnations existed
keeps none (the legacy space) until its database is created again: its seqs continue where they were,
and a seq is never in two spaces.

Command results are kept in the same database, outside the seq numbering (a result has no seq), until
the broker acknowledges them: see :mod:`edge_agent.control.commands`.

A disk that refuses a write (full, read-only, failing) raises :class:`StorageError` from the write
methods, with the whole transaction rolled back: nothing is half-written and no seq is consumed. Sent
marks and acks it refused are remembered in memory (so a full disk does not make every unacked row due
again and again) and written with the next write that succeeds.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fleet_protocol.messages import Ack

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    payload BLOB NOT NULL,
    created_at REAL NOT NULL,
    sent_at REAL,
    attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS outbox_sent ON outbox (sent_at);
-- The span each OUTBOX_DROPPED report still in the outbox declares: if the bound drops the report
-- itself, its span goes back to the pending span, to be declared by the next report.
CREATE TABLE IF NOT EXISTS drop_reports (seq INTEGER PRIMARY KEY, first INTEGER NOT NULL, last INTEGER NOT NULL);
-- Command results until the broker has them (they carry no seq, so no ack covers them); ``n`` orders
-- them oldest first. ``slim``: the result without its picture, what the bound keeps of a snapshot.
CREATE TABLE IF NOT EXISTS command_results (
    n INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    payload BLOB NOT NULL,
    slim BLOB,
    created_at REAL NOT NULL
);
"""
# Written only with the schema of a database created now (``meta`` holds integers only).
_IDENTITY = "CREATE TABLE IF NOT EXISTS identity (key TEXT PRIMARY KEY, value TEXT NOT NULL);"


# SQLite hands Python a result code, never the errno behind a refused write: the errno each code of a
# disk that takes no writes stands for. A read-only folder is named so whatever code SQLite chose.
_STORAGE_CODES = {
    "SQLITE_FULL": errno.ENOSPC,
    "SQLITE_READONLY": errno.EROFS,
    "SQLITE_IOERR": errno.EIO,
    "SQLITE_CANTOPEN": errno.EACCES,
}
# Ack spans remembered while the disk refuses to record them; beyond, the oldest is forgotten (its rows
# are sent again after the ack timeout and acked again: duplicates, which the controller drops).
_UNRECORDED_SPANS_MAX = 64


def _folder_errno(folder: Path) -> int | None:
    """EROFS for a read-only folder, ENOSPC for a full disk, else None: the cause behind whatever code
    SQLite reports (a full disk refusing its shared-memory file reads SQLITE_IOERR_SHMSIZE)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    # root may write into the blocks reserved for it: the disk is full for it when those are gone too.
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return errno.ENOSPC if free == 0 else None


class StorageError(OSError):
    """The disk refused an outbox write: ``errno`` ENOSPC (full), EROFS (read-only), EIO, EACCES.
    Nothing of the call was written. An OSError, handled like any refused write of the data folder."""


@dataclass(frozen=True, slots=True)
class OutboxRow:
    seq: int
    kind: str
    payload: bytes
    attempts: int


@dataclass(frozen=True, slots=True)
class DroppedRange:
    """Rows the bound forced out, oldest first: ``first..last`` with ``count`` rows really dropped."""

    first: int
    last: int
    count: int


@dataclass(frozen=True, slots=True)
class ResultsDropped:
    """What keeping one more command result cost, by command id: results that lost their picture
    (their slim form kept) and results dropped whole, oldest first."""

    pictures: list[str]
    results: list[str]

    def __bool__(self) -> bool:
        return bool(self.pictures or self.results)


class Outbox:
    """Thread-safe persistent outbox, bounded to ``max_messages`` rows (drop policy: oldest).

    Command results are kept beside, bounded on their own to ``max_results`` rows and
    ``max_result_bytes`` of payload: a snapshot's picture can weigh 400 kB where a detection batch
    weighs a few, so the count alone would not bound the disk. Drop policy: the oldest results' pictures
    first (the result itself stays, in its slim form), then the oldest results whole.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_messages: int = 100_000,
        drop_chunk: int | None = None,
        max_results: int = 64,
        max_result_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.path = path
        self.max_messages = max_messages
        self.max_results = max_results
        self.max_result_bytes = max_result_bytes
        # Dropping one row per append when full would emit one OUTBOX_DROPPED event per message;
        # dropping 1 % at a time keeps those events rare.
        self.drop_chunk = drop_chunk or max(1, max_messages // 100)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Sent marks (seq -> when) and acks ((first, last) spans) the disk refused to record; written by
        # the next write transaction that succeeds. At most one mark per row, at most
        # _UNRECORDED_SPANS_MAX spans.
        self._unrecorded_sent: dict[int, float] = {}
        self._unrecorded_acks: list[tuple[int, int]] = []
        self._db: sqlite3.Connection | None = None
        self._closed = False
        # The seq space this outbox numbers in; None: the legacy space (created before incarnations).
        # Known once the database opened; never changes afterwards.
        self.incarnation: str | None = None
        # Acks for another incarnation (a previous outbox's, resent late): ignored, counted.
        self.acks_ignored = 0
        try:
            self._open()
        except StorageError as exc:
            # A disk that refuses even the opening (full: SQLite cannot size its shared-memory file;
            # read-only: it cannot create it) must not stop the agent, which would then crash at every
            # restart: writes raise StorageError until the database opens, reads find nothing.
            log.error("cannot open the outbox %s: %s; opening it again with the next write", path, exc)

    def _open(self) -> None:
        """Open (and create) the database; StorageError when the disk refuses it (caller: no lock or
        holds it)."""
        db: sqlite3.Connection | None = None
        try:
            db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            # Created now (no meta table yet, also for an empty file) or before: the schema and the
            # incarnation are written in one transaction, so a crash in between cannot leave a new
            # outbox in the legacy space.
            fresh = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone() is None
            identity = (
                f"{_IDENTITY} INSERT OR IGNORE INTO identity (key, value) VALUES ('incarnation', '{uuid.uuid4().hex}');"
                if fresh
                else ""
            )
            # drop_first..drop_last (0 = none) and drop_count: dropped by the bound and not yet in a
            # report, on disk so that a kill -9 between a drop and its report loses nothing.
            db.executescript(
                f"BEGIN IMMEDIATE; {_SCHEMA} {identity} "
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('next_seq', 1), ('dropped', 0), "
                "('drop_first', 0), ('drop_last', 0), ('drop_count', 0), "
                "('results_dropped', 0), ('pictures_dropped', 0); COMMIT;"
            )
            has_identity = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'identity'").fetchone()
            row = (
                db.execute("SELECT value FROM identity WHERE key = 'incarnation'").fetchone()
                if has_identity
                else None
            )
        except sqlite3.Error as exc:
            if db is not None:
                if db.in_transaction:
                    db.rollback()
                db.close()
            refused = self._storage_error(exc)
            if refused is not None:
                raise refused from exc
            raise
        self.incarnation = str(row[0]) if row else None
        self._db = db

    def _conn(self) -> sqlite3.Connection:
        """The database, opened now if the disk refused it so far (StorageError while it still does)."""
        if self._closed:
            raise sqlite3.ProgrammingError("the outbox is closed")  # as sqlite3 says: never opened again
        if self._db is None:
            self._open()
            log.warning("outbox %s opened at last", self.path)
        assert self._db is not None
        return self._db

    def _reader(self) -> sqlite3.Connection | None:
        """The database for a read; None while the disk refuses to open it (nothing to read then)."""
        try:
            return self._conn()
        except StorageError:
            return None

    # ------------------------------------------------------------------ writes

    def append(self, kind: str, build_payload: Callable[[int], bytes], *, now: float = 0.0) -> int:
        """Number, build and persist one message; returns its seq.

        ``build_payload`` gets the seq so it can be embedded in the payload; if it raises, nothing is
        written and the seq is not consumed.
        """
        with self._lock, self._write() as cur:
            (seq,) = cur.execute("SELECT value FROM meta WHERE key = 'next_seq'").fetchone()
            payload = build_payload(seq)
            cur.execute(
                "INSERT INTO outbox (seq, kind, payload, created_at) VALUES (?, ?, ?, ?)",
                (seq, kind, payload, now),
            )
            cur.execute("UPDATE meta SET value = ? WHERE key = 'next_seq'", (seq + 1,))
            self._enforce_bound(cur)
        return int(seq)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction (the caller holds the lock): committed whole, or rolled back whole.

        The marks and acks remembered from refused writes go first, in the same transaction. A refused
        write raises :class:`StorageError` (from the SQLite error: ``__cause__``).
        """
        cur = self._conn().cursor()
        try:
            cur.execute("BEGIN IMMEDIATE")
            remembered = self._record_remembered(cur)
            yield cur
            cur.execute("COMMIT")
        except BaseException as exc:
            self._rollback()
            refused = self._storage_error(exc) if isinstance(exc, sqlite3.Error) else None
            if refused is not None:
                raise refused from exc
            raise
        if remembered:
            self._unrecorded_sent.clear()
            self._unrecorded_acks.clear()

    def _rollback(self) -> None:
        # SQLite has already rolled back after some errors (SQLITE_FULL among them): a ROLLBACK then
        # fails with "no transaction is active", which would hide the error that mattered.
        if self._db is None or not self._db.in_transaction:
            return
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.warning("outbox rollback failed: %s", exc)

    def _storage_error(self, exc: sqlite3.Error) -> StorageError | None:
        """``exc`` as a StorageError when it is a disk refusing the write, else None."""
        name = getattr(exc, "sqlite_errorname", "") or ""
        code = _STORAGE_CODES.get("_".join(name.split("_")[:2]))
        if code is None:
            return None
        code = _folder_errno(self.path.parent) or code
        return StorageError(code, f"{os.strerror(code)} (SQLite: {exc})", str(self.path))

    def _record_remembered(self, cur: sqlite3.Cursor) -> bool:
        """Write the marks and acks the disk refused before; True when there were some."""
        if not self._unrecorded_sent and not self._unrecorded_acks:
            return False
        for a, b in self._unrecorded_acks:
            cur.execute("DELETE FROM outbox WHERE seq BETWEEN ? AND ?", (a, b))
        if self._unrecorded_acks:
            cur.execute("DELETE FROM drop_reports WHERE seq NOT IN (SELECT seq FROM outbox)")
        cur.executemany(
            "UPDATE outbox SET sent_at = ?, attempts = attempts + 1 WHERE seq = ?",
            [(t, s) for s, t in self._unrecorded_sent.items()],
        )
        return True

    def _acked_unrecorded(self, seq: int) -> bool:
        return any(a <= seq <= b for a, b in self._unrecorded_acks)

    def _enforce_bound(self, cur: sqlite3.Cursor) -> None:
        (count,) = cur.execute("SELECT COUNT(*) FROM outbox").fetchone()
        if count <= self.max_messages:
            return
        n = max(count - self.max_messages, min(self.drop_chunk, count - 1))
        rows = cur.execute("SELECT seq FROM outbox ORDER BY seq LIMIT ?", (n,)).fetchall()
        first, last = rows[0][0], rows[-1][0]
        cur.execute("DELETE FROM outbox WHERE seq <= ?", (last,))
        cur.execute("UPDATE meta SET value = value + ? WHERE key = 'dropped'", (len(rows),))
        cur.execute("UPDATE meta SET value = value + ? WHERE key = 'drop_count'", (len(rows),))
        # A drop report dropped before it was sent: what it declared must be declared again.
        spans = [(first, last)]
        spans += cur.execute("SELECT first, last FROM drop_reports WHERE seq <= ?", (last,)).fetchall()
        cur.execute("DELETE FROM drop_reports WHERE seq <= ?", (last,))
        for a, b in spans:
            cur.execute(
                "UPDATE meta SET value = CASE WHEN value = 0 THEN ? ELSE MIN(value, ?) END "
                "WHERE key = 'drop_first'",
                (a, a),
            )
            cur.execute("UPDATE meta SET value = MAX(value, ?) WHERE key = 'drop_last'", (b,))
        log.warning(
            "outbox full (%s messages): dropped the oldest %s (seq %s..%s)", count, len(rows), first, last
        )

    def take_dropped(self) -> DroppedRange | None:
        """The span dropped by the bound and not yet reported (``count``: rows newly dropped in it),
        cleared; None when there is none. The publisher uses :meth:`append_drop_report`, which also
        remembers the report's span."""
        with self._lock, self._write() as cur:
            dropped = self._take_pending(cur)
        return dropped

    def append_drop_report(
        self, build_payload: Callable[[int, DroppedRange], bytes], *, now: float = 0.0
    ) -> int | None:
        """Append the OUTBOX_DROPPED report for the pending span, in the transaction that clears it;
        returns its seq, or None when nothing is pending. Its own append may drop more rows (a full
        outbox): those form the next pending span, never a recursive report."""
        with self._lock, self._write() as cur:
            dropped = self._take_pending(cur)
            if dropped is None:
                return None
            (seq,) = cur.execute("SELECT value FROM meta WHERE key = 'next_seq'").fetchone()
            payload = build_payload(seq, dropped)
            cur.execute(
                "INSERT INTO outbox (seq, kind, payload, created_at) VALUES (?, 'events', ?, ?)",
                (seq, payload, now),
            )
            cur.execute(
                "INSERT INTO drop_reports (seq, first, last) VALUES (?, ?, ?)",
                (seq, dropped.first, dropped.last),
            )
            cur.execute("UPDATE meta SET value = ? WHERE key = 'next_seq'", (seq + 1,))
            self._enforce_bound(cur)
        return int(seq)

    def drop_pending(self) -> bool:
        with self._lock:
            return self._meta("drop_first") > 0

    def _take_pending(self, cur: sqlite3.Cursor) -> DroppedRange | None:
        meta = dict(cur.execute("SELECT key, value FROM meta WHERE key LIKE 'drop_%'").fetchall())
        if not meta.get("drop_first"):
            return None
        cur.execute("UPDATE meta SET value = 0 WHERE key IN ('drop_first', 'drop_last', 'drop_count')")
        return DroppedRange(int(meta["drop_first"]), int(meta["drop_last"]), int(meta["drop_count"]))

    def ack(self, msg: Ack) -> int:
        """Delete every row the ack covers; returns how many were deleted. Refused by the disk: the ack
        is remembered (its rows are not sent again) and :class:`StorageError` raised.

        An ack naming another incarnation covers another space's seqs: ignored (counted, 0 deleted).
        One naming none is taken: a controller older than incarnations acks without echoing it.
        """
        if msg.incarnation is not None and msg.incarnation != self.incarnation:
            self.acks_ignored += 1
            log.warning(
                "ack for incarnation %s ignored: this outbox is %s (%s ignored so far)",
                msg.incarnation,
                self.incarnation or "legacy",
                self.acks_ignored,
            )
            return 0
        # SQLite integers stop at 2**63 - 1, and so do seqs: a larger bound (a garbled or hostile ack)
        # means the same as that one, instead of an OverflowError.
        top = 2**63 - 1
        spans = [(1, min(msg.upto, top))] if msg.upto >= 1 else []
        spans += [(a, min(b, top)) for a, b in msg.ranges if a <= top]
        with self._lock:
            try:
                with self._write() as cur:
                    deleted = 0
                    for a, b in spans:
                        deleted += cur.execute(
                            "DELETE FROM outbox WHERE seq BETWEEN ? AND ?", (a, b)
                        ).rowcount
                    cur.execute("DELETE FROM drop_reports WHERE seq NOT IN (SELECT seq FROM outbox)")
            except StorageError:
                self._unrecorded_acks = (self._unrecorded_acks + spans)[-_UNRECORDED_SPANS_MAX:]
                for seq in [s for s in self._unrecorded_sent if self._acked_unrecorded(s)]:
                    del self._unrecorded_sent[seq]
                raise
            return deleted

    def mark_sent(self, seqs: Iterable[int], now: float) -> None:
        """Refused by the disk: the marks are remembered (the rows are not due again before the ack
        timeout) and :class:`StorageError` raised."""
        marks = [(now, s) for s in seqs]
        with self._lock:
            try:
                with self._write() as cur:
                    cur.executemany(
                        "UPDATE outbox SET sent_at = ?, attempts = attempts + 1 WHERE seq = ?", marks
                    )
            except StorageError:
                self._unrecorded_sent.update((s, t) for t, s in marks)
                raise

    def record_remembered(self) -> None:
        """Write the sent marks and acks the disk refused before; StorageError while it still refuses."""
        with self._lock:
            if not self._unrecorded_sent and not self._unrecorded_acks:
                return
            with self._write():
                pass

    def reset_sent(self) -> None:
        """Make every unacked row due now (after a reconnect, when in-flight sends may be lost)."""
        with self._lock:
            self._unrecorded_sent.clear()  # due now in memory, whatever the disk says below
            with self._write() as cur:
                cur.execute("UPDATE outbox SET sent_at = NULL")

    # ------------------------------------------------------------------ command results

    def put_result(
        self, command_id: str, payload: bytes, *, slim: bytes | None, now: float
    ) -> ResultsDropped:
        """Keep one command result until :meth:`results_delivered`; what the bound dropped to make room
        (counted on disk). A second result for the same id (a command delivered twice) is not kept: the
        controller takes the first one anyway. StorageError when the disk refuses it (nothing written)."""
        with self._lock, self._write() as cur:
            cur.execute(
                "INSERT OR IGNORE INTO command_results (id, payload, slim, created_at) VALUES (?, ?, ?, ?)",
                (command_id, payload, slim, now),
            )
            dropped = self._bound_results(cur)
        return dropped

    def _bound_results(self, cur: sqlite3.Cursor) -> ResultsDropped:
        # Caller holds the lock, in a write transaction. At most max_results rows: a handful, read whole.
        rows = cur.execute(
            "SELECT n, id, length(payload), slim IS NOT NULL, length(slim) FROM command_results ORDER BY n"
        ).fetchall()
        size = {n: int(b) for n, _, b, _, _ in rows}
        total = sum(size.values())
        pictures: list[str] = []
        for n, cid, _, has_slim, slim_bytes in rows:
            if total <= self.max_result_bytes:
                break
            if has_slim:
                cur.execute("UPDATE command_results SET payload = slim, slim = NULL WHERE n = ?", (n,))
                total += int(slim_bytes) - size[n]
                size[n] = int(slim_bytes)
                pictures.append(str(cid))
        results: list[str] = []
        count = len(rows)
        for n, cid, _, _, _ in rows:
            if count <= self.max_results and total <= self.max_result_bytes:
                break
            cur.execute("DELETE FROM command_results WHERE n = ?", (n,))
            count -= 1
            total -= size[n]
            results.append(str(cid))
        if pictures:
            cur.execute("UPDATE meta SET value = value + ? WHERE key = 'pictures_dropped'", (len(pictures),))
        if results:
            cur.execute("UPDATE meta SET value = value + ? WHERE key = 'results_dropped'", (len(results),))
        return ResultsDropped(pictures, results)

    def results_delivered(self, command_ids: Iterable[str]) -> int:
        """Forget the results the broker has acknowledged; returns how many were still kept."""
        ids = [(c,) for c in command_ids]
        with self._lock, self._write() as cur:
            before = cur.execute("SELECT COUNT(*) FROM command_results").fetchone()[0]
            cur.executemany("DELETE FROM command_results WHERE id = ?", ids)
            after = cur.execute("SELECT COUNT(*) FROM command_results").fetchone()[0]
        return int(before) - int(after)

    def result_ids(self) -> list[str]:
        """The ids of the results kept, oldest first (none while the database cannot be opened)."""
        with self._lock:
            db = self._reader()
            if db is None:
                return []
            return [str(r[0]) for r in db.execute("SELECT id FROM command_results ORDER BY n")]

    def result_payload(self, command_id: str) -> bytes | None:
        """The result kept for ``command_id`` (its slim form if the bound took the picture); None when it
        is not kept (delivered, or dropped by the bound)."""
        with self._lock:
            db = self._reader()
            if db is None:
                return None
            row = db.execute("SELECT payload FROM command_results WHERE id = ?", (command_id,)).fetchone()
        return bytes(row[0]) if row else None

    def results_figures(self) -> dict[str, int]:
        """Results kept now, and what the bound dropped since the outbox was created (diagnostics)."""
        with self._lock:
            db = self._reader()
            if db is None:
                return {"pending": 0, "dropped": 0, "pictures_dropped": 0}
            (pending,) = db.execute("SELECT COUNT(*) FROM command_results").fetchone()
            return {
                "pending": int(pending),
                "dropped": self._meta("results_dropped"),
                "pictures_dropped": self._meta("pictures_dropped"),
            }

    # ------------------------------------------------------------------ reads

    def due(self, now: float, timeout_s: float, limit: int) -> list[OutboxRow]:
        """Rows never sent, or sent more than ``timeout_s`` ago and not acked; oldest first. Marks and
        acks the disk refused to record count as if recorded."""
        with self._lock:
            db = self._reader()
            if db is None:
                return []
            acked = [f"AND seq NOT BETWEEN {int(a)} AND {int(b)}" for a, b in self._unrecorded_acks]
            marks = {s: t for s, t in self._unrecorded_sent.items() if t > now - timeout_s}
            rows = db.execute(
                "SELECT seq, kind, payload, attempts FROM outbox WHERE (sent_at IS NULL OR sent_at <= ?) "
                f"{' '.join(acked)} ORDER BY seq LIMIT ?",
                (now - timeout_s, limit + len(marks)),
            ).fetchall()
        due = [OutboxRow(int(s), str(k), bytes(p), int(a)) for s, k, p, a in rows if s not in marks]
        return due[:limit]

    def pending(self) -> int:
        """Rows on disk not acked yet (0 while the database cannot be opened)."""
        with self._lock:
            db = self._reader()
            if db is None:
                return 0
            (n,) = db.execute("SELECT COUNT(*) FROM outbox").fetchone()
            return int(n)

    def oldest_pending_at(self) -> float | None:
        """When the oldest row not acked yet was written (unix seconds); None: none, or unreadable."""
        with self._lock:
            db = self._reader()
            if db is None:
                return None
            (at,) = db.execute("SELECT MIN(created_at) FROM outbox").fetchone()
            return float(at) if at is not None else None

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._meta("dropped")

    def _meta(self, key: str) -> int:
        # Caller holds the lock. 0 while the database cannot be opened.
        db = self._reader()
        if db is None:
            return 0
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return int(row[0]) if row else 0

    @property
    def next_seq(self) -> int:
        """The seq the next message gets (0 while the database cannot be opened: not known)."""
        with self._lock:
            return self._meta("next_seq")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._db is not None:
                self._db.close()
                self._db = None
