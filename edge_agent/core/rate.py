"""A token bucket: at most so many events a minute, its budget refilling continuously."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """Holds at most ``per_minute`` tokens and gains ``per_minute`` a minute, a fraction at a time, so
    a burst may spend what a quiet spell saved but the long-run rate stays bounded; it starts full.
    Not thread-safe: its owner takes it under its own lock."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = per_minute / 60.0
        self._capacity = float(per_minute)
        self._tokens = self._capacity
        self._clock = clock
        self._refilled = clock()

    def take(self) -> bool:
        """Spend a token if there is one; False (nothing spent) when the budget is empty."""
        now = self._clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
