"""The leader-only loop every periodic leader worker runs on: rounds only while leading, ``FencedOut``
logged once per loss of the lead, a failing round logged once and its recovery said, and a stop that
never waits out an interval."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from sqlmodel import Session

from controller.db.leader import FencedOut, LeaderGuard, LeaderLoop
from tests.support.waiting import wait_for


class Lead:
    def __init__(self, leading: bool = True) -> None:
        self.leading = leading

    @property
    def replica_id(self) -> str:
        return "r1"

    def is_leader(self) -> bool:
        return self.leading

    def fence(self, session: Session) -> None:
        return None


def test_a_guarded_round_runs_only_while_leading_and_says_so_once_per_loss(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lead, lost = Lead(leading=False), []
    guard = LeaderGuard("the work", lead, on_lost=lambda: lost.append(1))
    assert guard.run(lambda: "done", otherwise="skipped") == "skipped" and lost == [1]

    def fenced() -> str:
        raise FencedOut("another replica leads")

    lead.leading = True
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        assert guard.run(fenced, otherwise="skipped") == "skipped"
    assert [r.getMessage() for r in caplog.records] == ["the work stopped: another replica leads"]
    assert len(lost) == 4
    assert guard.run(lambda: "done", otherwise="skipped") == "done"
    guard.run(fenced, otherwise="skipped")  # a new loss of the lead: said again
    assert len(caplog.records) == 2


def test_a_failing_round_is_logged_once_and_its_recovery_said(caplog: pytest.LogCaptureFixture) -> None:
    stop, rounds = threading.Event(), []

    def tick() -> None:
        rounds.append(1)
        if 2 <= len(rounds) <= 4:
            raise RuntimeError("database down")

    loop = LeaderLoop(
        "test-leader-loop",
        tick,
        interval_s=0.01,
        first_after_s=0.0,
        leadership=Lead(),
        stop=stop,
        what="work",
    )
    caplog.set_level(logging.INFO)
    loop.start()
    wait_for(lambda: len(rounds) >= 6, timeout=5, what="six rounds")
    stop.set()
    loop.join(5)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == ["work failed", "work recovered after 3 failed round(s)"], said


def test_a_stop_ends_the_wait_at_once_and_a_follower_never_ticks() -> None:
    stop, rounds = threading.Event(), []
    loop = LeaderLoop(
        "test-leader-loop",
        lambda: rounds.append(1),
        interval_s=3600,
        first_after_s=0.0,
        leadership=Lead(leading=False),
        stop=stop,
        what="work",
    )
    loop.start()
    assert any(t.name == "test-leader-loop" for t in threading.enumerate())
    time.sleep(0.1)
    started = time.monotonic()
    stop.set()
    loop.join(5)
    assert time.monotonic() - started < 2
    assert not any(t.name == "test-leader-loop" for t in threading.enumerate())
    assert rounds == []
