"""The rollout gate (pure ``gate.step``) for pool cameras: a wave admits cameras, not devices; a camera
that moves while judged starts again on its new device instead of failing; a camera that fails on its
new device, moves too often, sits on a dead device its pool never moves, or whose new version its pool
cannot fit, still fails its wave."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from controller.db.states import MemberState
from controller.fleet.gate import (
    AdmitCamera,
    CameraTarget,
    DeviceView,
    Finish,
    GateConfig,
    GateResult,
    MemberView,
    Moved,
    RolloutView,
    Settle,
    step,
)

M = "tiny:2"
T0 = 1_000_000.0
POOL = "north"
GATE = GateConfig(soak_s=10, step_timeout_s=60, offline_timeout_s=20, max_soak_restarts=2)


def key(cam: str) -> str:
    return f"{POOL}/{cam}"


def target(cam: str, device: str | None, **kw: Any) -> CameraTarget:
    return CameraTarget(pool=POOL, camera=cam, device=device, **{"admitted": True, **kw})


# Five cameras on three boxes; door-5 is placed nowhere.
TARGETS = {
    key(c): target(c, d)
    for c, d in (("door-1", "box-1"), ("door-2", "box-2"), ("door-3", "box-3"), ("door-4", "box-1"))
} | {key("door-5"): target("door-5", None)}


def box(i: str, cams: dict[str, str] | None = None, version: int = 7, **kw: Any) -> DeviceView:
    """A box that applied desired ``version`` and runs ``cams`` (camera -> state) on the new model."""
    reported = {c: {"model": M, "state": st} for c, st in (cams or {}).items()}
    fps = dict.fromkeys(cams or {}, 10.0)
    return DeviceView(id=i, reported_version=version, reported=reported, fps=fps, **kw)


def cam_member(cam: str, device: str, state: str = "applying", **kw: Any) -> MemberView:
    base: dict[str, Any] = {
        "wave": 0,
        "admitted_at": T0,
        "cameras": (cam,),
        "target_version": 7,
        "baseline_fps": 10.0,
        "pool": POOL,
        "camera": cam,
    }
    return MemberView(device_id=device, state=state, **{**base, **kw})


def view(members: list[MemberView], targets: dict[str, CameraTarget] | None = None, **kw: Any) -> RolloutView:
    base: dict[str, Any] = {
        "state": "running",
        "model": M,
        "plan": (1, 3, 4),
        "current_wave": 0,
        "gate": GATE,
        "members": {m.key: m for m in members},
        "targets": TARGETS if targets is None else targets,
        "devices_targeted": False,
    }
    return RolloutView(**{**base, **kw})


BOXES = {b: box(b) for b in ("box-1", "box-2", "box-3")}


def test_waves_admit_cameras_placed_somewhere_and_no_device() -> None:
    assert step(view([]), BOXES, T0) == [AdmitCamera(key("door-1"), 0)]
    # The next wave takes the plan's count in cameras, on whatever devices they run.
    first = cam_member("door-1", "box-1", "active", settled_at=T0)
    second = step(view([first], current_wave=1, gated_waves=frozenset({0})), BOXES, T0 + 1)
    assert second == [AdmitCamera(key("door-2"), 1), AdmitCamera(key("door-3"), 1)]
    # The last wave takes every camera left that runs somewhere; door-5, unplaced, waits.
    done = [
        first,
        *(
            cam_member(c, b, "active", wave=1, settled_at=T0)
            for c, b in (("door-2", "box-2"), ("door-3", "box-3"))
        ),
    ]
    last = step(view(done, current_wave=2, gated_waves=frozenset({0, 1})), BOXES, T0 + 1)
    assert last == [AdmitCamera(key("door-4"), 2)]


def test_a_failover_during_the_soak_restarts_the_cameras_soak_on_its_new_device() -> None:
    soaking = cam_member("door-1", "box-1", "active", settled_at=T0 + 5)
    dead = {**BOXES, "box-1": box("box-1", online=False, offline_since=T0 + 6)}
    moved = {**TARGETS, key("door-1"): target("door-1", "box-2", moved="device_offline", admitted=False)}
    # Well past the soak: the camera moved, so no gate is judged; it starts again on box-2.
    actions = step(view([soaking], moved), dead, T0 + 30)
    assert actions == [Moved(key("door-1"), "box-2", True, "device_offline")]
    # Restarted (as the service stores it): applying on box-2 from T0 + 30, not yet sent its state.
    again = replace(soaking, device_id="box-2", state="applying", admitted_at=T0 + 30, settled_at=None)
    again = replace(again, target_version=None, soak_restarts=1)
    assert step(view([again], moved), dead, T0 + 31) == []
    # box-2 runs it on the new model under the desired state that gave it the camera: active.
    sent = replace(again, target_version=9)
    running = {**dead, "box-2": box("box-2", {"door-1": "running"}, version=9)}
    assert step(view([sent], moved), running, T0 + 40) == [Settle(key("door-1"), MemberState.ACTIVE)]
    # ... and its wave passes once it has soaked there.
    active = replace(sent, state="active", settled_at=T0 + 40)
    assert step(view([active], moved), running, T0 + 49) == []
    passed = step(view([active], moved), running, T0 + 51)
    assert isinstance(passed[0], GateResult) and passed[0].passed
    assert passed[0].figures["cameras"] == {key("door-1"): "box-2"}
    assert passed[0].figures["fps_ratio"] == {key("door-1"): 1.0}


def test_a_camera_whose_new_version_fails_on_its_new_device_still_fails_the_wave() -> None:
    restarted = cam_member("door-1", "box-2", soak_restarts=1, target_version=9)
    broken = {"door-1": {"model": M, "state": "failed", "error": "non-finite output"}}
    failing = {**BOXES, "box-2": DeviceView(id="box-2", reported_version=9, reported=broken)}
    moved = {**TARGETS, key("door-1"): target("door-1", "box-2", moved="device_offline")}
    actions = step(view([restarted], moved), failing, T0 + 5)
    assert actions[0] == Settle(
        key("door-1"), MemberState.FAILED, "camera door-1 failed on box-2: non-finite output"
    )
    assert isinstance(actions[1], GateResult) and not actions[1].passed
    assert "1 of 1 cameras failed" in actions[1].reason
    assert isinstance(actions[2], Finish) and actions[2].state == "failed"


def test_a_camera_moved_more_often_than_allowed_while_judged_fails() -> None:
    tired = cam_member("door-1", "box-1", "active", settled_at=T0, soak_restarts=2)
    moved = {**TARGETS, key("door-1"): target("door-1", "box-3", moved="overload")}
    actions = step(view([tired], moved), BOXES, T0 + 5)
    assert actions[0] == Settle(
        key("door-1"),
        MemberState.FAILED,
        "moved 3 times while judged (limit max_soak_restarts 2); the last from box-1 to box-3 (overload)",
    )
    assert isinstance(actions[-1], Finish) and actions[-1].state == "failed"


def test_a_camera_on_a_dead_device_waits_for_its_pool_and_fails_only_if_never_moved() -> None:
    active = cam_member("door-1", "box-1", "active", settled_at=T0)
    dead = {**BOXES, "box-1": box("box-1", {"door-1": "running"}, online=False, offline_since=T0 + 1)}
    # Past the soak and the device offline timeout (20 s): no verdict on a device that cannot report.
    assert step(view([active]), dead, T0 + 30) == []
    late = step(view([active]), dead, T0 + 62)
    assert isinstance(late[0], Settle) and late[0].state == "failed"
    assert "box-1 has been offline for 61s and its pool has not moved it" in str(late[0].reason)


def test_a_camera_whose_pool_holds_the_new_version_fails_with_the_pools_reason() -> None:
    held = {
        **TARGETS,
        key("door-1"): target(
            "door-1", "box-1", admitted=False, held="tiny/2 at 10 FPS does not fit on box-1"
        ),
    }
    applying = cam_member("door-1", "box-1", target_version=None)
    old = {**BOXES, "box-1": box("box-1", {"door-1": "running"})}
    assert step(view([applying], held), old, T0 + 59) == []
    actions = step(view([applying], held), old, T0 + 61)
    assert actions[0] == Settle(
        key("door-1"),
        MemberState.FAILED,
        "not active after 60s: its pool does not admit tiny:2 on box-1 (tiny/2 at 10 FPS does not fit on box-1)",
    )


def test_a_camera_moved_after_its_wave_passed_is_followed_not_judged() -> None:
    done = cam_member("door-1", "box-1", "active", settled_at=T0)
    moved = {**TARGETS, key("door-1"): target("door-1", "box-3", moved="cordoned")}
    r = view([done], moved, current_wave=1, gated_waves=frozenset({0}))
    assert step(r, BOXES, T0 + 100)[0] == Moved(key("door-1"), "box-3", False, "cordoned")
