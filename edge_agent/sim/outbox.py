"""A simulated device's outbox and the file that keeps its seqs between runs.

``SimOutbox`` numbers every detection batch and event of one device from ONE sequence and keeps each
message until an ``Ack`` covers it, sending it again after the ack timeout
(``fleet_protocol/ack_timer.py``). ``SeqStore`` keeps each device's next seq in a small SQLite file,
reserved ahead in blocks while running and written exactly at a clean stop together with whatever is
still unacked, so a restarted simulator continues each sequence (and sends the leftovers again)
instead of reusing seqs the controller would drop as duplicates.
"""

from __future__ import annotations

import contextlib
import sqlite3
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet_protocol.ack_timer import AckTimer
from fleet_protocol.messages import Ack
from fleet_protocol.topics import TopicKind

SEQ_BLOCK = 100  # seqs reserved on disk ahead of use (a crash leaves at most this gap)
DEFAULT_OUTBOX_MAX = 600  # messages per device; when full the device produces nothing (counted)


@dataclass(slots=True)
class Unacked:
    """One numbered message not acked yet. ``first_sent``/``last_sent``: monotonic seconds, None
    before its first publish in this run."""

    seq: int
    kind: TopicKind
    payload: bytes
    first_sent: float | None = None
    last_sent: float | None = None
    attempts: int = 0
    carried: bool = False  # numbered by an earlier run of the simulator, left unacked at its stop


class SimOutbox:
    """One simulated device's outbox, in memory: every detection batch and event, numbered from one
    sequence, stays here until an ``Ack`` covers it (PROTOCOL.md "Sequence numbers, outbox, acks").

    Bounded to ``max_messages``; its drop policy is *refuse new*: a full outbox numbers nothing more
    (the device skips its batch, counted in ``skipped_full``), so a simulated outage never loses a seq.
    ``reserve(n)`` is called before seq ``n`` or any above it up to the next block is used: the caller
    persists it, so a restart never numbers a seq twice.
    """

    def __init__(
        self,
        next_seq: int = 1,
        *,
        max_messages: int = DEFAULT_OUTBOX_MAX,
        reserve: Callable[[int], None] | None = None,
        reserved: int | None = None,
        block: int = SEQ_BLOCK,
        ack_timeout_s: float = 10.0,
    ) -> None:
        """``reserved``: seqs below it are already reserved on disk (default: none are);
        ``ack_timeout_s``: the least wait before a resend (ack_timer.py)."""
        self.timer = AckTimer(ack_timeout_s)
        if next_seq < 1:
            raise ValueError("next_seq starts at 1")
        self.next_seq = next_seq
        self.start_seq = next_seq  # the first seq this run numbers (unless an ack moves numbering on)
        self.max_messages = max_messages
        self._reserve = reserve
        self._block = block
        self._limit = max(next_seq, reserved or 0)  # seqs below it may be used without writing first
        self._unacked: dict[int, Unacked] = {}
        self.sent = 0  # distinct seqs published at least once in this run
        self.acked = 0  # seqs an ack covered
        self.resends = 0  # publishes after the first one of a seq
        self.skipped_full = 0  # messages not produced because the outbox was full
        self.carried = 0  # unacked seqs taken over from an earlier run
        self.acked_above = 0  # highest seq an ack covered above the highest this outbox numbered
        self.latencies = array("d")  # per acked seq: ack time minus its first publish (seconds)

    def __len__(self) -> int:
        return len(self._unacked)

    @property
    def full(self) -> bool:
        return len(self._unacked) >= self.max_messages

    @property
    def in_flight(self) -> int:
        """Seqs published and not acked yet."""
        return sum(1 for p in self._unacked.values() if p.first_sent is not None)

    @property
    def unsent(self) -> int:
        """Seqs numbered and never published in this run."""
        return sum(1 for p in self._unacked.values() if p.first_sent is None)

    def unacked(self) -> list[Unacked]:
        return list(self._unacked.values())

    def add(self, kind: TopicKind, build: Callable[[int], bytes]) -> int | None:
        """Number and keep one message (``build`` gets its seq); None when the outbox is full."""
        if self.full:
            self.skipped_full += 1
            return None
        seq = self.next_seq
        payload = build(seq)  # raises before the seq is used
        if seq >= self._limit:
            self._limit = seq + self._block
            if self._reserve is not None:
                self._reserve(self._limit)
        self.next_seq = seq + 1
        self._unacked[seq] = Unacked(seq, kind, payload)
        return seq

    def carry(self, seq: int, kind: TopicKind, payload: bytes) -> None:
        """Take over a message an earlier run numbered and left unacked (sent again like any other)."""
        if seq >= self.next_seq:
            raise ValueError(f"carried seq {seq} is not below next seq {self.next_seq}")
        self._unacked[seq] = Unacked(seq, kind, payload, carried=True)
        self._unacked = dict(sorted(self._unacked.items()))
        self.carried += 1

    def due(self, now: float, timeout_s: float, limit: int) -> list[Unacked]:
        """Messages never sent, or last sent ``timeout_s`` or more ago; oldest first, at most ``limit``."""
        out: list[Unacked] = []
        cutoff = now - timeout_s
        for p in self._unacked.values():
            if p.last_sent is None or p.last_sent <= cutoff:
                out.append(p)
                if len(out) >= limit:
                    break
        return out

    def mark_sent(self, p: Unacked, now: float) -> None:
        if p.first_sent is None:
            p.first_sent = now
            self.sent += 1
        else:
            self.resends += 1
        p.last_sent = now
        p.attempts += 1

    def reset_sent(self) -> None:
        """Everything unacked is due now (after a reconnect: what was in flight may be gone)."""
        for p in self._unacked.values():
            p.last_sent = None

    def ack(self, msg: Ack, now: float) -> list[float]:
        """Drop every message ``msg`` covers; returns their publish->ack latencies (seconds).

        An ack above the highest seq numbered here means the controller stored seqs of this device
        that this outbox never numbered (another data folder, or none, was used before): numbering
        continues above them, so nothing new is taken for a duplicate and dropped.
        """
        covered = [seq for seq in self._unacked if msg.covers(seq)]
        lat: list[float] = []
        for seq in covered:
            p = self._unacked.pop(seq)
            if p.first_sent is not None:
                lat.append(now - p.first_sent)
                if p.attempts == 1:  # Karn's rule: a resent message's ack times no one send
                    self.timer.sample(now - p.first_sent)
        self.acked += len(covered)
        self.latencies.extend(lat)
        top = max([msg.upto, *(b for _, b in msg.ranges)])
        if top >= self.next_seq:
            self.acked_above = max(self.acked_above, top)
            self.next_seq = top + 1
        return lat


class SeqStore:
    """Per device: the next seq that is safe to use, and (after a clean stop) what was left unacked.

    One SQLite file for every device of every deployment the simulator ran against (a deployment is
    broker host:port + topic prefix: seqs are per device *at a controller*).
    """

    _SCHEMA = """
    CREATE TABLE IF NOT EXISTS device (
        deployment TEXT NOT NULL, device_id TEXT NOT NULL, next_seq INTEGER NOT NULL,
        PRIMARY KEY (deployment, device_id));
    CREATE TABLE IF NOT EXISTS unacked (
        deployment TEXT NOT NULL, device_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL,
        payload BLOB NOT NULL, PRIMARY KEY (deployment, device_id, seq));
    """

    def __init__(self, path: Path, deployment: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.deployment = deployment
        self._db = sqlite3.connect(str(path), isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(self._SCHEMA)

    def load(self, device_ids: Iterable[str]) -> dict[str, tuple[int, list[tuple[int, TopicKind, bytes]]]]:
        """Per device: its next seq (1 for a new one) and the messages left unacked, oldest first."""
        next_seq = dict(
            self._db.execute(
                "SELECT device_id, next_seq FROM device WHERE deployment = ?", (self.deployment,)
            ).fetchall()
        )
        left: dict[str, list[tuple[int, TopicKind, bytes]]] = {}
        for dev, seq, kind, payload in self._db.execute(
            "SELECT device_id, seq, kind, payload FROM unacked WHERE deployment = ? ORDER BY device_id, seq",
            (self.deployment,),
        ):
            left.setdefault(dev, []).append((int(seq), TopicKind(kind), bytes(payload)))
        return {d: (int(next_seq.get(d, 1)), left.get(d, [])) for d in device_ids}

    def set_next(self, items: Iterable[tuple[str, int]]) -> None:
        """Record next seqs (a reservation: written before any seq below it is used)."""
        rows = [(self.deployment, d, n) for d, n in items]
        if not rows:
            return
        with self._tx() as db:
            db.executemany(
                "INSERT INTO device (deployment, device_id, next_seq) VALUES (?, ?, ?) "
                "ON CONFLICT (deployment, device_id) DO UPDATE SET next_seq = MAX(next_seq, excluded.next_seq)",
                rows,
            )

    def save_final(self, items: Iterable[tuple[str, int, list[Unacked]]]) -> None:
        """At a clean stop: each device's exact next seq and the messages still unacked."""
        with self._tx() as db:
            for device_id, next_seq, unacked in items:
                db.execute(
                    "INSERT INTO device (deployment, device_id, next_seq) VALUES (?, ?, ?) "
                    "ON CONFLICT (deployment, device_id) DO UPDATE SET next_seq = excluded.next_seq",
                    (self.deployment, device_id, next_seq),
                )
                db.execute(
                    "DELETE FROM unacked WHERE deployment = ? AND device_id = ?", (self.deployment, device_id)
                )
                db.executemany(
                    "INSERT INTO unacked (deployment, device_id, seq, kind, payload) VALUES (?, ?, ?, ?, ?)",
                    [(self.deployment, device_id, p.seq, p.kind.value, p.payload) for p in unacked],
                )

    @contextlib.contextmanager
    def _tx(self) -> Any:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()
