"""Remote troubleshooting of one device over its command topics: its recent log, a diagnostics bundle
with the clock offset, a probe of a camera's source, and restarts of a camera or of the agent.

Each needs the operator role (a device's log and configuration are not for every viewer, and a
restart changes the fleet), and each is recorded before it is sent as a ``remote_command`` event that
names who asked: the audit trail shows a restart even when the device never answers.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field
from sqlmodel import Session

from controller.api.deps import IdPath, RuntimeDep, SessionDep, utc
from controller.db import crud
from controller.db.states import DeviceStatus
from controller.db.tables import SOURCE_CONTROLLER, Event, utcnow
from controller.errors import ConflictError, NotFoundError, UnavailableError
from controller.link.commands import CommandFailedError
from controller.runtime import ControllerRuntime
from controller.security.tokens import Principal
from fleet_protocol.messages import CommandName, CommandResult

router = APIRouter(prefix="/api/v1/devices", tags=["device troubleshooting"])

REMOTE_COMMAND_EVENT = "remote_command"

# What asking a device may answer besides 200 (``ask_device``), for the OpenAPI schema.
ASK_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"description": "unknown device or camera"},
    409: {"description": "device offline"},
    502: {"description": "the device answered with an error"},
    503: {"description": "the device is busy or not ready, or the controller is not connected to MQTT"},
    504: {"description": "the device did not answer in time"},
}

Timeout = Annotated[float | None, Query(gt=0, le=60, description="seconds; default from settings")]
Level = Literal["debug", "info", "warning", "error", "critical"]


def ask_device(
    session: Session,
    rt: ControllerRuntime,
    device_id: str,
    name: CommandName,
    args: dict[str, Any],
    *,
    timeout: float | None,
    doing: str,
    audit: Principal | None = None,
) -> CommandResult:
    """Send ``name`` to an enrolled, online device and wait for its answer; a refusal raises.

    404: unknown device (or camera, as the device says); 409: device offline; 503: no broker, or the
    device is busy; 504: no answer in time; 502: any other error of the device. ``audit``: record
    who asked, as a controller event, before sending.
    """
    dev = crud.get_device(session, device_id=device_id)
    if dev is None:
        raise NotFoundError(f"device {device_id!r} is not known")
    if dev.status != DeviceStatus.ONLINE:
        since = f" since {dev.offline_since.isoformat()}" if dev.offline_since is not None else ""
        raise ConflictError(f"device {device_id} is offline{since}; to {doing} it must be online")
    if not rt.bridge.connected:
        raise UnavailableError("the controller is not connected to the MQTT broker")
    if audit is not None:
        shown = {k: v for k, v in args.items() if k != "sent_at"}
        session.add(
            Event(
                device_id=device_id,
                ts=utcnow(),
                kind=REMOTE_COMMAND_EVENT,
                severity="info",
                message=f"{name.value} asked by {audit.name} ({audit.role.value})",
                data={"command": name.value, "args": shown, "by": audit.name, "role": audit.role.value},
                source=SOURCE_CONTROLLER,
                stored_at=utcnow(),
            )
        )
        session.commit()
    # Give the connection back before waiting for the device, which may take up to `timeout`.
    session.close()
    res = rt.commands.request(device_id, name, args, timeout=timeout or rt.settings.command_timeout_s)
    if not res.ok:
        raise CommandFailedError.of(device_id, res.error, doing=doing)
    return res


def _principal(request: Request) -> Principal | None:
    p = getattr(request.state, "principal", None)
    return p if isinstance(p, Principal) else None


class LogLineOut(BaseModel):
    ts: float = Field(description="unix seconds, the device's clock")
    level: str
    logger: str
    thread: str
    message: str = Field(description="redacted on the device: no password, token or secret")


class LogsOut(BaseModel):
    device: str
    level: str
    lines: list[LogLineOut]
    lost: int = Field(description="lines the device's bounded in-memory log has let go since it started")


@router.get(
    "/{device_id}/logs",
    response_model=LogsOut,
    responses=ASK_RESPONSES,
    summary="The agent's newest log lines (operator; redacted on the device), oldest first",
)
def device_logs(
    device_id: IdPath,
    request: Request,
    session: SessionDep,
    rt: RuntimeDep,
    lines: Annotated[int, Query(ge=1, le=500)] = 200,
    level: Level = "debug",
    since: Annotated[
        datetime | None, Query(description="only lines newer than this: ISO 8601 or unix seconds")
    ] = None,
    timeout: Timeout = None,
) -> LogsOut:
    args: dict[str, Any] = {"lines": lines, "level": level}
    if since is not None:
        args["since"] = utc(since).timestamp()
    res = ask_device(
        session,
        rt,
        device_id,
        CommandName.LOGS,
        args,
        timeout=timeout,
        doing="send its log",
        audit=_principal(request),
    )
    return LogsOut.model_validate({"device": device_id, **res.result})


class ClockOut(BaseModel):
    offset_s: float = Field(description="device clock minus controller clock")
    round_trip_s: float = Field(description="controller → broker → device → broker → controller")
    off: bool = Field(description="the offset is over the controller's clock_off_threshold_s either way")


class DiagnosticsOut(BaseModel):
    device: str
    clock: ClockOut | None = Field(description="None: the agent sent no clock reading")
    bundle: dict[str, Any] = Field(description="what the agent reports (PROTOCOL.md 'Commands')")


def clock_reading(sent: float, answer: dict[str, Any], received: float, *, off_s: float) -> ClockOut | None:
    """NTP's offset and delay from the controller's send and receive times and the device's two."""
    t1, t2 = answer.get("received_at"), answer.get("answered_at")
    if not all(isinstance(t, int | float) and not isinstance(t, bool) for t in (t1, t2)):
        return None
    assert isinstance(t1, int | float) and isinstance(t2, int | float)
    offset = ((t1 - sent) + (t2 - received)) / 2
    rtt = max(0.0, (received - sent) - (t2 - t1))
    return ClockOut(offset_s=round(offset, 4), round_trip_s=round(rtt, 4), off=abs(offset) > off_s)


@router.get(
    "/{device_id}/diagnostics",
    response_model=DiagnosticsOut,
    responses=ASK_RESPONSES,
    summary="A diagnostics bundle from the agent (operator): versions, inference stack, config without "
    "secrets, disk, uplink errors, outbox, and the device's clock offset",
)
def device_diagnostics(
    device_id: IdPath, request: Request, session: SessionDep, rt: RuntimeDep, timeout: Timeout = None
) -> DiagnosticsOut:
    sent = time.time()
    res = ask_device(
        session,
        rt,
        device_id,
        CommandName.DIAGNOSTICS,
        {"sent_at": sent},
        timeout=timeout,
        doing="send diagnostics",
        audit=_principal(request),
    )
    received = time.time()
    clock = res.result.get("clock")
    off_s = rt.settings.clock_off_threshold_s
    reading = clock_reading(sent, clock, received, off_s=off_s) if isinstance(clock, dict) else None
    return DiagnosticsOut(device=device_id, clock=reading, bundle=res.result)


@router.post(
    "/{device_id}/cameras/{camera}/probe",
    responses=ASK_RESPONSES,
    summary="Open the camera's source on a connection of its own and read one frame (operator): codec, "
    "resolution, FPS and time to first frame, or the error",
)
def probe_camera(
    device_id: IdPath,
    camera: IdPath,
    request: Request,
    session: SessionDep,
    rt: RuntimeDep,
    probe_timeout_s: Annotated[float, Query(gt=0, le=30, description="the device's bound")] = 10.0,
) -> dict[str, Any]:
    res = ask_device(
        session,
        rt,
        device_id,
        CommandName.PROBE_CAMERA,
        {"camera": camera, "timeout_s": probe_timeout_s},
        timeout=probe_timeout_s + rt.settings.command_timeout_s,
        doing="probe a camera",
        audit=_principal(request),
    )
    return {"device": device_id, **res.result}


@router.post(
    "/{device_id}/cameras/{camera}/restart",
    summary="Reopen one camera's source (operator)",
    responses=ASK_RESPONSES,
)
def restart_camera(
    device_id: IdPath, camera: IdPath, request: Request, session: SessionDep, rt: RuntimeDep
) -> dict[str, Any]:
    res = ask_device(
        session,
        rt,
        device_id,
        CommandName.RESTART_CAMERA,
        {"camera": camera},
        timeout=None,
        doing="restart a camera",
        audit=_principal(request),
    )
    return {"device": device_id, **res.result}


@router.post(
    "/{device_id}/restart",
    responses=ASK_RESPONSES,
    summary="Restart the agent process (operator): it answers first, comes back by itself and says why "
    "in its agent_started event",
)
def restart_agent(device_id: IdPath, request: Request, session: SessionDep, rt: RuntimeDep) -> dict[str, Any]:
    who = _principal(request)
    res = ask_device(
        session,
        rt,
        device_id,
        CommandName.RESTART_AGENT,
        {"by": who.name if who else ""},
        timeout=None,
        doing="restart",
        audit=who,
    )
    return {"device": device_id, **res.result}
