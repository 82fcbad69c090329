"""Group commit: a writer thread takes what its queue holds, and what arrives shortly after.

Each ingest or status transaction costs a fixed few database round trips and a few hundred
microseconds of SQLAlchemy, whatever it holds. Committing as soon as one message is there made that
fixed cost per message at moderate load (a commit of 1-5 messages), and on a shared machine that CPU
is taken from the broker and the database. Waiting ``linger_s`` for more (Kafka's ``linger.ms``, a
database's group commit) turns it into a cost per batch: measured in ``bench/fleet.py``.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class FairQueue(queue.Queue[T]):
    """A bounded queue served in turn between keys (devices), first in first out within a key.

    One writer serves the whole fleet: in arrival order, a device that queued a thousand messages puts
    all of them ahead of the next device's one, whose ack then waits for the thousand. In turns, every
    device with something queued gets one message into each batch before any device gets its second,
    so a device's wait depends on how many devices are busy, not on how much one of them sent.
    (``queue.Queue`` is built to be specialised through ``_init``/``_put``/``_get``, as
    ``PriorityQueue`` is.)
    """

    def __init__(self, maxsize: int, key: Callable[[T], Hashable]) -> None:
        self._key = key
        super().__init__(maxsize)

    def _init(self, maxsize: int) -> None:
        self._lanes: dict[Hashable, deque[T]] = {}
        self._turns: deque[Hashable] = deque()
        self._count = 0

    def _qsize(self) -> int:
        return self._count

    def _put(self, item: T) -> None:
        key = self._key(item)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = deque()
            self._turns.append(key)
        lane.append(item)
        self._count += 1

    def _get(self) -> T:
        key = self._turns.popleft()
        lane = self._lanes[key]
        item = lane.popleft()
        self._count -= 1
        if lane:
            self._turns.append(key)
        else:
            del self._lanes[key]
        return item


def take_batch(q: queue.Queue[T], first: T, *, max_items: int, linger_s: float) -> list[T]:
    """``first`` and whatever ``q`` holds or receives within ``linger_s`` of now, up to ``max_items``.

    Returns at once when the queue already holds ``max_items``: under load the batch fills without
    waiting, so lingering only ever delays a message when there is little to do.
    """
    batch = [first]
    deadline = time.monotonic() + linger_s
    while len(batch) < max_items:
        try:
            batch.append(q.get_nowait())
            continue
        except queue.Empty:
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            batch.append(q.get(timeout=remaining))
        except queue.Empty:
            break
    return batch
