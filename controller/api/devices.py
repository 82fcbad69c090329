"""``/api/v1/devices``: enrollment and broker credentials, status, health history, labels, and a
camera's snapshot asked of the device."""

from __future__ import annotations

import base64
import binascii
import math
import time
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response, status

from controller.api.deps import DeviceIdPath, IdPath, RuntimeDep, SessionDep
from controller.api.device_commands import ASK_RESPONSES, ask_device
from controller.api.presenters import device_public, with_clock
from controller.api.schemas import DevicePublic, EnrolledDevice, LabelsBody, RevokedDevice
from controller.db import crud
from controller.db.states import DeviceStatus
from controller.db.tables import Device, DeviceCreate, HealthSamplePublic
from controller.errors import ConflictError, DeviceError, NotFoundError
from controller.link.broker_auth import check_device_id, generate_password, hash_password
from controller.runtime import ControllerRuntime
from fleet_protocol import TopicKind
from fleet_protocol.messages import Availability, CommandName

router = APIRouter(prefix="/api/v1/devices", tags=["devices"])


def _unknown(device_id: str) -> NotFoundError:
    return NotFoundError(f"device {device_id!r} is not known")


def _cut_off(rt: ControllerRuntime, device_id: str) -> None:
    """Say offline for a device the broker has just disconnected: Mosquitto's dynsec kicks a client
    without publishing its Last Will, which would leave its retained ``online`` birth standing."""
    rt.bridge.publish_message(
        device_id, TopicKind.AVAILABILITY, Availability(state="offline", ts=time.time())
    )


@router.post(
    "",
    response_model=EnrolledDevice,
    status_code=status.HTTP_201_CREATED,
    summary="Enroll a device (idempotent: updates name/labels of an existing one); "
    "the answer carries the artifact public key the device's agent must be given and, when the "
    "controller manages broker credentials, the device's MQTT password (shown once; enrolling "
    "again issues a new one)",
    responses={
        409: {"description": "the broker has a user of that name that is not an edgefleet device"},
        422: {"description": "invalid or reserved device id (the controller's or admin's broker user)"},
        503: {"description": "the broker could not be given the device's credentials"},
    },
)
def enroll(body: DeviceCreate, session: SessionDep, rt: RuntimeDep) -> EnrolledDevice:
    # A device id is its broker user name and client id: never the controller's, the admin's or a
    # reserved one (ReservedIdError: a 422), whether or not the controller manages the broker.
    check_device_id(body.id, rt.settings.reserved_broker_names())
    was_decommissioned = (
        known := crud.get_device(session, device_id=body.id)
    ) is not None and known.status == DeviceStatus.DECOMMISSIONED
    dev = crud.enroll_device(session, device_in=body)
    password: str | None = None
    was_online = dev.status == DeviceStatus.ONLINE
    if rt.broker_admin is not None:
        password = generate_password()
        crud.set_mqtt_credentials(session, device=dev, password_hash=hash_password(password))
        # Broker first: a refused broker (BrokerAdminError, a 503) leaves the database untouched
        # (not committed).
        rt.broker_admin.issue(dev.id, password)
        if was_online:
            _cut_off(rt, dev.id)
    session.commit()
    if was_decommissioned:
        # Back: its messages are taken again, and its desired state (cleared on the broker at the
        # decommission) is derived and published again: a new version, or the same one again.
        rt.bridge.refuse(dev.id, False)
        if rt.twin.recompute(dev.id) is None:
            rt.twin.publish_latest(dev.id)
        session.refresh(dev)
    elif "labels" in body.model_fields_set and rt.twin.recompute(dev.id) is not None:
        session.refresh(dev)
    public = device_public(dev, rt.ingest.stats(dev.id))
    return EnrolledDevice(
        **public.model_dump(),
        artifact_public_key=rt.signer.public_key,
        artifact_key_id=rt.signer.key_id,
        mqtt_username=dev.id if password is not None else None,
        mqtt_password=password,
    )


@router.post(
    "/{device_id}/revoke",
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
        raise ConflictError(
            "broker credentials are not managed by this controller (EDGEFLEET_MQTT_BROKER_AUTH=none)"
        )
    dev = crud.get_device(session, device_id=device_id)
    if dev is None:
        raise _unknown(device_id)
    rt.broker_admin.revoke(dev.id)  # BrokerAdminError: a 503, nothing revoked here
    revoked_at = crud.revoke_mqtt_credentials(session, device=dev)
    session.commit()
    _cut_off(rt, dev.id)
    return RevokedDevice(id=dev.id, mqtt_username=dev.id, revoked_at=revoked_at)


@router.post(
    "/{device_id}/decommission",
    response_model=DevicePublic,
    summary="Retire a device: its broker credentials are revoked (when the controller manages them), every "
    "retained message on its topics is cleared, deployments and rollouts leave it out, and whatever it "
    "still sends is refused and counted; its detections, events and health stay readable. Enrolling it "
    "again brings it back",
    responses={
        404: {"description": "unknown device"},
        409: {"description": "already decommissioned"},
        503: {"description": "the broker could not be reached or refused: nothing was changed"},
    },
)
def decommission(device_id: DeviceIdPath, session: SessionDep, rt: RuntimeDep) -> DevicePublic:
    dev = session.get(Device, device_id, with_for_update=True)
    if dev is None:
        raise _unknown(device_id)
    if not DeviceStatus(dev.status).can_become(DeviceStatus.DECOMMISSIONED):
        since = dev.decommissioned_at.isoformat() if dev.decommissioned_at is not None else "before"
        raise ConflictError(
            f"device {device_id!r} is already decommissioned (since {since}); enroll it again to bring it back"
        )
    revoked = rt.broker_admin is not None
    if rt.broker_admin is not None:
        rt.broker_admin.revoke(dev.id)  # BrokerAdminError: a 503, nothing changed here
        crud.revoke_mqtt_credentials(session, device=dev)
    crud.decommission_device(session, device=dev, credentials_revoked=revoked)
    session.commit()
    # Refused here at once (other replicas within seconds), before the retained topics are cleared:
    # the empty messages that clear them come back to this controller's subscriptions.
    rt.bridge.refuse(dev.id)
    rt.bridge.clear_retained(dev.id)
    session.refresh(dev)
    return device_public(dev, rt.ingest.stats(dev.id))


@router.get("", response_model=list[DevicePublic], summary="All devices with status and stats")
def list_devices(session: SessionDep, rt: RuntimeDep) -> list[DevicePublic]:
    devices = crud.list_devices(session)
    stats = rt.ingest.stats_many(session, [d.id for d in devices])
    return [device_public(d, stats[d.id]) for d in devices]


@router.get(
    "/{device_id}",
    response_model=DevicePublic,
    summary="One device: status, cameras, models, health, twin versions, ingest stats, clock offset",
    responses={404: {"description": "unknown device"}},
)
def get_device(device_id: DeviceIdPath, session: SessionDep, rt: RuntimeDep) -> DevicePublic:
    dev = crud.get_device(session, device_id=device_id)
    if dev is None:
        raise _unknown(device_id)
    return with_clock(
        device_public(dev, rt.ingest.stats(dev.id)),
        session,
        dev,
        threshold_s=rt.settings.clock_off_threshold_s,
    )


@router.get(
    "/{device_id}/health",
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
        raise _unknown(device_id)
    rows = crud.health_history(session, device_id=device_id, since=since, until=until, limit=limit)
    return [HealthSamplePublic(device_id=r.device_id, ts=r.ts, payload=r.payload) for r in rows]


@router.put(
    "/{device_id}/labels",
    response_model=DevicePublic,
    summary="Replace a device's labels; its desired state is derived again from the deployments",
    responses={404: {"description": "unknown device"}},
)
def put_labels(
    device_id: DeviceIdPath, body: LabelsBody, session: SessionDep, rt: RuntimeDep
) -> DevicePublic:
    dev = crud.get_device(session, device_id=device_id)
    if dev is None:
        raise _unknown(device_id)
    dev.labels = dict(body.labels)
    session.add(dev)
    session.commit()
    rt.twin.recompute(device_id)
    session.refresh(dev)  # what the recompute wrote (its own session)
    return device_public(dev, rt.ingest.stats(dev.id))


@router.get(
    "/{device_id}/cameras/{camera}/snapshot",
    summary="The camera's current frame as JPEG (boxes=true draws the latest detections), asked of the device",
    response_class=Response,
    responses={200: {"content": {"image/jpeg": {}}}, **ASK_RESPONSES},
)
def snapshot(
    device_id: IdPath,
    camera: IdPath,
    session: SessionDep,
    rt: RuntimeDep,
    boxes: bool = False,
    timeout: Annotated[float | None, Query(gt=0, le=60, description="seconds; default from settings")] = None,
) -> Response:
    res = ask_device(
        session,
        rt,
        device_id,
        CommandName.SNAPSHOT,
        {"camera": camera, "boxes": boxes},
        timeout=timeout,
        doing="take a snapshot",
    )
    try:
        jpeg = base64.b64decode(str(res.result.get("jpeg_base64", "")), validate=True)
    except (binascii.Error, ValueError):
        jpeg = b""
    if not jpeg.startswith(b"\xff\xd8"):
        raise DeviceError(f"device {device_id} sent a snapshot that is not a JPEG")
    headers = {"Cache-Control": "no-store", **_snapshot_headers(device_id, res.result)}
    return Response(content=jpeg, media_type="image/jpeg", headers=headers)


# What a snapshot answer may put in the response headers, each coerced to its type first: a device's
# text never reaches a header (a CR/LF or a non-Latin-1 character there was a 500 or a cut connection).
# "boxes" is how many boxes were drawn (the dashboard shows it as a count).
_SNAPSHOT_HEADERS: tuple[tuple[str, type[int] | type[float]], ...] = (
    ("frame", int),
    ("width", int),
    ("height", int),
    ("boxes", int),
    ("captured_at", float),
)


def _snapshot_headers(device_id: str, result: dict[str, Any]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for key, kind in _SNAPSHOT_HEADERS:
        if key not in result:
            continue
        text = _header_number(result[key], kind)
        if text is None:
            what = "a non-negative integer" if kind is int else "a finite number"
            raise DeviceError(f"device {device_id} sent a snapshot whose {key!r} is not {what}")
        headers[f"X-Snapshot-{key.replace('_', '-').title()}"] = text
    return headers


def _header_number(value: object, kind: type[int] | type[float]) -> str | None:
    """``value`` as header text when it is a number of the kind (a bool counts as 0 or 1), else None."""
    if kind is int:
        if isinstance(value, int) and 0 <= value < 2**63:
            return str(int(value))
        return None
    if isinstance(value, int | float) and math.isfinite(value):
        return repr(float(value))
    return None
