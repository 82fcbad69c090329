"""The on-disk outbox: every detection batch and event stays here until the controller acks it.

SQLite in WAL mode with ``synchronous=FULL``: a commit is on disk when ``append`` returns, so a
power cut loses nothing that was handed to the outbox. The next sequence number lives in the same
database and is bumped in the same transaction as the row it numbers, so seqs stay monotonic across
restarts without gaps. See PROTOCOL.md, "Sequence numbers, outbox, acks".
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable
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
"""


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


class Outbox:
    """Thread-safe persistent outbox, bounded to ``max_messages`` rows (drop policy: oldest)."""

    def __init__(self, path: Path, *, max_messages: int = 100_000, drop_chunk: int | None = None) -> None:
        self.path = path
        self.max_messages = max_messages
        # Dropping one row per append when full would emit one OUTBOX_DROPPED event per message;
        # dropping 1 % at a time keeps those events rare.
        self.drop_chunk = drop_chunk or max(1, max_messages // 100)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        # drop_first..drop_last (0 = none) and drop_count: dropped by the bound and not yet in a report,
        # on disk so that a kill -9 between a drop and its report loses nothing.
        self._db.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('next_seq', 1), ('dropped', 0), "
            "('drop_first', 0), ('drop_last', 0), ('drop_count', 0)"
        )

    # ------------------------------------------------------------------ writes

    def append(self, kind: str, build_payload: Callable[[int], bytes], *, now: float = 0.0) -> int:
        """Number, build and persist one message; returns its seq.

        ``build_payload`` gets the seq so it can be embedded in the payload; if it raises, nothing is
        written and the seq is not consumed.
        """
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                (seq,) = cur.execute("SELECT value FROM meta WHERE key = 'next_seq'").fetchone()
                payload = build_payload(seq)
                cur.execute(
                    "INSERT INTO outbox (seq, kind, payload, created_at) VALUES (?, ?, ?, ?)",
                    (seq, kind, payload, now),
                )
                cur.execute("UPDATE meta SET value = ? WHERE key = 'next_seq'", (seq + 1,))
                self._enforce_bound(cur)
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            return int(seq)

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
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                dropped = self._take_pending(cur)
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            return dropped

    def append_drop_report(
        self, build_payload: Callable[[int, DroppedRange], bytes], *, now: float = 0.0
    ) -> int | None:
        """Append the OUTBOX_DROPPED report for the pending span, in the transaction that clears it;
        returns its seq, or None when nothing is pending. Its own append may drop more rows (a full
        outbox): those form the next pending span, never a recursive report."""
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                dropped = self._take_pending(cur)
                if dropped is None:
                    cur.execute("COMMIT")
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
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
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
        """Delete every row the ack covers; returns how many were deleted."""
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                # SQLite integers stop at 2**63 - 1, and so do seqs: a larger bound (a garbled or hostile
                # ack) means the same as that one, instead of an OverflowError.
                top = 2**63 - 1
                deleted = cur.execute("DELETE FROM outbox WHERE seq <= ?", (min(msg.upto, top),)).rowcount
                for a, b in msg.ranges:
                    if a <= top:
                        deleted += cur.execute(
                            "DELETE FROM outbox WHERE seq BETWEEN ? AND ?", (a, min(b, top))
                        ).rowcount
                cur.execute("DELETE FROM drop_reports WHERE seq NOT IN (SELECT seq FROM outbox)")
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            return deleted

    def mark_sent(self, seqs: Iterable[int], now: float) -> None:
        with self._lock:
            self._db.executemany(
                "UPDATE outbox SET sent_at = ?, attempts = attempts + 1 WHERE seq = ?",
                [(now, s) for s in seqs],
            )

    def reset_sent(self) -> None:
        """Make every unacked row due now (after a reconnect, when in-flight sends may be lost)."""
        with self._lock:
            self._db.execute("UPDATE outbox SET sent_at = NULL")

    # ------------------------------------------------------------------ reads

    def due(self, now: float, timeout_s: float, limit: int) -> list[OutboxRow]:
        """Rows never sent, or sent more than ``timeout_s`` ago and not acked; oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, kind, payload, attempts FROM outbox WHERE sent_at IS NULL OR sent_at <= ? "
                "ORDER BY seq LIMIT ?",
                (now - timeout_s, limit),
            ).fetchall()
        return [OutboxRow(int(s), str(k), bytes(p), int(a)) for s, k, p, a in rows]

    def pending(self) -> int:
        with self._lock:
            (n,) = self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()
            return int(n)

    @property
    def dropped(self) -> int:
        with self._lock:
            (n,) = self._db.execute("SELECT value FROM meta WHERE key = 'dropped'").fetchone()
            return int(n)

    def _meta(self, key: str) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return int(row[0]) if row else 0

    @property
    def next_seq(self) -> int:
        with self._lock:
            (n,) = self._db.execute("SELECT value FROM meta WHERE key = 'next_seq'").fetchone()
            return int(n)

    def close(self) -> None:
        with self._lock:
            self._db.close()
