"""The device's twin status: in sync, pending, applying, failed or drifted, each with its reason."""

from __future__ import annotations

from typing import Any

import pytest

from controller.fleet.sync import twin_sync
from fleet_protocol.messages import CameraReported

SHA_A = "a" * 64
SHA_B = "b" * 64


def desired(**cams: str) -> dict[str, Any]:
    return {"cameras": {cam: {"model": {"manifest": {"sha256": sha}}} for cam, sha in cams.items()}}


def running(sha: str, model: str = "m:1") -> CameraReported:
    return CameraReported(model=model, sha256=sha, state="running")


@pytest.mark.parametrize(
    ("want", "version", "reported", "reported_version", "state", "reason"),
    [
        (None, 0, {}, None, "in_sync", None),
        (desired(cam1=SHA_A), 2, {"cam1": running(SHA_A)}, 2, "in_sync", None),
        (desired(cam1=SHA_A), 3, {"cam1": running(SHA_B)}, 2, "pending", "reports v2, desired v3"),
        (desired(cam1=SHA_A), 3, {}, None, "pending", "reports v-, desired v3"),
        (
            desired(cam1=SHA_A),
            3,
            {"cam1": CameraReported(model="m:2", sha256=SHA_A, state="fetching", progress_pct=40)},
            2,
            "applying",
            "cam1: fetching",
        ),
        (
            desired(cam1=SHA_A),
            3,
            {"cam1": CameraReported(model="m:2", sha256=SHA_A, state="failed", error="warm-up failed: NaN")},
            3,
            "failed",
            "cam1: warm-up failed: NaN",
        ),
        (
            desired(cam1=SHA_A),
            3,
            {"cam1": running(SHA_B, "other:9")},
            3,
            "drifted",
            "cam1 runs other:9 (running)",
        ),
        (desired(cam1=SHA_A), 3, {}, 3, "drifted", "cam1 runs nothing"),
        (
            desired(cam1=SHA_A),
            3,
            {"cam1": running(SHA_A), "cam2": running(SHA_B, "x:1")},
            3,
            "drifted",
            "cam2 run a model the desired state does not assign",
        ),
    ],
)
def test_twin_sync_states(
    want: dict[str, Any] | None,
    version: int,
    reported: dict[str, CameraReported],
    reported_version: int | None,
    state: str,
    reason: str | None,
) -> None:
    got_state, got_reason = twin_sync(want, version, reported, reported_version)
    assert got_state == state
    if reason is None:
        assert got_reason is None
    else:
        assert got_reason is not None and reason in got_reason
