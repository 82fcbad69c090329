"""A device's clock offset, estimated from its heartbeats, in the device view: flagged beyond the threshold."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from controller.observe.clock import clock_offset
from fleet_protocol import TopicKind
from fleet_protocol.messages import Heartbeat
from tests.support.controller_app import Fleet, FleetFactory, enroll
from tests.support.waiting import wait_for


def beats_until_seen(fleet: Fleet, device: str, ahead_s: float, count: int = 3) -> dict[str, object]:
    """Send ``count`` heartbeats stamped ``ahead_s`` off the real clock; the device view once they are stored."""
    sent_before = time.time()
    for _ in range(count):
        fleet.send(device, TopicKind.HEARTBEAT, Heartbeat(ts=time.time() + ahead_s, uptime_s=1.0))
    sent = sent_before + ahead_s

    def seen() -> bool:
        health = fleet.device(device).get("last_health") or {}
        return isinstance(health.get("ts"), float) and health["ts"] >= sent

    wait_for(seen, timeout=10, what="the heartbeat stored")
    return fleet.device(device)


def test_a_device_five_seconds_ahead_is_flagged_and_one_in_sync_is_not(make_fleet: FleetFactory) -> None:
    fleet = make_fleet()
    assert fleet.client.post("/api/v1/devices", json={"id": "ahead"}).status_code == 201
    enroll(fleet, "insync")
    assert fleet.device("ahead")["clock_offset_s"] is None  # no heartbeat yet: no guess
    assert fleet.device("ahead")["clock_off"] is False

    ahead = beats_until_seen(fleet, "ahead", 5.0)
    insync = beats_until_seen(fleet, "insync", 0.0)

    assert ahead["clock_off"] is True
    assert isinstance(ahead["clock_offset_s"], float) and 4.0 < ahead["clock_offset_s"] <= 5.0
    assert insync["clock_off"] is False
    assert isinstance(insync["clock_offset_s"], float) and abs(insync["clock_offset_s"]) < 1.0


def test_the_threshold_is_a_setting(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(clock_off_threshold_s=10.0)
    assert fleet.client.post("/api/v1/devices", json={"id": "ahead"}).status_code == 201
    view = beats_until_seen(fleet, "ahead", 5.0)
    assert view["clock_off"] is False and isinstance(view["clock_offset_s"], float)


def test_the_fastest_heartbeat_wins_and_a_late_one_raises_no_alarm() -> None:
    at = datetime(2025, 1, 1, tzinfo=UTC)
    t = at.timestamp()
    # Three heartbeats from a clock 0.5 s ahead, delayed 0.2, 0.05 and 30 s (held up by a reconnect).
    beats = [(at, {"ts": t + 0.5 - 0.2}), (at, {"ts": t + 0.5 - 0.05}), (at, {"ts": t + 0.5 - 30})]
    assert clock_offset(beats) == 0.45
    # What an older or broken payload carries is skipped, not a crash.
    assert clock_offset([(at, {}), (at, {"ts": "x"}), (at, {"ts": True}), (at, {"ts": float("nan")})]) is None
