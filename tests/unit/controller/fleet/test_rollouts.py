"""The rollout engine's decision function (pure), and the operator's actions through the API."""

from __future__ import annotations

import pytest

from controller.fleet.gate import (
    Admit,
    Advance,
    Finish,
    GateConfig,
    GateResult,
    Settle,
    parse_wave,
    plan_waves,
    step,
)
from tests.support.rollout_views import T0, M, dev, member, ro, running

FLEET = {f"d{i}": dev(f"d{i}") for i in range(1, 6)}


def test_wave_plans_are_cumulative_with_at_least_one_device_each() -> None:
    assert plan_waves([1, "10%", "50%", "100%"], 5) == [1, 2, 3, 5]
    assert plan_waves([1, "10%", "50%", "100%"], 100) == [1, 10, 50, 100]
    assert plan_waves([1, "10%", "50%", "100%"], 1) == [1]
    assert plan_waves([1, "100%"], 0) == []
    assert plan_waves([3, 2, "100%"], 4) == [3, 4]
    for bad in (0, "0%", "101%", "x", "-1", True):
        with pytest.raises(ValueError):
            parse_wave(bad)
    assert parse_wave("7") == 7 and parse_wave(" 10% ") == "10%"


def test_first_step_admits_the_canary_only() -> None:
    assert step(ro(), FLEET, T0) == [Admit("d1", 0)]


def test_non_matching_devices_are_never_admitted() -> None:
    devices = {**FLEET, "d1": dev("d1", matches=False)}
    assert step(ro(), devices, T0) == [Admit("d2", 0)]


def test_activation_needs_the_published_version_and_the_model_running() -> None:
    r = ro({"d1": member("d1")})
    assert step(r, {"d1": dev("d1", **running(version=4))}, T0 + 1) == []
    other = running()
    other["reported"] = {"cam1": {"model": "tiny:1", "state": "running"}}
    assert step(r, {"d1": dev("d1", **other)}, T0 + 1) == []
    assert step(r, {"d1": dev("d1", **running())}, T0 + 1) == [Settle("d1", "active")]


def test_a_failed_camera_fails_the_device_and_the_gate() -> None:
    r = ro({"d1": member("d1")})
    rep = running()
    rep["reported"] = {"cam1": {"model": M, "state": "failed", "error": "non-finite output"}}
    actions = step(r, {**FLEET, "d1": dev("d1", **rep)}, T0 + 1)
    assert actions[0] == Settle("d1", "failed", "camera cam1 failed: non-finite output")
    assert isinstance(actions[1], GateResult) and not actions[1].passed
    assert actions[1].figures["failed"] == ["d1"]
    assert isinstance(actions[2], Finish) and actions[2].state == "failed"
    assert "d1" in actions[2].reason


def test_step_timeout_and_offline_turn_into_failures_with_reasons() -> None:
    r = ro({"d1": member("d1")})
    assert step(r, {"d1": dev("d1")}, T0 + 59) == []
    late = step(r, {"d1": dev("d1")}, T0 + 61)
    assert (
        isinstance(late[0], Settle)
        and late[0].state == "failed"
        and "not active after 60s" in str(late[0].reason)
    )
    off = dev("d1", online=False, offline_since=T0 + 5)
    assert step(r, {"d1": off}, T0 + 24) == []
    gone = step(r, {"d1": off}, T0 + 26)
    assert isinstance(gone[0], Settle) and "offline for 21s" in str(gone[0].reason)


def test_failures_within_the_allowed_ratio_pass_the_gate() -> None:
    gate = GateConfig(soak_s=0, max_failure_ratio=0.5)
    members = {"d2": member("d2", 1, "active", settled_at=T0), "d3": member("d3", 1, "failed", settled_at=T0)}
    r = ro(members, current_wave=1, gate=gate, plan=(1, 3, 5))
    devices = {"d2": dev("d2", **running()), "d3": dev("d3")}
    actions = step(r, devices, T0 + 1)
    assert [type(a) for a in actions] == [GateResult, Advance]
    assert (
        isinstance(actions[0], GateResult)
        and actions[0].passed
        and actions[0].figures["failure_ratio"] == 0.5
    )


def test_gate_waits_for_the_soak_then_judges_fps_against_the_baseline() -> None:
    r = ro({"d1": member("d1", state="active", settled_at=T0)})
    assert step(r, {"d1": dev("d1", **running(fps=2.0))}, T0 + 9) == []
    slow = step(r, {"d1": dev("d1", **running(fps=2.0))}, T0 + 11)
    assert isinstance(slow[0], GateResult) and not slow[0].passed
    assert slow[0].figures["fps_ratio"] == {"d1": 0.2} and "FPS fell below 0.5" in slow[0].reason
    assert isinstance(slow[1], Finish) and slow[1].state == "failed"
    ok = step(r, {"d1": dev("d1", **running(fps=9.0))}, T0 + 11)
    assert isinstance(ok[0], GateResult) and ok[0].passed and ok[1] == Advance(1)


def test_latency_bound() -> None:
    gate = GateConfig(soak_s=0, max_latency_ms=50)
    r = ro({"d1": member("d1", state="active", settled_at=T0)}, gate=gate)
    bad = step(r, {"d1": dev("d1", **running(ms=80.0))}, T0 + 1)
    assert isinstance(bad[0], GateResult) and not bad[0].passed and "latency over 50 ms" in bad[0].reason
    good = step(r, {"d1": dev("d1", **running(ms=30.0))}, T0 + 1)
    assert isinstance(good[0], GateResult) and good[0].passed


def test_next_wave_admits_up_to_its_cumulative_count_and_the_last_takes_all() -> None:
    members = {"d1": member("d1", state="active", settled_at=T0)}
    r = ro(members, current_wave=1, gated_waves=frozenset({0}))
    assert step(r, FLEET, T0 + 1) == [Admit("d2", 1), Admit("d3", 1)]
    members.update({d: member(d, 1, "active", settled_at=T0) for d in ("d2", "d3")})
    fleet = {**FLEET, "d6": dev("d6")}  # appeared during the rollout
    r = ro(members, current_wave=2, gated_waves=frozenset({0, 1}))
    assert step(r, fleet, T0 + 1) == [Admit("d4", 2), Admit("d5", 2), Admit("d6", 2)]


def test_last_wave_passing_finishes_the_rollout() -> None:
    r = ro({"d1": member("d1", state="active", settled_at=T0)}, plan=(1,))
    actions = step(r, {"d1": dev("d1", **running())}, T0 + 11)
    assert isinstance(actions[0], GateResult) and actions[1] == Finish(
        "succeeded", "every wave passed its gate"
    )


def test_no_matching_device_finishes_at_once() -> None:
    assert step(ro(plan=()), {}, T0) == [Finish("succeeded", "every wave passed its gate")]


def test_paused_admits_nothing_but_keeps_checking() -> None:
    assert step(ro(state="paused"), FLEET, T0) == []
    r = ro({"d1": member("d1")}, state="paused")
    assert step(r, {"d1": dev("d1", **running())}, T0 + 1) == [Settle("d1", "active")]


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled", "rolled_back"])
def test_finished_rollouts_do_nothing(state: str) -> None:
    assert step(ro({"d1": member("d1")}, state=state), FLEET, T0 + 1000) == []


def test_more_than_three_restarts_since_admission_is_a_crash_loop() -> None:
    r = ro({"d1": member("d1", state="active", settled_at=T0)})
    three = dev("d1", **running(), restarts=(T0 - 5, T0 + 1, T0 + 2, T0 + 3))
    assert step(r, {"d1": three}, T0 + 5) == []
    four = dev("d1", **running(), restarts=(T0 + 1, T0 + 2, T0 + 3, T0 + 4))
    actions = step(r, {"d1": four}, T0 + 5)
    assert actions[0] == Settle("d1", "failed", "crash loop: the agent restarted 4 times since admission")
    assert isinstance(actions[-1], Finish) and actions[-1].state == "failed"


def test_an_engine_build_that_moves_is_waited_for_past_the_step_timeout() -> None:
    # A first TensorRT build on a device outlasts step_timeout_s (60 s here) while it reports
    # progress; it fails only when silent for build_stall_s or past build_timeout_s.
    gate = GateConfig(
        soak_s=10, step_timeout_s=60, build_stall_s=30, build_timeout_s=600, offline_timeout_s=20
    )
    r = ro({"d1": member("d1")}, gate=gate)
    loading = {
        "reported_version": 5,
        "reported": {"cam1": {"model": M, "state": "loading", "progress_pct": 40.0}},
    }
    assert step(r, {"d1": dev("d1", build_active_at=T0 + 100, **loading)}, T0 + 120) == []
    stalled = step(r, {"d1": dev("d1", build_active_at=T0 + 100, **loading)}, T0 + 131)
    assert isinstance(stalled[0], Settle) and stalled[0].state == "failed"
    assert "engine build made no progress for 31.0s" in str(stalled[0].reason)
    too_long = step(r, {"d1": dev("d1", build_active_at=T0 + 599, **loading)}, T0 + 601)
    assert isinstance(too_long[0], Settle) and "engine build not done after 600s" in str(too_long[0].reason)
    # No build seen (a stuck download): the step timeout holds as before.
    plain = step(r, {"d1": dev("d1", **loading)}, T0 + 61)
    assert isinstance(plain[0], Settle) and "not active after 60s" in str(plain[0].reason)
