from __future__ import annotations

from controller.link.artifacts import FrameCache


def test_frames_are_evicted_least_recently_used_past_the_byte_budget() -> None:
    cache = FrameCache(max_bytes=30)
    cache.put(("a", 10, 0), b"x" * 10)
    cache.put(("a", 10, 1), b"y" * 10)
    cache.put(("a", 10, 2), b"z" * 10)
    assert cache.get(("a", 10, 0)) == b"x" * 10  # now the most recently used
    cache.put(("a", 10, 3), b"w" * 10)  # over budget: chunk 1 (least recently used) goes
    assert cache.get(("a", 10, 1)) is None
    assert cache.get(("a", 10, 0)) is not None and cache.get(("a", 10, 3)) is not None


def test_a_frame_larger_than_the_budget_is_not_cached_and_drop_forgets_an_artifact() -> None:
    cache = FrameCache(max_bytes=8)
    cache.put(("a", 10, 0), b"x" * 9)
    assert cache.get(("a", 10, 0)) is None
    cache.put(("a", 4, 0), b"1234")
    cache.put(("b", 4, 0), b"5678")
    cache.drop("a")
    assert cache.get(("a", 4, 0)) is None and cache.get(("b", 4, 0)) == b"5678"
