"""The ack arithmetic: which sequence numbers are stored or declared dropped, and the Ack they make.

Pure functions and data structures (no I/O), so the arithmetic can be tested on its own. The controller
keeps the truth in the database, per sequence space (a device's incarnation; ``device_seq``: every seq
up to ``upto`` covered, and the covered runs above it; ``ingested_seq``: one row per stored seq, the
dedup) and turns it into an ack with ``advance``; ``SeqTracker`` is the same arithmetic over a whole
history in memory, the model the database-backed ingest is checked against.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

MAX_ACK_RANGES = 1000  # fleet_protocol.messages.Ack.ranges max_length


def advance(upto: int, islands: Sequence[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
    """``(upto, ranges)`` for an Ack, from the old ``upto`` and the runs of covered seqs above it.

    ``islands``: sorted, disjoint, non-adjacent ``(first, last)`` runs, all above ``upto``. A run that
    starts right after ``upto`` extends it; the rest become the ack's ranges (at most MAX_ACK_RANGES,
    lowest first: the oldest unacked messages are the ones an agent resends first).
    """
    if islands and islands[0][0] == upto + 1:
        return islands[0][1], list(islands[1 : 1 + MAX_ACK_RANGES])
    return upto, list(islands[:MAX_ACK_RANGES])


class IntervalSet:
    """A set of positive ints kept as sorted, disjoint, non-adjacent inclusive intervals."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, n: object) -> bool:
        if not isinstance(n, int):
            return False
        i = bisect_left(self._ends, n)
        return i < len(self._starts) and self._starts[i] <= n

    def add(self, n: int) -> int:
        return self.add_range(n, n)

    def add_range(self, a: int, b: int) -> int:
        """Add ``a..b``; returns how many numbers were new."""
        if b < a:
            return 0
        i = bisect_left(self._ends, a - 1)  # first interval that touches or follows a
        j = i
        na, nb, removed = a, b, 0
        while j < len(self._starts) and self._starts[j] <= b + 1:
            na, nb = min(na, self._starts[j]), max(nb, self._ends[j])
            removed += self._ends[j] - self._starts[j] + 1
            j += 1
        self._starts[i:j] = [na]
        self._ends[i:j] = [nb]
        added = (nb - na + 1) - removed
        self._count += added
        return added

    @property
    def runs(self) -> int:
        """How many intervals."""
        return len(self._starts)

    def intervals(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    @property
    def max(self) -> int:
        return self._ends[-1] if self._ends else 0


@dataclass(frozen=True)
class SeqStats:
    """One sequence space's figures; or a device's, summed over its spaces (``total``)."""

    stored: int
    duplicates: int
    dropped: int
    lost: int
    acked_upto: int
    max_seq: int
    incarnation: str | None = None  # the space (None: legacy, or a device total)
    started_at: datetime | None = None
    incarnations: tuple[SeqStats, ...] = ()  # a device total: its (newest) spaces, oldest first
    spaces: int = 0  # a device total: how many spaces it has, listed or not

    @classmethod
    def total(cls, spaces: Sequence[SeqStats]) -> SeqStats:
        """A device's figures over its spaces (oldest first): counts and ``lost`` summed (each space
        loses on its own: a new one starting again at 1 hides nothing missing in the old one),
        ``acked_upto`` and ``max_seq`` those of the newest space, the one the agent sends in now."""
        if not spaces:
            return NO_STATS
        now = spaces[-1]
        return cls(
            stored=sum(x.stored for x in spaces),
            duplicates=sum(x.duplicates for x in spaces),
            dropped=sum(x.dropped for x in spaces),
            lost=sum(x.lost for x in spaces),
            acked_upto=now.acked_upto,
            max_seq=now.max_seq,
            incarnation=now.incarnation,
            started_at=now.started_at,
            incarnations=tuple(spaces),
            spaces=len(spaces),
        )

    @classmethod
    def of(
        cls,
        *,
        upto: int,
        max_seq: int,
        stored: int,
        dropped: int,
        duplicates: int,
        incarnation: str | None = None,
        started_at: datetime | None = None,
    ) -> SeqStats:
        """From a space's counters: every seq up to ``max_seq`` neither stored nor declared dropped is lost."""
        return cls(
            stored=stored,
            duplicates=duplicates,
            dropped=dropped,
            lost=max(0, max_seq - stored - dropped),
            acked_upto=upto,
            max_seq=max_seq,
            incarnation=incarnation,
            started_at=started_at,
        )


NO_STATS = SeqStats.of(upto=0, max_seq=0, stored=0, dropped=0, duplicates=0)


class SeqTracker:
    """One device's covered seqs (stored or declared dropped) and its counters, all in memory.

    Not what the controller acks from (one process sees only its share of a device's messages when
    replicas share the load): the reference the database-backed figures are compared with.
    """

    def __init__(self) -> None:
        self.covered = IntervalSet()
        self.stored = 0
        self.dropped = 0
        self.duplicates = 0

    def mark_stored(self, seq: int, *, was_dropped: bool = False) -> None:
        self.covered.add(seq)
        self.stored += 1
        if was_dropped:
            self.dropped -= 1

    def mark_dropped(self, seq: int) -> None:
        self.covered.add(seq)
        self.dropped += 1

    @property
    def upto(self) -> int:
        ivs = self.covered.intervals()
        return ivs[0][1] if ivs and ivs[0][0] == 1 else 0

    def ack(self) -> tuple[int, list[tuple[int, int]]]:
        """``(upto, ranges)`` for an Ack: every seq <= upto is covered, ranges list the rest."""
        return advance(0, self.covered.intervals())

    def stats(self) -> SeqStats:
        top = self.covered.max
        return SeqStats(
            stored=self.stored,
            duplicates=self.duplicates,
            dropped=self.dropped,
            lost=top - len(self.covered),
            acked_upto=self.upto,
            max_seq=top,
        )
