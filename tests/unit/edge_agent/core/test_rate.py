"""The token bucket that bounds a camera's track and zone events (edge_agent/core/rate.py)."""

from __future__ import annotations

from edge_agent.core.rate import TokenBucket


def test_a_full_bucket_spends_its_minute_at_once_then_refills_continuously_up_to_its_size() -> None:
    clock = [0.0]
    bucket = TokenBucket(6, clock=lambda: clock[0])  # one token every 10 s
    assert [bucket.take() for _ in range(7)] == [True] * 6 + [False]
    clock[0] = 9.0
    assert not bucket.take(), "a token is not there before its 10 s"
    clock[0] = 10.0
    assert bucket.take() and not bucket.take()
    clock[0] = 10.0 + 3600.0  # an hour of quiet saves no more than a minute's budget
    assert [bucket.take() for _ in range(7)] == [True] * 6 + [False]
