"""Does a device run its desired state? The twin comparison the API, CLI and converger share."""

from __future__ import annotations

import math
from typing import Any

from controller.db.states import SyncState  # also imported from here by controller.api.schemas
from controller.db.tables import Device
from fleet_protocol.messages import CameraReported, CountLine, MotionSettings, Zone

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
    else, or other settings, or reports a version this controller never issued)."""
    busy = [cam for cam, r in reported.items() if r.state in _APPLYING]
    if desired_version == 0 and not reported:
        return SyncState.IN_SYNC, None
    if desired is not None and reported_version is not None and reported_version > desired_version:
        # Every version is stored before it is published, so the device holds a state this controller
        # never issued to it (a restored database, another controller): the converger re-sends the
        # current state above the reported version.
        return (
            SyncState.DRIFTED,
            f"device reports v{reported_version}, above v{desired_version}, the newest this controller issued",
        )
    if reported_version is None or reported_version < desired_version:
        if busy:
            return SyncState.APPLYING, f"{', '.join(sorted(busy))}: {reported[busy[0]].state}"
        return (
            SyncState.PENDING,
            f"device reports v{reported_version if reported_version is not None else '-'}, desired v{desired_version}",
        )
    want: dict[str, str] = {}
    wanted: dict[str, dict[str, Any]] = {}
    for cam, cd in ((desired or {}).get("cameras") or {}).items():
        ref = (cd or {}).get("model")
        if ref:
            want[cam] = ref["manifest"]["sha256"]
            wanted[cam] = cd
    for cam, sha in sorted(want.items()):
        r = reported.get(cam)
        if r is not None and r.state == "failed":
            return SyncState.FAILED, f"{cam}: {r.error or 'failed'}"
        if r is not None and r.state in _APPLYING:
            return SyncState.APPLYING, f"{cam}: {r.state}"
        if r is None or r.sha256 != sha or r.state != "running":
            runs = f"{r.model} ({r.state})" if r is not None and r.model else "nothing"
            return SyncState.DRIFTED, f"{cam} runs {runs} instead of the desired {sha[:12]}"
        differs = settings_drift(wanted[cam], r)
        if differs:
            return SyncState.DRIFTED, f"{cam} runs {r.model} with {differs}"
    extra = sorted(cam for cam, r in reported.items() if cam not in want and r.state == "running" and r.model)
    if extra:
        return SyncState.DRIFTED, f"{', '.join(extra)} run a model the desired state does not assign"
    return SyncState.IN_SYNC, None


def _same_float(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def settings_drift(desired_camera: dict[str, Any], r: CameraReported) -> str | None:
    """How the settings a running camera reports differ from its desired ones, or None.

    Compared only when the device reports them (``threshold`` set: agents before these fields send
    none). The desired threshold in effect is the camera's, else the manifest's default. Per-label
    thresholds and the minimum box area likewise, only when it reports ``min_box_area`` (an agent that
    knows them always does); unset and empty are the same.
    """
    if r.threshold is None:
        return None
    manifest = ((desired_camera.get("model") or {}).get("manifest")) or {}
    threshold = desired_camera.get("threshold")
    if threshold is None:
        threshold = manifest.get("default_threshold", 0.5)
    out: list[str] = []
    if not _same_float(float(threshold), r.threshold):
        out.append(f"threshold {r.threshold:g} instead of {float(threshold):g}")
    max_fps = desired_camera.get("max_fps")
    if not _same_float(None if max_fps is None else float(max_fps), r.max_fps):
        out.append(f"max_fps {_shown(r.max_fps)} instead of {_shown(max_fps)}")
    labels = desired_camera.get("labels")
    want_labels = None if labels is None else sorted(set(labels))
    got_labels = None if r.labels is None else sorted(set(r.labels))
    if want_labels != got_labels:
        out.append(f"labels {_shown(got_labels)} instead of {_shown(want_labels)}")
    if r.min_box_area is not None:
        want_per_label = dict(desired_camera.get("label_thresholds") or {})
        got_per_label = dict(r.label_thresholds or {})
        if want_per_label.keys() != got_per_label.keys() or not all(
            _same_float(float(v), got_per_label[k]) for k, v in want_per_label.items()
        ):
            out.append(f"label_thresholds {_shown(got_per_label)} instead of {_shown(want_per_label)}")
        min_area = float(desired_camera.get("min_box_area") or 0.0)
        if not _same_float(min_area, r.min_box_area):
            out.append(f"min_box_area {r.min_box_area:g} instead of {min_area:g}")
    if r.zones is not None or r.lines is not None:
        # Compared as the contract reads them, so a default left out on one side is the same.
        for name, kind, got in (("zones", Zone, r.zones), ("lines", CountLine, r.lines)):
            want = [kind.model_validate(x).model_dump(mode="json") for x in desired_camera.get(name) or []]
            have = [x.model_dump(mode="json") for x in got or []]
            if want != have:
                out.append(f"{name} {[x['id'] for x in have]} differ from {[x['id'] for x in want]}")
    if r.motion is not None:
        # Unset in the desired state leaves the agent's own setting, so only a desired gate is compared.
        want_motion = desired_camera.get("motion")
        if want_motion is not None and MotionSettings.model_validate(want_motion) != r.motion:
            out.append(f"motion {r.motion.model_dump(mode='json')} instead of {want_motion}")
    return ", ".join(out) or None


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def device_sync(dev: Device) -> tuple[SyncState, str | None]:
    """The device's twin status as the API shows it (in_sync, pending, applying, failed, drifted)."""
    reported: dict[str, CameraReported] = {}
    for cam, rep in ((dev.reported or {}).get("cameras") or {}).items():
        try:
            reported[cam] = CameraReported.model_validate(rep)
        except ValueError:
            continue
    return twin_sync(dev.desired, dev.desired_version, reported, dev.reported_version)
