"""Rollout, device and member views for the rollout engine's pure decision function (gate.step)."""

from __future__ import annotations

from typing import Any

from controller.fleet.gate import (
    DeviceView,
    GateConfig,
    MemberView,
    RolloutView,
)

M = "tiny:2"


T0 = 1_000_000.0


def ro(members: dict[str, MemberView] | None = None, **kw: Any) -> RolloutView:
    gate = kw.pop("gate", GateConfig(soak_s=10, step_timeout_s=60, offline_timeout_s=20))
    base: dict[str, Any] = {
        "state": "running",
        "model": M,
        "plan": (1, 3, 5),
        "current_wave": 0,
        "gate": gate,
        "members": members or {},
    }
    return RolloutView(**{**base, **kw})


def dev(i: str, **kw: Any) -> DeviceView:
    return DeviceView(id=i, **kw)


def running(version: int = 5, fps: float = 10.0, ms: float = 20.0, **kw: Any) -> dict[str, Any]:
    return {
        "reported_version": version,
        "reported": {"cam1": {"model": M, "state": "running"}},
        "fps": {"cam1": fps},
        "latency_ms": {"cam1": ms},
        **kw,
    }


def member(i: str, wave: int = 0, state: str = "applying", **kw: Any) -> MemberView:
    base: dict[str, Any] = {
        "admitted_at": T0,
        "cameras": ("cam1",),
        "target_version": 5,
        "baseline_fps": 10.0,
    }
    return MemberView(device_id=i, wave=wave, state=state, **{**base, **kw})
