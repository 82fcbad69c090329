"""Per-device bookkeeping of which sequence numbers are stored or declared dropped.

Pure data structures (no I/O), so the ack arithmetic can be tested on its own.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

MAX_ACK_RANGES = 1000  # fleet_protocol.messages.Ack.ranges max_length


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

    def intervals(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    @property
    def max(self) -> int:
        return self._ends[-1] if self._ends else 0


@dataclass(frozen=True)
class SeqStats:
    stored: int
    duplicates: int
    dropped: int
    lost: int
    acked_upto: int
    max_seq: int


class SeqTracker:
    """One device's covered seqs (stored or declared dropped) and its counters."""

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
        ivs = self.covered.intervals()
        if ivs and ivs[0][0] == 1:
            return ivs[0][1], ivs[1 : 1 + MAX_ACK_RANGES]
        return 0, ivs[:MAX_ACK_RANGES]

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
