"""Poll for a condition with a deadline: the only way tests here wait for something."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

FIRST_INTERVAL_S = 0.01


def wait_for(
    check: Callable[[], T | None],
    timeout: float = 10.0,
    what: str = "a condition",
    *,
    interval: float = 0.2,
    log: Path | None = None,
) -> T:
    """Call ``check`` until it returns something truthy and return that; fail with ``what`` after
    ``timeout`` s.

    The first polls come 10 ms apart and the pause doubles up to ``interval``: an in-process
    condition is seen within milliseconds, a wait on a process does not hammer it. An exception
    from ``check`` counts as "not yet" (a process may still be starting) and is named in the
    failure. ``log``: a process's log file whose tail the failure carries.
    """
    deadline = time.monotonic() + timeout
    pause = min(FIRST_INTERVAL_S, interval)
    last_exc: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # a check may fail while a process is still starting
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            message = f"timed out after {timeout}s waiting for {what}{detail}"
            if log is not None:
                tail = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
                message += f"\n--- log tail of {log} ---\n{tail}"
            raise AssertionError(message)
        time.sleep(pause)
        pause = min(pause * 2, interval)
