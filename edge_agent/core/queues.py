"""Bounded hand-offs between pipeline stages, each with a named drop policy and a drop counter."""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class StopFlag(Protocol):
    """What a wait checks for stopping: a ``threading.Event``, or anything that reads like one."""

    def is_set(self) -> bool: ...


class DropOldestQueue(Generic[T]):
    """A bounded FIFO; when full, ``put`` discards the OLDEST item and counts it.

    Used between inference and publishing: fresh results matter more than stale ones, and the
    producer (the inference thread) must never block on a slow consumer.
    """

    policy = "drop_oldest"

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self.dropped = 0

    def put(self, item: T) -> bool:
        """Add ``item``; returns False when an older item had to be dropped for it."""
        with self._cond:
            lost = False
            if len(self._items) >= self.maxsize:
                self._items.popleft()
                self.dropped += 1
                lost = True
            self._items.append(item)
            self._cond.notify()
            return not lost

    def get(self, timeout: float | None = None) -> T | None:
        """The oldest item, waiting up to ``timeout`` seconds; None when nothing came."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            return self._items.popleft() if self._items else None

    def drain(self) -> list[T]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class LatestSlot(Generic[T]):
    """A one-slot buffer that keeps only the newest item (policy: replace the unconsumed one).

    A capture thread writes every frame here; the inference thread takes whatever is newest. A
    frame replaced before anyone took it is counted as dropped.
    """

    policy = "keep_newest"

    def __init__(self, wake: threading.Event | None = None) -> None:
        self._lock = threading.Condition()
        self._item: T | None = None
        self._latest: T | None = None
        self._wake = wake
        self.dropped = 0

    def put(self, item: T) -> bool:
        """Store ``item``; True when it replaced one nobody took (counted as dropped)."""
        with self._lock:
            replaced = self._item is not None
            if replaced:
                self.dropped += 1
            self._item = item
            self._latest = item
        if self._wake is not None:
            self._wake.set()
        return replaced

    def take(self) -> T | None:
        """The unconsumed item, if any; the slot is empty afterwards."""
        with self._lock:
            item, self._item = self._item, None
            self._lock.notify_all()
            return item

    def wait_taken(self, stop: StopFlag, poll_s: float = 0.1) -> bool:
        """Block until the slot is empty (back-pressure for recorded footage); False if stopped."""
        with self._lock:
            while self._item is not None:
                if stop.is_set():
                    return False
                self._lock.wait(poll_s)
        return not stop.is_set()

    @property
    def pending(self) -> bool:
        """Whether an item is waiting to be taken."""
        with self._lock:
            return self._item is not None

    def peek_latest(self) -> T | None:
        """The newest item ever put, consumed or not (for snapshots)."""
        with self._lock:
            return self._latest

    def clear(self) -> None:
        with self._lock:
            self._item = None
            self._lock.notify_all()


class HandoffQueue(Generic[T]):
    """A small bounded queue between two pipeline stages (policy: block the producer when full).

    Used where the producer reads from newest-frame slots: while it waits, the camera slots upstream
    keep replacing frames (and count those drops), so waiting here never builds a backlog of stale
    frames, and nothing prepared is thrown away.
    """

    policy = "block_producer"

    def __init__(self, maxsize: int = 1) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize
        self._items: deque[T] = deque()
        self._cond = threading.Condition()

    def put(self, item: T, stop: threading.Event, poll_s: float = 0.1) -> bool:
        """Wait for room, then enqueue; False (nothing enqueued) if ``stop`` is set first."""
        with self._cond:
            while len(self._items) >= self.maxsize:
                if stop.is_set():
                    return False
                self._cond.wait(poll_s)
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None = None) -> T | None:
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            if not self._items:
                return None
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def drain(self) -> list[T]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return items

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
