"""Does a device run its desired state? The twin comparison the API, CLI and converger share."""

from __future__ import annotations

from typing import Any

from controller.db.states import SyncState  # also imported from here by controller.api.schemas
from controller.db.tables import Device
from fleet_protocol.messages import CameraReported

# CameraReported states (fleet_protocol CameraState) of a model on its way.
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
        return SyncState.IN_SYNC, None
    if reported_version is None or reported_version < desired_version:
        if busy:
            return SyncState.APPLYING, f"{', '.join(sorted(busy))}: {reported[busy[0]].state}"
        return (
            SyncState.PENDING,
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
            return SyncState.FAILED, f"{cam}: {r.error or 'failed'}"
        if r is not None and r.state in _APPLYING:
            return SyncState.APPLYING, f"{cam}: {r.state}"
        if r is None or r.sha256 != sha or r.state != "running":
            runs = f"{r.model} ({r.state})" if r is not None and r.model else "nothing"
            return SyncState.DRIFTED, f"{cam} runs {runs} instead of the desired {sha[:12]}"
    extra = sorted(cam for cam, r in reported.items() if cam not in want and r.state == "running" and r.model)
    if extra:
        return SyncState.DRIFTED, f"{', '.join(extra)} run a model the desired state does not assign"
    return SyncState.IN_SYNC, None


def device_sync(dev: Device) -> tuple[SyncState, str | None]:
    """The device's twin status as the API shows it (in_sync, pending, applying, failed, drifted)."""
    reported: dict[str, CameraReported] = {}
    for cam, rep in ((dev.reported or {}).get("cameras") or {}).items():
        try:
            reported[cam] = CameraReported.model_validate(rep)
        except ValueError:
            continue
    return twin_sync(dev.desired, dev.desired_version, reported, dev.reported_version)
