"""Does a device run its desired state? The twin comparison the API, CLI and converger share."""

from __future__ import annotations

from typing import Any, Literal

from controller.db.tables import Device
from fleet_protocol.messages import CameraReported

SyncState = Literal["in_sync", "pending", "applying", "failed", "drifted"]
_APPLYING = ("fetching", "verifying", "loading")


def twin_sync(
    desired: dict[str, Any] | None,
    desired_version: int,
    reported: dict[str, CameraReported],
    reported_version: int | None,
) -> tuple[SyncState, str | None]:
    """Compare desired and reported state: in sync, pending (not applied yet), applying (a model on
    its way), failed (the device says why), or drifted (it applied this version but runs something
    else)."""
    busy = [cam for cam, r in reported.items() if r.state in _APPLYING]
    if desired_version == 0 and not reported:
        return "in_sync", None
    if reported_version is None or reported_version < desired_version:
        if busy:
            return "applying", f"{', '.join(sorted(busy))}: {reported[busy[0]].state}"
        return (
            "pending",
            f"device reports v{reported_version if reported_version is not None else '-'}, desired v{desired_version}",
        )
    want: dict[str, str] = {}
    for cam, cd in ((desired or {}).get("cameras") or {}).items():
        ref = (cd or {}).get("model")
        if ref:
            want[cam] = ref["manifest"]["sha256"]
    for cam, sha in sorted(want.items()):
        r = reported.get(cam)
        if r is not None and r.state == "failed":
            return "failed", f"{cam}: {r.error or 'failed'}"
        if r is not None and r.state in _APPLYING:
            return "applying", f"{cam}: {r.state}"
        if r is None or r.sha256 != sha or r.state != "running":
            runs = f"{r.model} ({r.state})" if r is not None and r.model else "nothing"
            return "drifted", f"{cam} runs {runs} instead of the desired {sha[:12]}"
    extra = sorted(cam for cam, r in reported.items() if cam not in want and r.state == "running" and r.model)
    if extra:
        return "drifted", f"{', '.join(extra)} run a model the desired state does not assign"
    return "in_sync", None


def device_sync(dev: Device) -> tuple[str, str | None]:
    """The device's twin status as the API shows it (in_sync, pending, applying, failed, drifted)."""
    reported: dict[str, CameraReported] = {}
    for cam, rep in ((dev.reported or {}).get("cameras") or {}).items():
        try:
            reported[cam] = CameraReported.model_validate(rep)
        except ValueError:
            continue
    return twin_sync(dev.desired, dev.desired_version, reported, dev.reported_version)
