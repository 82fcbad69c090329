"""The rollout gate counts the agent's inference watchdog: a new model whose inference hangs on the
canary (watchdog restarts, then "failed") fails its wave even when the FPS and latency figures look fine
or are missing (a hung run reports neither), and the verdict names the device and the watchdog's reason."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from controller.fleet.gate import Finish, GateConfig, GateResult, WatchdogStep, step
from fleet_protocol import TopicKind
from fleet_protocol.messages import Event, EventKind
from tests.support.controller_app import (
    MODEL_BYTES,
    Fleet,
    beat,
    deploy,
    deployment,
    enroll,
    report,
    runs,
    write_model,
)
from tests.support.rollout_views import T0, M, dev, member, ro, running
from tests.support.waiting import wait_for

HUNG = "inference on tiny:2 (CPUExecutionProvider) hung: no result after 30.0 s (bound 30 s)"


def wd(at: float, action: str = "restarted", model: str | None = M, reason: str = HUNG) -> WatchdogStep:
    return WatchdogStep(at=at, action=action, reason=reason, model=model)


def soaked(*steps: WatchdogStep, gate: GateConfig | None = None, **dev_kw: Any) -> list[Any]:
    """The gate of a canary activated at T0 + 5, judged at T0 + 100 (soak over), with these steps."""
    r = ro({"d1": member("d1", state="active", settled_at=T0 + 5)}, gate=gate or GateConfig(soak_s=30))
    return step(r, {"d1": dev("d1", **{**running(), **dev_kw}, watchdog=steps)}, T0 + 100)


# --------------------------------------------------------------------------- the decision function


def test_a_watchdog_failure_fails_the_gate_at_once_with_the_device_and_reason() -> None:
    why = f"{HUNG}; 3 restarts in the last 600 s already"
    steps = (wd(T0 + 10), wd(T0 + 20), wd(T0 + 30), wd(T0 + 40, "failed", reason=why))
    r = ro({"d1": member("d1", state="active", settled_at=T0 + 5)}, gate=GateConfig(soak_s=3600))
    # FPS and latency as good as before, or not reported at all: neither hides the hang.
    for figures in (running(), {k: v for k, v in running().items() if k not in ("fps", "latency_ms")}):
        out = step(r, {"d1": dev("d1", **figures, watchdog=steps)}, T0 + 41)  # long before the soak ends
        assert isinstance(out[0], GateResult) and not out[0].passed
        assert out[0].figures["watchdog"] == {"d1": {"restarts": 3, "failures": 1, "reason": why}}
        assert (
            out[0].reason
            == f"inference watchdog (at most 0 restarts, no failure): d1 failed after 3 restarts: {why}"
        )
        assert (
            isinstance(out[1], Finish)
            and out[1].state == "failed"
            and "d1 failed after 3 restarts" in out[1].reason
        )


def test_one_restart_of_a_new_model_fails_by_default_and_the_limit_is_a_gate_setting() -> None:
    assert GateConfig().max_watchdog_restarts == 0
    assert GateConfig.model_validate({"soak_s": 5}).max_watchdog_restarts == 0  # rollouts stored before it
    out = soaked(wd(T0 + 50))
    assert isinstance(out[0], GateResult) and not out[0].passed
    assert out[0].reason == f"inference watchdog (at most 0 restarts, no failure): d1 1 restart: {HUNG}"
    allow_one = GateConfig(soak_s=30, max_watchdog_restarts=1)
    ok = soaked(wd(T0 + 50), gate=allow_one)
    assert isinstance(ok[0], GateResult) and ok[0].passed
    assert ok[0].figures["watchdog"] == {"d1": {"restarts": 1, "failures": 0, "reason": HUNG}}
    assert ok[0].figures["max_watchdog_restarts"] == 1
    two = soaked(wd(T0 + 50), wd(T0 + 60), gate=allow_one)
    assert isinstance(two[0], GateResult) and not two[0].passed and "d1 2 restarts" in two[0].reason
    # Even with restarts allowed, the agent giving up is never fine.
    many = GateConfig(soak_s=30, max_watchdog_restarts=10)
    failed = soaked(wd(T0 + 50), wd(T0 + 60, "failed"), gate=many)
    assert (
        isinstance(failed[0], GateResult)
        and not failed[0].passed
        and "d1 failed after 1 restart" in failed[0].reason
    )


def test_only_the_new_models_hangs_since_admission_count() -> None:
    ignored = (
        wd(T0 - 1),  # the same model before this rollout admitted the device (an earlier rollout)
        wd(T0 + 50, model="people:1"),  # another deployment's model on another camera
        wd(T0 + 50, "failed", model="people:1"),
        wd(T0 + 2, model=None),  # no model named, before activation: the old model was still running
        wd(T0 + 50, "retry"),  # the agent's own follow-ups are no new hang
        wd(T0 + 50, "recovered"),
        wd(T0 + 50, "command", model=None, reason="restart_pipeline command"),  # an operator's restart
    )
    out = soaked(*ignored)
    assert isinstance(out[0], GateResult) and out[0].passed and out[0].figures["watchdog"] == {}
    # Between admission (T0) and the tick that saw the activation (T0 + 5) the new model was already up.
    early = soaked(wd(T0 + 2))
    assert isinstance(early[0], GateResult) and not early[0].passed
    # A step that names no model after activation is the new model's pipeline failing.
    anon = soaked(wd(T0 + 50, "failed", model=None, reason="retry failed: no model file"))
    assert isinstance(anon[0], GateResult) and "d1 failed after 0 restarts: retry failed" in anon[0].reason


def test_a_wave_names_every_device_the_watchdog_touched() -> None:
    members = {d: member(d, state="active", settled_at=T0 + 5) for d in ("d1", "d2", "d3")}
    r = ro(members, plan=(3, 5), gate=GateConfig(soak_s=30))
    devices = {
        "d1": dev("d1", **running(), watchdog=(wd(T0 + 10, reason="hung on d1"),)),
        "d2": dev("d2", **running()),
        "d3": dev("d3", **running(), watchdog=(wd(T0 + 10, "failed", reason="gave up on d3"),)),
    }
    out = step(r, devices, T0 + 100)
    assert isinstance(out[0], GateResult) and not out[0].passed
    assert out[0].reason.endswith("d1 1 restart: hung on d1; d3 failed after 0 restarts: gave up on d3")
    assert set(out[0].figures["watchdog"]) == {"d1", "d3"}


# --------------------------------------------------------------------------- through the controller


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    for v in ("1", "2"):
        write_model(d, "tiny", v, MODEL_BYTES + v.encode())
    return d


def watchdog(fleet: Fleet, device: str, seq: int, action: str, model: str | None, reason: str = HUNG) -> None:
    """The event an agent sends for one watchdog step; waits until the controller stored it."""
    data = {"action": action, "reason": reason, "model": model, "cameras": ["cam1"], "restarts_in_window": 1}
    ev = Event(
        seq=seq, ts=time.time(), kind=EventKind.WATCHDOG_RESTART, message=f"{action}: {reason}", data=data
    )
    fleet.send(device, TopicKind.EVENTS, ev)
    fleet.wait_ack(device, lambda a: a.upto >= seq, what=f"{device} event {seq} stored")


def active(fleet: Fleet, name: str) -> bool:
    return [d["state"] for d in deployment(fleet, name)["rollout"]["devices"]] == ["active"]


def test_a_canary_whose_new_model_hangs_is_rolled_back(fleet: Fleet) -> None:
    enroll(fleet, "d1", site="a")
    fleet.client.put("/api/v1/devices/d1/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    gate = {"soak_s": 600, "step_timeout_s": 30, "offline_timeout_s": 30}
    deploy(fleet, name="v2", version="2", selector="site=a", gate=gate)
    wait_for(lambda: runs(fleet, "d1") == "2:v2", timeout=15, what="canary gets v2")
    report(fleet, "d1")
    beat(fleet, "d1", 10.0, "tiny:2")  # FPS as before: only the watchdog knows
    wait_for(lambda: active(fleet, "v2"), timeout=15, what="canary active")
    why = f"{HUNG}; 3 restarts in the last 600 s already"
    watchdog(fleet, "d1", 1, "restarted", "tiny:2")
    watchdog(fleet, "d1", 2, "failed", "tiny:2", why)
    body = wait_for(
        lambda: (b := deployment(fleet, "v2"))["rollout"]["state"] == "failed" and b,
        timeout=15,
        what="gate fails long before its 600 s soak",
    )
    assert body["state"] == "failed"
    (g,) = body["rollout"]["gates"]
    assert g["passed"] is False and g["watchdog"] == {"d1": {"restarts": 1, "failures": 1, "reason": why}}
    assert f"d1 failed after 1 restart: {why}" in body["rollout"]["reason"]
    wait_for(lambda: runs(fleet, "d1") == "1:direct", timeout=10, what="canary back on v1")


def test_other_watchdog_steps_leave_a_healthy_rollout_alone(fleet: Fleet) -> None:
    enroll(fleet, "d1", site="a")
    gate = {"soak_s": 1, "step_timeout_s": 30, "offline_timeout_s": 30, "max_watchdog_restarts": 1}
    deploy(fleet, name="v2", version="2", selector="site=a", waves=["100%"], gate=gate)
    wait_for(lambda: runs(fleet, "d1") == "2:v2", timeout=15, what="d1 gets v2")
    watchdog(fleet, "d1", 1, "restarted", "tiny:2")  # one allowed
    watchdog(fleet, "d1", 2, "failed", "tiny:1")  # the old model, on its way out
    watchdog(fleet, "d1", 3, "command", None, "restart_pipeline command")
    report(fleet, "d1")
    beat(fleet, "d1", 10.0, "tiny:2")
    body = wait_for(
        lambda: (b := deployment(fleet, "v2"))["rollout"]["state"] == "succeeded" and b,
        timeout=15,
        what="rollout succeeds",
    )
    (g,) = body["rollout"]["gates"]
    assert g["passed"] is True and g["watchdog"] == {"d1": {"restarts": 1, "failures": 0, "reason": HUNG}}
    assert g["max_watchdog_restarts"] == 1


def build_note(fleet: Fleet, device: str, seq: int, pct: float) -> None:
    """A model_build progress event as the agent's twin sends it while a TensorRT engine builds."""
    data = {"model": "tiny:2", "sha256": "0" * 64, "phase": "progress", "engine": "tensorrt", "pct": pct}
    ev = Event(seq=seq, ts=time.time(), kind=EventKind.MODEL_BUILD, message=f"building {pct:.0f}%", data=data)
    fleet.send(device, TopicKind.EVENTS, ev)
    fleet.wait_ack(device, lambda a: a.upto >= seq, what=f"{device} build event {seq} stored")


def test_a_device_building_its_engine_is_waited_for_then_failed_when_the_build_goes_silent(
    fleet: Fleet,
) -> None:
    # The step timeout (2 s) is for downloads; a build that reports progress is waited for until
    # it has been silent for build_stall_s (3 s), whatever the step timeout says.
    enroll(fleet, "d1", site="a")
    gate = {
        "soak_s": 600,
        "step_timeout_s": 2,
        "build_stall_s": 3,
        "build_timeout_s": 600,
        "offline_timeout_s": 30,
    }
    deploy(fleet, name="v2", version="2", selector="site=a", gate=gate)
    wait_for(lambda: runs(fleet, "d1") == "2:v2", timeout=15, what="canary gets v2")
    report(fleet, "d1", state="loading")
    started = time.monotonic()
    seq = 0
    while time.monotonic() - started < 5:  # 5 s of progress: well past the 2 s step timeout
        seq += 1
        build_note(fleet, "d1", seq, 10.0 * seq)
        assert [d["state"] for d in deployment(fleet, "v2")["rollout"]["devices"]] == ["applying"]
        time.sleep(0.5)
    body = wait_for(
        lambda: (b := deployment(fleet, "v2"))["rollout"]["state"] == "failed" and b,
        timeout=20,
        what="the silent build fails the canary",
    )
    (m,) = body["rollout"]["devices"]
    assert m["state"] == "rolled_back" and "engine build made no progress" in m["reason"]
