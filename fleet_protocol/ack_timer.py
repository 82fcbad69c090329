"""How long a device waits for an ``Ack`` before sending a message again: RFC 6298's estimator.

A fixed timeout turns an overloaded controller into a collapsing one: once storing takes longer than
the timeout, every unacked message is sent a second time, the controller has twice the work, acks
come later still, and the fleet ends up sending everything twice (BENCHMARKS.md, "Controller
replicas", has the fleet runs that show it). TCP's answer holds here: time the acks, and wait for the
smoothed round trip plus four deviations.

The configured timeout is the floor, so on a healthy link a lost message is sent again after
``ack_timeout_s``; only while acks are slower than that does the wait grow with
them, up to ``cap_s``. Samples come only from messages sent once (Karn's rule: the ack of a resent
message cannot say which send it answers). The agent's publisher and the fleet simulator use it.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_CAP_S = 120.0


class AckTimer:
    """Smoothed publish->ack time of one device's messages and the resend timeout it gives."""

    __slots__ = ("cap_s", "floor_s", "rttvar_s", "srtt_s")

    def __init__(self, floor_s: float, cap_s: float = DEFAULT_CAP_S) -> None:
        if floor_s <= 0:
            raise ValueError("the ack timeout must be above 0")
        self.floor_s = floor_s
        self.cap_s = max(cap_s, floor_s)
        self.srtt_s: float | None = None
        self.rttvar_s = 0.0

    def sample(self, rtt_s: float) -> None:
        """One message sent once, acked ``rtt_s`` after it was sent."""
        rtt = max(0.0, rtt_s)
        if self.srtt_s is None:
            self.srtt_s, self.rttvar_s = rtt, rtt / 2
            return
        self.rttvar_s = 0.75 * self.rttvar_s + 0.25 * abs(self.srtt_s - rtt)
        self.srtt_s = 0.875 * self.srtt_s + 0.125 * rtt

    def samples(self, rtts: Iterable[float]) -> None:
        for rtt in rtts:
            self.sample(rtt)

    @property
    def timeout_s(self) -> float:
        """Send an unacked message again once it has waited this long."""
        if self.srtt_s is None:
            return self.floor_s
        return min(self.cap_s, max(self.floor_s, self.srtt_s + 4 * self.rttvar_s))
