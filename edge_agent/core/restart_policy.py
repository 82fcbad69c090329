"""Retry and restart policy shared by the capture threads and the inference watchdog.

Pure logic with an injectable clock, so the policy is tested without waiting it out:
- :func:`capped_backoff`: the delay before retry ``n`` (min, 2*min, 4*min, ... capped at max).
- :class:`RestartLimiter`: at most ``max_restarts`` restarts in ``window_s``; beyond that the pipeline
  is marked failed and retried with capped backoff, so a model that keeps hanging never turns into a
  tight restart loop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

Clock = Callable[[], float]


def capped_backoff(attempt: int, min_s: float, max_s: float) -> float:
    """The delay after the ``attempt``-th consecutive failure (1-based): min_s * 2**(attempt-1) <= max_s."""
    if attempt < 1:
        return 0.0
    # The exponent is capped too: 2**1000 would overflow a float long before max_s matters.
    return min(max_s, min_s * 2.0 ** min(attempt - 1, 60))


class WatchdogAction(StrEnum):
    RESTARTED = "restarted"  # a hang was detected; the pipeline restarted at once
    FAILED = "failed"  # too many restarts in the window: the pipeline waits ``retry_in_s``
    RETRY = "retry"  # the wait is over: the pipeline is started again
    RECOVERED = "recovered"  # the first inference after a failure completed


@dataclass(frozen=True, slots=True)
class Decision:
    action: WatchdogAction  # RESTARTED or FAILED
    restarts_in_window: int
    retry_in_s: float | None = None  # FAILED only: when the next try is due


class RestartLimiter:
    """Decides, for each hang, whether to restart now or to mark the pipeline failed and back off.

    Not thread-safe: one watchdog thread owns it.
    """

    def __init__(
        self,
        *,
        max_restarts: int,
        window_s: float,
        backoff_min_s: float,
        backoff_max_s: float,
        clock: Clock = time.monotonic,
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._restarts: deque[float] = deque()
        self.failures = 0  # consecutive FAILED decisions; reset by :meth:`healthy`
        self.retry_at: float | None = None

    @property
    def failed(self) -> bool:
        return self.retry_at is not None

    def restarts_in_window(self) -> int:
        now = self._clock()
        while self._restarts and now - self._restarts[0] > self.window_s:
            self._restarts.popleft()
        return len(self._restarts)

    def on_hang(self) -> Decision:
        """A hang was detected (and the stuck run abandoned): restart now, or back off?"""
        in_window = self.restarts_in_window()
        if not self.failed and in_window < self.max_restarts:
            self._restarts.append(self._clock())
            return Decision(WatchdogAction.RESTARTED, in_window + 1)
        return Decision(WatchdogAction.FAILED, in_window, retry_in_s=self.fail())

    def fail(self) -> float:
        """Mark the pipeline failed (also when a restart itself failed); the wait before the next try."""
        self.failures += 1
        delay = capped_backoff(self.failures, self.backoff_min_s, self.backoff_max_s)
        self.retry_at = self._clock() + delay
        return delay

    def retry_due(self) -> bool:
        return self.retry_at is not None and self._clock() >= self.retry_at

    def retrying(self) -> None:
        """The failed pipeline is being started again; a hang now is another failure (longer wait)."""
        self.retry_at = None

    def retry_now(self) -> None:
        """An operator asked for a restart: the next try is due at once."""
        if self.retry_at is not None:
            self.retry_at = self._clock()

    def healthy(self) -> bool:
        """An inference completed; True when that ends a failure streak (the pipeline recovered)."""
        recovered = self.failures > 0 and self.retry_at is None
        if recovered:
            self.failures = 0
        return recovered


@dataclass(frozen=True, slots=True)
class WatchdogNote:
    """What the watchdog did, for the agent to report (an event, and the cameras' reported state)."""

    action: WatchdogAction
    reason: str
    model: str | None = None  # "name:version" of the model that hung
    cameras: tuple[str, ...] = ()  # the cameras that model serves
    stuck_s: float | None = None  # how long the abandoned run had been going when it was detected
    restarts_in_window: int = 0
    max_restarts: int = 0
    window_s: float = 0.0
    retry_in_s: float | None = None  # FAILED: the wait before the next try
