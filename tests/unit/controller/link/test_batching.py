"""The writers' queue: served in turn between devices, in order within a device, bounded."""

from __future__ import annotations

import queue

import pytest

from controller.link.batching import FairQueue, take_batch


def _device(item: tuple[str, int]) -> str:
    return item[0]


def test_a_device_with_a_backlog_does_not_hold_up_the_next_device() -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(10_000, key=_device)
    for i in range(1000):
        q.put_nowait(("flood", i))
    q.put_nowait(("steady", 0))

    batch = take_batch(q, q.get_nowait(), max_items=10, linger_s=0.0)

    # The steady device's one message is in the first batch, not behind the thousand.
    assert ("steady", 0) in batch
    # Each device's own messages keep their order.
    flood = [n for d, n in batch if d == "flood"]
    assert flood == sorted(flood) == list(range(len(flood)))
    rest = [q.get_nowait() for _ in range(q.qsize())]
    assert [n for _, n in rest] == list(range(len(flood), 1000))


def test_turns_go_round_every_device_with_something_queued() -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(100, key=_device)
    for d in ("a", "b", "c"):
        for i in range(3):
            q.put_nowait((d, i))
    order = [q.get_nowait() for _ in range(9)]
    assert order == [(d, i) for i in range(3) for d in ("a", "b", "c")]
    with pytest.raises(queue.Empty):
        q.get_nowait()


def test_the_queue_stays_bounded_across_devices() -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(4, key=_device)
    for i in range(4):
        q.put_nowait((f"d{i}", i))
    with pytest.raises(queue.Full):
        q.put_nowait(("d9", 9))
    assert q.qsize() == 4
