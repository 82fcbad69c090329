"""REST API under ``/api/v1`` (plus ``/healthz``)."""

from __future__ import annotations

import base64
import binascii
import json
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Path, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlmodel import Session, col, select

from controller.api.deps import RuntimeDep, SessionDep
from controller.api.schemas import (
    ArtifactKey,
    AssignModel,
    BoxOut,
    DeploymentCreate,
    DeploymentPublic,
    DetectionOut,
    DetectionPage,
    DevicePublic,
    EnrolledDevice,
    Health,
    IngestStats,
    LabelsBody,
    RevokedDevice,
    RolloutDevicePublic,
    RolloutPublic,
)
from controller.db import crud
from controller.db.tables import (
    Deployment,
    Detection,
    DeviceCreate,
    EventPublic,
    HealthSamplePublic,
    ModelVariantPublic,
    ModelVersion,
    ModelVersionPublic,
    Rollout,
)
from controller.errors import ConflictError, NotFoundError
from controller.fleet.deployments import (
    APPLIED_STATES,
    get_deployment,
    list_deployments,
    rollout_devices,
    rollout_of,
)
from controller.fleet.gate import GateConfig
from controller.fleet.rollouts import DeploymentError
from controller.fleet.twin import uses
from controller.link.broker_auth import BrokerAdminError, generate_password, hash_password
from controller.registry.uploads import UploadError, parse_multipart, register_upload
from controller.runtime import ControllerRuntime
from fleet_protocol import TopicKind
from fleet_protocol.messages import Availability, DesiredState

# Query strings go to the database; PostgreSQL refuses NUL in text, which must be a 422, not a 500.
_NO_NUL = r"^[^\x00]*$"
_CAMERA = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"

# A device id is an MQTT topic level and a folder name: anything else is a 422 naming device_id.
DeviceIdPath = Annotated[str, Path(description="device id", max_length=64, pattern=_CAMERA)]
NamePath = Annotated[str, Path(max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
CameraPath = Annotated[str, Path(description="camera id on the device", max_length=64, pattern=_CAMERA)]


def _not_found(msg: str) -> HTTPException:
    return HTTPException(status_code=status.HTTP_404_NOT_FOUND, detail=msg)


def _query_error(field: str, msg: str) -> HTTPException:
    # Same shape as FastAPI's own validation errors, so clients handle one format.
    return HTTPException(
        status_code=422, detail=[{"loc": ["query", field], "msg": msg, "type": "value_error"}]
    )


def encode_cursor(captured_at: datetime, row_id: int) -> str:
    raw = json.dumps([captured_at.astimezone(UTC).isoformat(), row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, int]:
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
        raise _query_error("cursor", "invalid cursor; use the next_cursor of a previous page") from None


def rollout_public(session: Session, dep: Deployment, ro: Rollout) -> RolloutPublic:
    assert ro.id is not None and dep.id is not None
    members = rollout_devices(session, ro.id)
    devices: list[RolloutDevicePublic] = []
    for m in members:
        dev = crud.get_device(session, device_id=m.device_id)
        reported = ((dev.reported if dev else None) or {}).get("cameras") or {}
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
            )
        )
    progress_counts = {
        k: sum(m.state == k for m in members) for k in ("applying", "active", "failed", "rolled_back")
    }
    progress_counts["admitted"] = len(members)
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
        model=dep.model,
        version=dep.version,
        variant=dep.variant,
        selector=dep.selector,
        cameras=list(dep.cameras or []),
        priority=dep.priority,
        state=dep.state,
        created_at=dep.created_at,
        rollout=rollout_public(session, dep, ro) if ro is not None else None,
    )


def _cut_off(rt: ControllerRuntime, device_id: str) -> None:
    """Say offline for a device the broker has just disconnected: Mosquitto's dynsec kicks a client
    without publishing its Last Will, which would leave its retained ``online`` birth standing."""
    rt.bridge.publish_message(
        device_id, TopicKind.AVAILABILITY, Availability(state="offline", ts=time.time())
    )


def build_router() -> APIRouter:
    root = APIRouter()
    api = APIRouter(prefix="/api/v1")

    @root.get(
        "/healthz",
        response_model=Health,
        response_model_exclude_none=True,  # mqtt_error only when there is one
        summary="Liveness: database reachable, MQTT connected (or why not: mqtt_error)",
    )
    def healthz(rt: RuntimeDep, response: Response) -> Health:
        db_ok = rt.db_ok()
        mqtt_ok = rt.bridge.connected
        if not db_ok:
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return Health(
            status="ok" if db_ok and mqtt_ok else "degraded",
            db=db_ok,
            mqtt=mqtt_ok,
            mqtt_error=None if mqtt_ok else rt.bridge.link_error,
        )

    # ------------------------------------------------------------------ devices

    @api.post(
        "/devices",
        response_model=EnrolledDevice,
        status_code=status.HTTP_201_CREATED,
        summary="Enroll a device (idempotent: updates name/labels of an existing one); "
        "the answer carries the artifact public key the device's agent must be given and, when the "
        "controller manages broker credentials, the device's MQTT password (shown once; enrolling "
        "again issues a new one)",
        responses={503: {"description": "the broker could not be given the device's credentials"}},
    )
    def enroll(body: DeviceCreate, session: SessionDep, rt: RuntimeDep) -> EnrolledDevice:
        dev = crud.enroll_device(session, device_in=body)
        password: str | None = None
        was_online = dev.status == "online"
        if rt.broker_admin is not None:
            password = generate_password()
            crud.set_mqtt_credentials(session, device=dev, password_hash=hash_password(password))
            try:
                # Broker first: a refused broker leaves the database untouched (not committed).
                rt.broker_admin.issue(dev.id, password)
            except BrokerAdminError as exc:
                raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, detail=str(exc)) from None
            if was_online:
                _cut_off(rt, dev.id)
        session.commit()
        if "labels" in body.model_fields_set and rt.twin.recompute(dev.id) is not None:
            session.refresh(dev)
        public = DevicePublic.from_row(dev, rt.ingest.stats(dev.id))
        return EnrolledDevice(
            **public.model_dump(),
            artifact_public_key=rt.signer.public_key,
            artifact_key_id=rt.signer.key_id,
            mqtt_username=dev.id if password is not None else None,
            mqtt_password=password,
        )

    @api.post(
        "/devices/{device_id}/revoke",
        response_model=RevokedDevice,
        summary="Revoke a device's broker credentials: deleted on the broker, which disconnects the "
        "device now and refuses it from then on; its data stays. Enrolling it again issues new ones",
        responses={
            404: {"description": "unknown device"},
            409: {"description": "the controller does not manage broker credentials"},
            503: {"description": "the broker could not be reached or refused"},
        },
    )
    def revoke(device_id: DeviceIdPath, session: SessionDep, rt: RuntimeDep) -> RevokedDevice:
        if rt.broker_admin is None:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                detail="broker credentials are not managed by this controller "
                "(EDGEFLEET_MQTT_BROKER_AUTH=none)",
            )
        dev = crud.get_device(session, device_id=device_id)
        if dev is None:
            raise _not_found(f"device {device_id!r} is not known")
        try:
            rt.broker_admin.revoke(dev.id)
        except BrokerAdminError as exc:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, detail=str(exc)) from None
        revoked_at = crud.revoke_mqtt_credentials(session, device=dev)
        session.commit()
        _cut_off(rt, dev.id)
        return RevokedDevice(id=dev.id, mqtt_username=dev.id, revoked_at=revoked_at)

    @api.get("/devices", response_model=list[DevicePublic], summary="All devices with status and stats")
    def list_devices(session: SessionDep, rt: RuntimeDep) -> list[DevicePublic]:
        return [DevicePublic.from_row(d, rt.ingest.stats(d.id)) for d in crud.list_devices(session)]

    @api.get(
        "/devices/{device_id}",
        response_model=DevicePublic,
        summary="One device: status, cameras, models, health, twin versions, ingest stats",
        responses={404: {"description": "unknown device"}},
    )
    def get_device(device_id: DeviceIdPath, session: SessionDep, rt: RuntimeDep) -> DevicePublic:
        dev = crud.get_device(session, device_id=device_id)
        if dev is None:
            raise _not_found(f"device {device_id!r} is not known")
        return DevicePublic.from_row(dev, rt.ingest.stats(dev.id))

    @api.get(
        "/devices/{device_id}/health",
        response_model=list[HealthSamplePublic],
        summary="Heartbeat history, newest first",
        responses={404: {"description": "unknown device"}},
    )
    def device_health(
        device_id: DeviceIdPath,
        session: SessionDep,
        since: Annotated[datetime | None, Query(description="ISO 8601 or unix seconds")] = None,
        until: Annotated[datetime | None, Query(description="ISO 8601 or unix seconds (exclusive)")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[HealthSamplePublic]:
        if crud.get_device(session, device_id=device_id) is None:
            raise _not_found(f"device {device_id!r} is not known")
        rows = crud.health_history(session, device_id=device_id, since=since, until=until, limit=limit)
        return [HealthSamplePublic(device_id=r.device_id, ts=r.ts, payload=r.payload) for r in rows]

    @api.put(
        "/devices/{device_id}/labels",
        response_model=DevicePublic,
        summary="Replace a device's labels; its desired state is derived again from the deployments",
        responses={404: {"description": "unknown device"}},
    )
    def put_labels(device_id: DeviceIdPath, body: LabelsBody, rt: RuntimeDep) -> DevicePublic:
        with Session(rt.engine) as session:
            dev = crud.get_device(session, device_id=device_id)
            if dev is None:
                raise _not_found(f"device {device_id!r} is not known")
            dev.labels = dict(body.labels)
            session.add(dev)
            session.commit()
        rt.twin.recompute(device_id)
        with Session(rt.engine) as session:
            dev = crud.get_device(session, device_id=device_id)
            assert dev is not None
            return DevicePublic.from_row(dev, rt.ingest.stats(dev.id))

    # ------------------------------------------------------------------ deployments / rollouts

    def _deployment_or_404(session: Session, ref: str) -> Deployment:
        dep = get_deployment(session, ref)
        if dep is None or dep.state == "deleted":
            raise _not_found(f"deployment {ref!r} is not known")
        return dep

    @api.post(
        "/deployments",
        response_model=DeploymentPublic,
        status_code=status.HTTP_201_CREATED,
        summary="Deploy a model version to the devices a label selector matches, in waves with health gates",
        responses={
            404: {"description": "unknown model version"},
            409: {"description": "name taken, or a pinned variant that is not fit"},
            422: {"description": "bad selector or waves; the detail names the problem"},
        },
    )
    def create_deployment(body: DeploymentCreate, rt: RuntimeDep) -> DeploymentPublic:
        name = body.name or f"{body.model}-{body.version}"[:40] + f"-{datetime.now(UTC):%Y%m%d%H%M%S%f}"
        try:
            dep_id = rt.rollouts.create(
                name=name,
                model=body.model,
                version=body.version,
                selector=body.selector,
                variant=body.variant,
                cameras=[c.model_dump(exclude_none=True) for c in body.cameras],
                priority=body.priority,
                waves=body.waves,
                gate=body.gate,
            )
        except DeploymentError as exc:
            if exc.status == 422:
                raise HTTPException(
                    422, detail=[{"loc": ["body"], "msg": str(exc), "type": "value_error"}]
                ) from None
            raise HTTPException(exc.status, str(exc)) from None
        with Session(rt.engine) as session:
            dep = session.get(Deployment, dep_id)
            assert dep is not None
            return deployment_public(session, dep)

    @api.get("/deployments", response_model=list[DeploymentPublic], summary="Deployments with their rollouts")
    def deployments(session: SessionDep) -> list[DeploymentPublic]:
        return [deployment_public(session, d) for d in list_deployments(session)]

    @api.get(
        "/deployments/{ref}",
        response_model=DeploymentPublic,
        summary="One deployment (by id or name): rollout, waves, gate evaluations, per-device state",
        responses={404: {"description": "unknown deployment"}},
    )
    def deployment(ref: NamePath, session: SessionDep) -> DeploymentPublic:
        return deployment_public(session, _deployment_or_404(session, ref))

    def _operation(name: str, doc: str) -> None:
        @api.post(
            f"/deployments/{{ref}}/{name}",
            response_model=DeploymentPublic,
            summary=doc,
            responses={404: {"description": "unknown deployment"}},
            name=f"{name}_deployment",
        )
        def operate(ref: NamePath, rt: RuntimeDep) -> DeploymentPublic:
            with Session(rt.engine) as session:
                _deployment_or_404(session, ref)
            try:
                dep_id = getattr(rt.rollouts, name)(ref)
            except NotFoundError as exc:
                raise _not_found(str(exc)) from None
            with Session(rt.engine) as session:
                dep = session.get(Deployment, dep_id)
                assert dep is not None
                return deployment_public(session, dep)

    _operation("pause", "Stop admitting new waves (checks of the current one go on); idempotent")
    _operation("resume", "Admit waves again; idempotent")
    _operation("cancel", "Stop: devices already active keep it, devices still applying go back; idempotent")
    _operation("rollback", "Every device it reached goes back to its previous layer; any state, idempotent")

    @api.delete(
        "/deployments/{ref}",
        status_code=status.HTTP_204_NO_CONTENT,
        summary="Delete a deployment: each device it applied to falls back to its next layer (a "
        "lower-priority deployment or its direct assignment) and gets a new desired state; a rollout "
        "still running or paused is cancelled first. The name is free again afterwards",
        responses={404: {"description": "unknown deployment, or already deleted"}},
    )
    def delete_deployment(ref: NamePath, rt: RuntimeDep) -> Response:
        try:
            rt.rollouts.delete(ref)
        except NotFoundError as exc:
            raise _not_found(str(exc)) from None
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    @api.get("/rollouts", response_model=list[RolloutPublic], summary="Every rollout, newest first")
    def rollouts(session: SessionDep) -> list[RolloutPublic]:
        out = []
        for dep in reversed(list_deployments(session)):
            assert dep.id is not None
            ro = rollout_of(session, dep.id)
            if ro is not None:
                out.append(rollout_public(session, dep, ro))
        return out

    # ------------------------------------------------------------------ twin

    @api.put(
        "/devices/{device_id}/cameras/{camera}/model",
        response_model=DesiredState,
        summary="Run a model version on a camera: publishes the device's new desired state (retained)",
        responses={404: {"description": "unknown device or model"}},
    )
    def assign_model(
        device_id: DeviceIdPath, camera: CameraPath, body: AssignModel, rt: RuntimeDep
    ) -> DesiredState:
        try:
            return rt.twin.assign(
                device_id=device_id,
                camera=camera,
                model=body.model,
                version=body.version,
                threshold=body.threshold,
                max_fps=body.max_fps,
                labels=body.labels,
                variant=body.variant,
            )
        except NotFoundError as exc:
            raise _not_found(str(exc)) from None
        except ConflictError as exc:
            raise HTTPException(status_code=status.HTTP_409_CONFLICT, detail=str(exc)) from None

    @api.delete(
        "/devices/{device_id}/cameras/{camera}/model",
        response_model=DesiredState,
        summary="Stop running a model on a camera: publishes the new desired state (retained)",
        responses={404: {"description": "unknown device, or no model on that camera"}},
    )
    def remove_model(device_id: DeviceIdPath, camera: CameraPath, rt: RuntimeDep) -> DesiredState:
        try:
            return rt.twin.remove(device_id=device_id, camera=camera)
        except NotFoundError as exc:
            raise _not_found(str(exc)) from None

    # ------------------------------------------------------------------ detections / events

    @api.get(
        "/detections",
        response_model=DetectionPage,
        summary="Stored detections, newest capture first, paginated by an opaque cursor",
    )
    def list_detections(
        session: SessionDep,
        device: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        camera: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        label: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        since: Annotated[
            datetime | None, Query(description="captured at or after (ISO 8601 or unix s)")
        ] = None,
        until: Annotated[datetime | None, Query(description="captured before (ISO 8601 or unix s)")] = None,
        min_score: Annotated[float | None, Query(ge=0.0, le=1.0)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Annotated[str | None, Query(max_length=200)] = None,
    ) -> DetectionPage:
        q = select(Detection)
        if device is not None:
            q = q.where(col(Detection.device_id) == device)
        if camera is not None:
            q = q.where(col(Detection.camera) == camera)
        if label is not None:
            q = q.where(col(Detection.label) == label)
        if since is not None:
            q = q.where(col(Detection.captured_at) >= since)
        if until is not None:
            q = q.where(col(Detection.captured_at) < until)
        if min_score is not None:
            q = q.where(col(Detection.score) >= min_score)
        if cursor is not None:
            c_ts, c_id = decode_cursor(cursor)
            q = q.where(
                sa.or_(
                    col(Detection.captured_at) < c_ts,
                    sa.and_(col(Detection.captured_at) == c_ts, col(Detection.id) < c_id),
                )
            )
        q = q.order_by(col(Detection.captured_at).desc(), col(Detection.id).desc()).limit(limit + 1)
        rows = list(session.exec(q).all())
        more = len(rows) > limit
        rows = rows[:limit]
        items = [
            DetectionOut(
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
            )
            for r in rows
        ]
        last = rows[-1] if rows else None
        nxt = (
            encode_cursor(last.captured_at, last.id)
            if more and last is not None and last.id is not None
            else None
        )
        return DetectionPage(items=items, next_cursor=nxt)

    @api.get("/events", response_model=list[EventPublic], summary="Device events, newest first")
    def list_events(
        session: SessionDep,
        device: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        kind: Annotated[str | None, Query(max_length=32, pattern=_NO_NUL)] = None,
        since: Annotated[datetime | None, Query(description="ISO 8601 or unix seconds")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[Any]:
        return list(crud.list_events(session, device_id=device, kind=kind, since=since, limit=limit))

    # ------------------------------------------------------------------ keys

    @api.get(
        "/keys/artifacts",
        response_model=ArtifactKey,
        summary="The public key agents verify artifact signatures with",
    )
    def artifact_key(rt: RuntimeDep) -> ArtifactKey:
        return ArtifactKey(public_key=rt.signer.public_key, key_id=rt.signer.key_id)

    # ------------------------------------------------------------------ models / stats

    def _public(mv: ModelVersion, variants: list[Any]) -> ModelVersionPublic:
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

    def _version_or_404(session: Session, name: str, version: str) -> ModelVersion:
        mv = crud.get_model_version(session, name=name, version=version)
        if mv is None:
            raise _not_found(f"model {name!r} version {version!r} is not registered")
        return mv

    @api.get(
        "/models", response_model=list[ModelVersionPublic], summary="Registered model versions with variants"
    )
    def list_models(session: SessionDep) -> list[ModelVersionPublic]:
        variants = crud.variants_by_version(session)
        return [_public(mv, variants.get(mv.id or -1, [])) for mv in crud.list_model_versions(session)]

    @api.post(
        "/models",
        response_model=ModelVersionPublic,
        status_code=status.HTTP_201_CREATED,
        summary="Upload an ONNX model (multipart: file, name, version, optional manifest JSON); "
        "validated, stored by sha256, variants built in the background",
        responses={
            200: {"description": "the same name:version with identical bytes was already registered"},
            400: {"description": "not a usable ONNX model; the detail says why"},
            409: {"description": "name:version exists with other bytes"},
            413: {"description": "over the size limit"},
            422: {"description": "missing or invalid name/version"},
        },
    )
    async def upload_model(request: Request, response: Response, rt: RuntimeDep) -> ModelVersionPublic:
        limit = rt.settings.max_upload_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit + 2 * 1024 * 1024:
            raise HTTPException(413, f"upload of {declared} bytes exceeds the size limit of {limit} bytes")
        build = rt.settings.build_variants_on_upload
        try:
            parsed = await parse_multipart(
                request.headers.get("content-type", ""), request.stream(), rt.store, limit=limit
            )
            reg = await run_in_threadpool(register_upload, rt.engine, rt.store, parsed, build=build)
        except UploadError as exc:
            raise HTTPException(exc.status, str(exc)) from None
        if reg.created:
            if build:
                rt.variants.submit(reg.model_version_id)
        else:
            response.status_code = status.HTTP_200_OK
        with Session(rt.engine) as s:
            mv = crud.get_model_version_by_id(s, model_version_id=reg.model_version_id)
            assert mv is not None
            return _public(mv, list(crud.list_variants(s, model_version_id=reg.model_version_id)))

    @api.get(
        "/models/{name}/versions/{version}",
        response_model=ModelVersionPublic,
        summary="One model version: manifest, build status and progress, variants with their figures",
        responses={404: {"description": "unknown model version"}},
    )
    def get_model(name: NamePath, version: NamePath, session: SessionDep) -> ModelVersionPublic:
        mv = _version_or_404(session, name, version)
        assert mv.id is not None
        return _public(mv, list(crud.list_variants(session, model_version_id=mv.id)))

    @api.delete(
        "/models/{name}/versions/{version}",
        status_code=status.HTTP_204_NO_CONTENT,
        summary="Delete a model version and its variants; its files are collected",
        responses={404: {"description": "unknown model version"}, 409: {"description": "in use"}},
    )
    def delete_model(name: NamePath, version: NamePath, session: SessionDep, rt: RuntimeDep) -> Response:
        mv = _version_or_404(session, name, version)
        users = [d.id for d in crud.devices_with_desired(session) if (name, version) in uses(d)]
        deps = [
            d.name
            for d in list_deployments(session)
            if (d.model, d.version) == (name, version) and d.state in APPLIED_STATES
        ]
        if deps:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"{name}:{version} is deployed by {', '.join(deps[:10])}; roll it back first",
            )
        if users:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"{name}:{version} is in the desired state of {', '.join(users[:10])}; unassign it first",
            )
        assert mv.id is not None
        crud.delete_variants(session, model_version_id=mv.id)
        session.delete(mv)
        session.commit()
        rt.store.collect_garbage(rt.engine)
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    @api.get(
        "/stats/ingest", response_model=IngestStats, summary="Ingest counters per topic kind and outcome"
    )
    def ingest_stats(rt: RuntimeDep) -> IngestStats:
        return IngestStats(
            counters=rt.bridge.counters.snapshot(),
            queue_depth=rt.ingest.queue_depth,
            queue_max=rt.settings.ingest_queue_max,
            status_queue_depth=rt.status.queue_depth,
            mqtt_connected=rt.bridge.connected,
        )

    root.include_router(api)
    return root
