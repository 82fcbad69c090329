"""The agent's recent log lines, kept in memory for the remote ``logs`` command and the local page.

A logging handler on the root logger keeps the newest lines in a bounded ring: a chatty camera
cannot grow it, and reading it never touches the log file (which a full disk may have stopped). Each
line is redacted when it is recorded, with the secrets the agent knows (its broker password, the
secrets its cameras read) and the shapes secrets take in text (URL credentials, ``password=…``), so
nothing read out of the ring can carry one, whoever asks.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fleet_protocol.sources import redact_text

# Lines kept; the oldest go first. A line is at most MAX_LINE_CHARS (a traceback keeps its last line).
DEFAULT_CAPACITY = 2000
MAX_LINE_CHARS = 1000
LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True, slots=True)
class LogLine:
    ts: float  # unix seconds
    level: str  # one of LEVELS
    logger: str
    thread: str
    message: str

    def as_dict(self) -> dict[str, object]:
        return {
            "ts": self.ts,
            "level": self.level,
            "logger": self.logger,
            "thread": self.thread,
            "message": self.message,
        }


def level_number(name: str) -> int:
    """``warning`` -> logging.WARNING; ValueError naming the levels for anything else."""
    if name.lower() not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, not {name!r}")
    return int(logging.getLevelName(name.upper()))


class LogRing(logging.Handler):
    """The newest ``capacity`` log records as redacted :class:`LogLine` values."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self._lines: deque[LogLine] = deque(maxlen=capacity)
        self._secrets: frozenset[str] = frozenset()
        self._ring_lock = threading.Lock()
        self.recorded = 0  # every line ever recorded: minus len(ring), how many were pushed out

    def add_secrets(self, secrets: Iterable[str]) -> None:
        """Texts never to let out (a password, a camera's secret), from now on."""
        with self._ring_lock:
            self._secrets = self._secrets | {s for s in secrets if s}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                text = f"{text}: {type(exc).__name__}: {exc}"
            line = LogLine(
                ts=record.created,
                level=record.levelname.lower(),
                logger=record.name,
                thread=record.threadName or "",
                message=redact_text(text, self._secrets)[:MAX_LINE_CHARS],
            )
        except Exception:
            self.handleError(record)
            return
        with self._ring_lock:
            self._lines.append(line)
            self.recorded += 1

    def lines(
        self, *, limit: int = 200, min_level: str = "debug", since: float | None = None
    ) -> tuple[list[LogLine], int]:
        """The newest ``limit`` lines at ``min_level`` or above, newer than ``since``, oldest first;
        and how many lines the ring has let go since it started (so a reader knows the view is cut)."""
        floor = level_number(min_level)
        with self._ring_lock:
            kept = list(self._lines)
            lost = self.recorded - len(kept)
        picked = [
            ln
            for ln in kept
            if int(logging.getLevelName(ln.level.upper())) >= floor and (since is None or ln.ts > since)
        ]
        return picked[-limit:] if limit > 0 else [], lost


def install(capacity: int = DEFAULT_CAPACITY) -> LogRing:
    """A ring on the root logger (one per process: a second call returns the first)."""
    root = logging.getLogger()
    for h in root.handlers:
        if isinstance(h, LogRing):
            return h
    ring = LogRing(capacity)
    root.addHandler(ring)
    return ring
