"""The resend timeout: the configured floor on a healthy link, the acks' own pace when they are slower."""

from __future__ import annotations

import pytest

from fleet_protocol.ack_timer import AckTimer


def test_fast_acks_keep_the_configured_timeout() -> None:
    t = AckTimer(10.0)
    assert t.timeout_s == 10.0, "no sample yet: the configured timeout"
    t.samples([0.05, 0.08, 0.04] * 50)
    assert t.timeout_s == 10.0, "a lost message on a healthy link is still sent again after 10 s"


def test_slow_acks_stretch_the_timeout_past_the_round_trip() -> None:
    t = AckTimer(10.0)
    t.samples([15.0 + (i % 5) * 0.5 for i in range(200)])
    # A message acked after 15-17 s must not come due before its ack could arrive.
    assert 17.0 < t.timeout_s < 25.0


def test_the_timeout_comes_back_down_when_the_acks_do() -> None:
    t = AckTimer(10.0)
    t.samples([30.0] * 100)
    assert t.timeout_s >= 30.0
    t.samples([0.1] * 100)
    assert t.timeout_s == 10.0


def test_the_timeout_is_capped() -> None:
    t = AckTimer(10.0, cap_s=60.0)
    t.samples([500.0] * 20)
    assert t.timeout_s == 60.0


def test_a_non_positive_floor_is_refused() -> None:
    with pytest.raises(ValueError):
        AckTimer(0.0)
