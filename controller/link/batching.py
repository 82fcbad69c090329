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
from typing import TypeVar

T = TypeVar("T")


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
