"""The retry/restart policy (edge_agent.core.restart_policy) on a fake clock: no waiting."""

from __future__ import annotations

import pytest

from edge_agent.core.restart_policy import RestartLimiter, WatchdogAction, capped_backoff
from edge_agent.core.settings import SettingsError, parse_settings


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_capped_backoff_doubles_from_min_up_to_max() -> None:
    assert [capped_backoff(n, 0.5, 4.0) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert capped_backoff(10_000, 0.5, 4.0) == 4.0  # no overflow after a long outage
    assert capped_backoff(0, 0.5, 4.0) == 0.0


def limiter(clock: FakeClock) -> RestartLimiter:
    return RestartLimiter(max_restarts=2, window_s=60.0, backoff_min_s=5.0, backoff_max_s=20.0, clock=clock)


def test_restarts_are_limited_per_window_then_failed_with_capped_backoff() -> None:
    clock = FakeClock()
    lim = limiter(clock)
    assert lim.on_hang().action == WatchdogAction.RESTARTED
    clock.now += 1
    second = lim.on_hang()
    assert second.action == WatchdogAction.RESTARTED and second.restarts_in_window == 2
    waits = []
    for _ in range(4):
        clock.now += 1
        d = lim.on_hang()
        assert d.action == WatchdogAction.FAILED and lim.failed
        waits.append(d.retry_in_s)
        assert d.retry_in_s is not None
        clock.now += d.retry_in_s - 0.001
        assert not lim.retry_due()
        clock.now += 0.001
        assert lim.retry_due()
        lim.retrying()
    assert waits == [5.0, 10.0, 20.0, 20.0]


def test_a_run_that_completes_after_a_retry_ends_the_failure_streak() -> None:
    clock = FakeClock()
    lim = limiter(clock)
    lim.on_hang()
    lim.on_hang()
    assert lim.on_hang().retry_in_s == 5.0
    assert not lim.healthy(), "not recovered while waiting to retry"
    clock.now += 5
    lim.retrying()
    assert lim.healthy() and not lim.healthy(), "recovered once"
    # Still two restarts in the window: the next hang fails at once, from the shortest wait again.
    assert lim.on_hang().retry_in_s == 5.0
    # Once the window has passed, hangs restart at once again.
    clock.now += 61
    lim.retrying()
    assert lim.on_hang().action == WatchdogAction.RESTARTED


def test_an_operator_restart_makes_the_retry_due_at_once() -> None:
    clock = FakeClock()
    lim = limiter(clock)
    lim.on_hang()
    lim.on_hang()
    lim.on_hang()
    assert not lim.retry_due()
    lim.retry_now()
    assert lim.retry_due()


@pytest.mark.parametrize("max_restarts", [1, 3])
def test_never_more_restarts_in_a_window_than_allowed(max_restarts: int) -> None:
    clock = FakeClock()
    lim = RestartLimiter(
        max_restarts=max_restarts, window_s=60.0, backoff_min_s=1.0, backoff_max_s=1.0, clock=clock
    )
    restarts = []
    for _ in range(200):  # a model hanging every 0.5 s for 100 s
        clock.now += 0.5
        if lim.failed:
            if not lim.retry_due():
                continue
            lim.retrying()
        if lim.on_hang().action == WatchdogAction.RESTARTED:
            restarts.append(clock.now)
    for t in restarts:
        assert sum(1 for u in restarts if t - 60.0 < u <= t) <= max_restarts


def test_watchdog_settings_are_validated() -> None:
    base = {"device_id": "d1", "data_dir": "/tmp/x"}
    inf = parse_settings({**base, "inference": {"hang_timeout_s": 5, "max_restarts": 2}}, env={}).inference
    assert (inf.hang_timeout_s, inf.max_restarts, inf.restart_backoff_min_s) == (5.0, 2, 10.0)
    with pytest.raises(SettingsError, match="restart_backoff_max_s must be >= restart_backoff_min_s"):
        parse_settings(
            {**base, "inference": {"restart_backoff_min_s": 60, "restart_backoff_max_s": 5}}, env={}
        )
    with pytest.raises(SettingsError, match=r"inference\.hang_timeout_s"):
        parse_settings({**base, "inference": {"hang_timeout_s": 0}}, env={})
