"""Rows as the API shows them (table rows and what the services know, into the shapes of
``controller.api.schemas``), and the opaque cursor of paginated lists."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Literal

from sqlmodel import Session

from controller.api.errors import invalid_query
from controller.api.schemas import (
    AgentFailure,
    BoxOut,
    CameraAssignment,
    DeploymentPublic,
    DetectionOut,
    DeviceAgent,
    DevicePublic,
    DeviceStats,
    IncarnationStats,
    RolloutCameraPublic,
    RolloutDevicePublic,
    RolloutPublic,
    TokenPublic,
)
from controller.db import crud
from controller.db.states import DeviceStatus, MemberState
from controller.db.tables import (
    ApiToken,
    Deployment,
    Detection,
    Device,
    ModelVariantPublic,
    ModelVersion,
    ModelVersionPublic,
    Rollout,
)
from controller.fleet.deployments import rollout_cameras, rollout_devices, rollout_of
from controller.fleet.gate import GateConfig, failed_attempt
from controller.fleet.sync import twin_sync
from controller.link.seqtrack import SeqStats
from controller.observe.clock import device_clock_offset
from controller.security.tokens import Role
from fleet_protocol.messages import CameraReported, CameraStats

# --------------------------------------------------------------------------- cursor


def encode_cursor(captured_at: datetime, row_id: int) -> str:
    raw = json.dumps([captured_at.astimezone(UTC).isoformat(), row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, int]:
    """The (captured_at, id) a cursor stands for; a 422 naming ``cursor`` when it is not one of ours."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        ts_s, row_id = json.loads(raw)
        ts = datetime.fromisoformat(ts_s)
        if not isinstance(row_id, int) or isinstance(row_id, bool) or not (0 <= row_id < 2**63):
            raise ValueError("bad id")
        if ts.tzinfo is None:
            raise ValueError("naive timestamp")
        return ts, row_id
    except (ValueError, TypeError, binascii.Error, json.JSONDecodeError, UnicodeDecodeError):
        raise invalid_query("cursor", "invalid cursor; use the next_cursor of a previous page") from None


# --------------------------------------------------------------------------- devices


def _status(status: str) -> Literal["online", "offline", "decommissioned"]:
    if status == DeviceStatus.ONLINE:
        return "online"
    if status == DeviceStatus.DECOMMISSIONED:
        return "decommissioned"
    return "offline"


def device_public(dev: Device, stats: SeqStats) -> DevicePublic:
    """A device with what its last heartbeat and reported state say, and its ingest counters; parts
    stored by an older agent or schema are skipped rather than failing the listing."""
    health = dev.last_health or {}
    cameras: list[CameraStats] = []
    for c in health.get("cameras", []) or []:
        try:
            cameras.append(CameraStats.model_validate(c))
        except ValueError:
            continue
    models: dict[str, CameraReported] = {}
    for cam, rep in ((dev.reported or {}).get("cameras") or {}).items():
        try:
            models[cam] = CameraReported.model_validate(rep)
        except ValueError:
            continue
    assignments: dict[str, CameraAssignment] = {}
    for cam, a in (dev.assignments or {}).items():
        try:
            assignments[cam] = CameraAssignment.model_validate(a)
        except ValueError:
            continue
    sync, sync_reason = twin_sync(dev.desired, dev.desired_version, models, dev.reported_version)
    return DevicePublic(
        id=dev.id,
        assignments=assignments,
        name=dev.name,
        labels=dev.labels or {},
        enrolled=dev.enrolled,
        status=_status(dev.status),
        online_since=dev.online_since,
        offline_since=dev.offline_since,
        last_seen=dev.last_seen,
        agent_version=dev.agent_version,
        capabilities=dev.capabilities,
        cameras=cameras,
        models=models,
        last_health=dev.last_health,
        desired_version=dev.desired_version,
        reported_version=dev.reported_version,
        sync=sync,
        sync_reason=sync_reason,
        agent=device_agent(dev),
        stats=DeviceStats(
            stored=stats.stored,
            duplicates=stats.duplicates,
            lost=stats.lost,
            dropped=stats.dropped,
            acked_upto=stats.acked_upto,
            max_seq=stats.max_seq,
            incarnations=[
                IncarnationStats(
                    incarnation=x.incarnation,
                    started_at=x.started_at,
                    stored=x.stored,
                    duplicates=x.duplicates,
                    lost=x.lost,
                    dropped=x.dropped,
                    acked_upto=x.acked_upto,
                    max_seq=x.max_seq,
                )
                for x in stats.incarnations
            ],
            incarnation_count=stats.spaces,
        ),
        incarnation=dev.incarnation,
        incarnation_started_at=dev.incarnation_started_at,
        decommissioned_at=dev.decommissioned_at,
        created_at=dev.created_at,
    )


def with_clock(public: DevicePublic, session: Session, dev: Device, *, threshold_s: float) -> DevicePublic:
    """The device view with its clock offset estimated from its latest heartbeat and recent samples."""
    offset = device_clock_offset(session, dev)
    return public.model_copy(
        update={"clock_offset_s": offset, "clock_off": offset is not None and abs(offset) > threshold_s}
    )


def _text(v: object) -> str | None:
    """A scalar of the agent's JSON as text; anything else as absent."""
    return str(v) if isinstance(v, str | int | float) and not isinstance(v, bool) else None


def device_agent(dev: Device) -> DeviceAgent | None:
    """The agent part of the device view: its reported agent (an older agent reports none: then the
    version of its birth message) and what its desired state names."""
    got = (dev.reported or {}).get("agent")
    rep = got if isinstance(got, dict) else {}
    want = dev.agent_desired or {}
    cur, prev = want.get("current") or {}, want.get("previous") or {}
    if not rep and not cur and not dev.agent_version:
        return None
    pct = rep.get("progress_pct")
    return DeviceAgent(
        version=_text(rep.get("version")) or dev.agent_version,
        slot=_text(rep.get("slot")),
        state=_text(rep.get("state")),
        target=_text(rep.get("target")),
        progress_pct=float(pct) if isinstance(pct, int | float) and not isinstance(pct, bool) else None,
        error=_text(rep.get("error")),
        previous=_text(rep.get("previous")),
        desired=_text(cur.get("version")),
        desired_source=_text(cur.get("source")),
        deployment=_text(cur.get("deployment")),
        fallback=_text(prev.get("version")),
        last_failure=_agent_failure(rep, want.get("last_failure")),
    )


def _agent_failure(rep: dict[str, Any], kept: object) -> AgentFailure | None:
    """The failure the agent reports now, else the last one the controller kept (the agent stops
    reporting it once its desired version moves on)."""
    stored: AgentFailure | None = None
    if isinstance(kept, dict):
        try:
            stored = AgentFailure.model_validate(kept)
        except ValueError:
            stored = None
    now = failed_attempt(rep)
    if now is None:
        # A version it runs now failed only before (a transfer retried): that is over.
        return stored if stored is not None and stored.version != rep.get("version") else None
    live = AgentFailure(version=now.version, state=now.state, error=now.error)
    if stored is not None and (stored.version, stored.state, stored.error) == (
        live.version,
        live.state,
        live.error,
    ):
        return stored
    return live


# --------------------------------------------------------------------------- deployments / rollouts


def rollout_public(session: Session, dep: Deployment, ro: Rollout) -> RolloutPublic:
    assert ro.id is not None and dep.id is not None
    members = rollout_devices(session, ro.id)
    devices: list[RolloutDevicePublic] = []
    for m in members:
        dev = crud.get_device(session, device_id=m.device_id)
        reported = ((dev.reported if dev else None) or {}).get("cameras") or {}
        got = ((dev.reported if dev else None) or {}).get("agent") if dep.kind == "agent" else None
        agent = got if isinstance(got, dict) else {}
        progress = [
            float(reported[c]["progress_pct"])
            for c in m.cameras
            if c in reported and reported[c].get("progress_pct") is not None
        ]
        devices.append(
            RolloutDevicePublic(
                device_id=m.device_id,
                wave=m.wave + 1,
                state=m.state,
                cameras=list(m.cameras or []),
                target_version=m.target_version,
                reported_version=dev.reported_version if dev else None,
                progress_pct=min(progress) if progress else None,
                baseline_fps=m.baseline_fps,
                baseline_latency_ms=m.baseline_latency_ms,
                admitted_at=m.admitted_at,
                settled_at=m.settled_at,
                reason=m.reason,
                agent_version=_text(agent.get("version"))
                or (dev.agent_version if dev and dep.kind == "agent" else None),
                agent_state=_text(agent.get("state")),
            )
        )
    cams = rollout_cameras(session, ro.id)
    versions = {
        d.id: d.reported_version
        for d in crud.devices_by_ids(session, device_ids={c.device_id for c in cams if c.device_id})
    }
    cameras = [
        RolloutCameraPublic(
            pool=c.pool,
            camera=c.camera,
            device_id=c.device_id or None,
            wave=c.wave + 1,
            state=c.state,
            target_version=c.target_version,
            reported_version=versions.get(c.device_id),
            soak_restarts=c.soak_restarts,
            baseline_fps=c.baseline_fps,
            baseline_latency_ms=c.baseline_latency_ms,
            admitted_at=c.admitted_at,
            settled_at=c.settled_at,
            reason=c.reason,
        )
        for c in cams
    ]
    counted = (MemberState.APPLYING, MemberState.ACTIVE, MemberState.FAILED, MemberState.ROLLED_BACK)
    every = [m.state for m in members] + [c.state for c in cams]
    progress_counts = {k.value: sum(st == k for st in every) for k in counted}
    progress_counts["admitted"] = len(every)
    progress_counts["planned"] = ro.plan[-1] if ro.plan else 0
    return RolloutPublic(
        id=ro.id,
        deployment=dep.name,
        deployment_id=dep.id,
        state=ro.state,
        waves=list(ro.waves or []),
        plan=list(ro.plan or []),
        current_wave=min(ro.current_wave, max(len(ro.plan) - 1, 0)) + 1,
        gate=GateConfig.model_validate(ro.gate or {}),
        gates=[{**g, "wave": int(g.get("wave", 0)) + 1} for g in ro.gates or []],
        reason=ro.reason,
        progress=progress_counts,
        devices=devices,
        cameras=cameras,
        created_at=ro.created_at,
        updated_at=ro.updated_at,
        finished_at=ro.finished_at,
    )


def deployment_public(session: Session, dep: Deployment) -> DeploymentPublic:
    assert dep.id is not None
    ro = rollout_of(session, dep.id)
    return DeploymentPublic(
        id=dep.id,
        name=dep.name,
        kind="agent" if dep.kind == "agent" else "model",
        model=dep.model,
        version=dep.version,
        agent_version=dep.agent_version,
        variant=dep.variant,
        selector=dep.selector,
        cameras=list(dep.cameras or []),
        priority=dep.priority,
        state=dep.state,
        created_at=dep.created_at,
        rollout=rollout_public(session, dep, ro) if ro is not None else None,
    )


# --------------------------------------------------------------------------- models, detections, tokens


def model_version_public(mv: ModelVersion, variants: Sequence[Any]) -> ModelVersionPublic:
    return ModelVersionPublic(
        name=mv.name,
        version=mv.version,
        sha256=mv.sha256,
        size=mv.size,
        manifest=mv.manifest,
        created_at=mv.created_at,
        status=mv.status,
        build_stage=mv.build_stage,
        build_progress=mv.build_progress,
        build_error=mv.build_error,
        variants=[ModelVariantPublic.model_validate(v, from_attributes=True) for v in variants],
    )


def detection_out(r: Detection, *, superseded: bool = False) -> DetectionOut:
    return DetectionOut(
        superseded=superseded,
        device=r.device_id,
        camera=r.camera,
        seq=r.seq,
        frame=r.frame,
        captured_at=r.captured_at,
        stored_at=r.stored_at,
        model=r.model,
        label=r.label,
        class_id=r.class_id,
        score=r.score,
        box=BoxOut(x0=r.x0, y0=r.y0, x1=r.x1, y1=r.y1),
        track_id=r.track_id,
    )


def token_public(row: ApiToken) -> TokenPublic:
    assert row.id is not None
    return TokenPublic(
        id=row.id,
        name=row.name,
        role=Role(row.role).value,
        prefix=row.prefix,
        created_at=row.created_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )
