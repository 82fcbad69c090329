"""The agent's data folder refusing writes (disk full, folder read-only, device failing): reported, not fatal.

What the agent writes (the outbox, the desired state) may meet a disk that takes no writes. Such a
failure must not kill a thread, loop, or pass unnoticed: the part that met it tells the
:class:`DiskGuard`, which reports it once as an ERROR event (``data["check"] == "storage"``,
``state`` ``failing``), retries the write once the disk takes writes again (the probe, on the
publisher thread) and reports that too (``state`` ``recovered``, with what the part held or dropped
meanwhile).

An event is itself a write (into the outbox), so a full disk would swallow the very event that says it
is full. The agent therefore keeps a :class:`Reserve`: a file of 1 MiB in the data folder,
released at the first failure so that the failing event fits, and put back only when the disk has
room for it twice over (hysteresis: a disk hovering at full does not make the agent flap between
failing and recovered). A read-only folder leaves no room at all: the event is held in memory and
written, with its original time, when the folder takes writes again.

The outbox's recovered event carries what its failure cost: ``held_batches`` / ``held_frames`` /
``held_events`` went to memory meanwhile, ``dropped_*`` of those the memory bound dropped; the rest
were written (numbered between the failing and the recovered event) once the disk took writes.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet_protocol.messages import EventKind, Severity

log = logging.getLogger(__name__)

RESERVE_BYTES = 2**20
PROBE_INTERVAL_S = 1.0
CHECK = "storage"  # Event data["check"] of every storage event

# Emits one event: (kind, severity, message, data). The publisher's, which never raises on a refused write.
EmitFn = Callable[[EventKind, Severity, str, dict[str, Any]], None]
# Writes again what failed; returns figures for the recovered event; raises OSError while it still fails.
RetryFn = Callable[[], dict[str, Any] | None]


def errno_name(code: int) -> str:
    return errno.errorcode.get(code, str(code))


class Reserve:
    """A file of ``size`` bytes that holds room on the data disk for the events that say it is full."""

    def __init__(self, path: Path, size: int = RESERVE_BYTES) -> None:
        self.path = path
        self.size = size

    def present(self) -> bool:
        try:
            return self.path.stat().st_size >= self.size
        except OSError:
            return False

    def ensure(self) -> None:
        """Allocate the file (blocks really taken, not a sparse file); raises OSError when it cannot."""
        if self.present():
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                try:
                    os.posix_fallocate(fd, 0, self.size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.pwrite(fd, bytes(self.size), 0)  # a filesystem without fallocate: write zeros
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            self.release()  # a partial reserve would hold room without vouching for it
            raise

    def release(self) -> bool:
        """Give the room back to the disk; True when there was a reserve to give."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:  # a read-only folder: nothing can be freed there anyway
            log.debug("cannot release %s: %s", self.path, exc)
            return False
        return True

    def room_to_restore(self) -> bool:
        """The disk has room for the reserve twice over (the hysteresis of the module docstring)."""
        try:
            return shutil.disk_usage(self.path.parent).free >= 2 * self.size
        except OSError:
            return False


@dataclass
class _Trouble:
    what: str  # the part that failed: "outbox", "desired_state"
    path: Path
    errno: int
    error: str
    since: float  # monotonic
    failures: int = 1
    retry: RetryFn | None = None
    # What retries that wrote but did not end the trouble (a write refused meanwhile) said: the part
    # has handed those figures over, so they go into the recovery that is reported at last.
    figures: dict[str, Any] = field(default_factory=dict)


class DiskGuard:
    """Storage failures by part, reported once each, retried by :meth:`probe` until they clear."""

    def __init__(
        self, emit: EmitFn, *, reserve: Reserve | None = None, probe_interval_s: float = PROBE_INTERVAL_S
    ) -> None:
        self._emit = emit
        self.reserve = reserve
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self._troubles: dict[str, _Trouble] = {}
        self._next_probe = 0.0
        # For diagnostics and tests: every refused write, per errno name ("ENOSPC": 3), since the start.
        self.errors: dict[str, int] = {}

    def start(self) -> None:
        """Take the reserve (at agent start); a disk already full only gets a warning here. Not when a
        write was refused already (the agent's first event comes before this): the reserve was given
        for its report, and comes back with the probe, once there is room for it twice over."""
        if self.reserve is None or self.failing():
            return
        try:
            self.reserve.ensure()
        except OSError as exc:
            log.warning("no room for the storage reserve %s: %s", self.reserve.path, exc)

    # ------------------------------------------------------------------ reports (any thread)

    def failed(self, what: str, path: Path, exc: OSError, *, retry: RetryFn | None = None) -> None:
        """``what`` could not write ``path``. The first failure of a part is reported by an event; later
        ones are counted. ``retry`` (the newest given wins) writes again once the disk takes writes."""
        code = exc.errno if exc.errno is not None else errno.EIO
        with self._lock:
            name = errno_name(code)
            self.errors[name] = self.errors.get(name, 0) + 1
            trouble = self._troubles.get(what)
            if trouble is not None:
                trouble.failures += 1
                if retry is not None:
                    trouble.retry = retry
                return
            trouble = _Trouble(what, path, code, _describe(exc), time.monotonic(), retry=retry)
            self._troubles[what] = trouble
            self._next_probe = time.monotonic() + self.probe_interval_s
        message = f"cannot write {what} at {path}: {trouble.error}"
        log.error("%s; retrying every %.0f s", message, self.probe_interval_s)
        if self.reserve is not None and self.reserve.release():
            log.warning("released the storage reserve %s to report it", self.reserve.path)
        self._emit(EventKind.ERROR, Severity.ERROR, message, self._data(trouble, "failing"))

    def cleared(self, what: str, extra: dict[str, Any] | None = None) -> None:
        """``what`` wrote again on its own: report the recovery (nothing when it was not failing)."""
        with self._lock:
            trouble = self._troubles.pop(what, None)
        if trouble is not None:
            self._report_recovered(trouble, extra)

    def failing(self, what: str | None = None) -> bool:
        with self._lock:
            return bool(self._troubles) if what is None else what in self._troubles

    def status(self) -> dict[str, Any]:
        """What fails now and since when (for diagnostics)."""
        now = time.monotonic()
        with self._lock:
            return {
                "failing": {
                    t.what: {
                        "path": str(t.path),
                        "errno": t.errno,
                        "errno_name": errno_name(t.errno),
                        "failing_s": round(now - t.since, 1),
                        "failures": t.failures,
                    }
                    for t in self._troubles.values()
                },
                "errors": dict(self.errors),
            }

    # ------------------------------------------------------------------ probe (publisher thread)

    def probe_due(self, now: float) -> bool:
        with self._lock:
            return bool(self._troubles) and now >= self._next_probe

    def probe(self) -> None:
        """Once the disk takes writes again (the reserve is back), retry each failed part; report each
        that succeeds. A retry that fails again keeps its part failing, quietly."""
        with self._lock:
            self._next_probe = time.monotonic() + self.probe_interval_s
            troubles = list(self._troubles.values())
        if not troubles:
            return
        reserve = self.reserve
        if reserve is not None and not reserve.present():
            if not reserve.room_to_restore():
                return
            try:
                reserve.ensure()
            except OSError as exc:  # read-only, or the room went while it was written
                log.debug("storage reserve not restored: %s", exc)
                return
        for trouble in troubles:
            if trouble.retry is None:
                continue  # cleared by its part (:meth:`cleared`) when it writes again
            with self._lock:
                before = trouble.failures
            try:
                extra = _merged(trouble.figures, trouble.retry())
            except OSError as exc:
                with self._lock:
                    trouble.failures += 1
                    name = errno_name(exc.errno if exc.errno is not None else errno.EIO)
                    self.errors[name] = self.errors.get(name, 0) + 1
                log.debug("%s still cannot be written: %s", trouble.what, exc)
                continue
            with self._lock:
                # A write of that part refused while it retried (another thread) keeps it failing.
                if self._troubles.get(trouble.what) is not trouble or trouble.failures != before:
                    trouble.figures = extra
                    continue
                del self._troubles[trouble.what]
            self._report_recovered(trouble, extra)

    # ------------------------------------------------------------------ events

    def _report_recovered(self, trouble: _Trouble, extra: dict[str, Any] | None) -> None:
        data = self._data(trouble, "recovered")
        data["failed_s"] = round(time.monotonic() - trouble.since, 1)
        data.update(extra or {})
        lost = any(v for k, v in data.items() if k.startswith("dropped_"))
        message = (
            f"{trouble.what} at {trouble.path} written again after {data['failed_s']:g} s "
            f"({errno_name(trouble.errno)}, {trouble.failures} refused writes)"
        )
        held = {k[len("held_") :]: v for k, v in data.items() if k.startswith("held_")}
        if held:
            dropped = {k[len("dropped_") :]: v for k, v in data.items() if k.startswith("dropped_")}
            message += f"; held in memory meanwhile: {_counts(held)}; dropped: {_counts(dropped) or 'none'}"
        if lost:
            log.warning("%s", message)
        else:
            log.info("%s", message)
        self._emit(EventKind.ERROR, Severity.WARNING if lost else Severity.INFO, message, data)

    @staticmethod
    def _data(trouble: _Trouble, state: str) -> dict[str, Any]:
        return {
            "check": CHECK,
            "state": state,
            "what": trouble.what,
            "path": str(trouble.path),
            "errno": trouble.errno,
            "errno_name": errno_name(trouble.errno),
            "error": trouble.error,
            "failures": trouble.failures,
        }


def _merged(before: dict[str, Any], after: dict[str, Any] | None) -> dict[str, Any]:
    """Two retries' figures as one: counts add up, anything else is the later one's."""
    out = dict(before)
    for k, v in (after or {}).items():
        old = out.get(k)
        numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (old, v))
        out[k] = old + v if numbers else v
    return out


def _describe(exc: OSError) -> str:
    """The cause in words a technician acts on: a full disk and a read-only folder are named so."""
    text = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        return f"disk full: {text}"
    if exc.errno == errno.EROFS:
        return f"folder is read-only: {text}"
    return text


def _counts(counts: dict[str, Any]) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items() if v)
