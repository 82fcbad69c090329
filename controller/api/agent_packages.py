"""``/api/v1/agent-packages``, ``/api/v1/agent-deployments`` and ``/api/v1/devices/{id}/agent``: the
edge agent's own software: packages uploaded and checked, rolled out to the devices a
selector matches in waves with health gates (an agent deployment: rollback, pause, cancel and delete
are the deployments' own routes), or set for one device directly."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlmodel import Session

from controller.api.deps import DeviceIdPath, IdPath, RuntimeDep, SessionDep
from controller.api.presenters import deployment_public
from controller.api.schemas import AgentDeploymentCreate, DeploymentPublic, DeviceAgentAssign
from controller.db.tables import AgentPackage, AgentPackagePublic, Deployment
from controller.errors import NotFoundError, TooLargeError
from controller.registry.agent_packages import delete_package, get_package, list_packages, register_package
from controller.registry.uploads import parse_multipart
from controller.types import NO_NUL_PATTERN
from fleet_protocol.messages import DesiredState

router = APIRouter(prefix="/api/v1", tags=["agent"])

# Room for the multipart framing around the file.
_FRAMING_BYTES = 2 * 1024 * 1024


def _public(pkg: AgentPackage) -> AgentPackagePublic:
    return AgentPackagePublic.model_validate(pkg, from_attributes=True)


def _package_or_404(session: Session, version: str) -> AgentPackage:
    pkg = get_package(session, version)
    if pkg is None:
        raise NotFoundError(f"agent version {version!r} is not uploaded")
    return pkg


@router.post(
    "/agent-packages",
    response_model=AgentPackagePublic,
    status_code=status.HTTP_201_CREATED,
    summary="Upload an agent package (multipart: file = edgefleet-agent-VERSION.tar.gz, made by "
    "`python -m edge_agent.update.package build`); checked, then stored by sha256",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file"],
                        "properties": {
                            "file": {"type": "string", "format": "binary", "description": "the package"}
                        },
                    }
                }
            },
        }
    },
    responses={
        400: {"description": "not a valid agent package; the detail says why"},
        409: {"description": "this agent version was already uploaded"},
        413: {
            "description": "over a size limit: the upload, a file inside it once unpacked "
            "(max_package_member_bytes), or the whole package unpacked (max_package_unpacked_bytes)"
        },
        422: {"description": "no file, or bad notes"},
    },
)
async def upload_package(
    request: Request,
    rt: RuntimeDep,
    notes: Annotated[str | None, Query(max_length=2000, pattern=NO_NUL_PATTERN)] = None,
) -> AgentPackagePublic:
    limit = rt.settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + _FRAMING_BYTES:
        raise TooLargeError(f"upload of {declared} bytes exceeds the size limit of {limit} bytes")
    parsed = await parse_multipart(
        request.headers.get("content-type", ""), request.stream(), rt.store, limit=limit
    )
    pkg = await run_in_threadpool(
        register_package,
        rt.engine,
        rt.store,
        parsed.file,
        notes=notes,
        max_member_bytes=rt.settings.max_package_member_bytes,
        max_unpacked_bytes=rt.settings.max_package_unpacked_bytes,
    )
    return _public(pkg)


@router.get("/agent-packages", response_model=list[AgentPackagePublic], summary="Uploaded agent packages")
def packages(session: SessionDep) -> list[AgentPackagePublic]:
    return [_public(p) for p in list_packages(session)]


@router.get(
    "/agent-packages/{version}",
    response_model=AgentPackagePublic,
    summary="One agent package: sha256, size, pinned requirements",
    responses={404: {"description": "not uploaded"}},
)
def package(version: IdPath, session: SessionDep) -> AgentPackagePublic:
    return _public(_package_or_404(session, version))


@router.delete(
    "/agent-packages/{version}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete an agent package no deployment and no device's desired state needs",
    responses={404: {"description": "not uploaded"}, 409: {"description": "deployed or desired"}},
)
def remove_package(version: IdPath, rt: RuntimeDep) -> Response:
    delete_package(rt.engine, version)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/agent-deployments",
    response_model=DeploymentPublic,
    status_code=status.HTTP_201_CREATED,
    summary="Deploy an agent version to the devices a label selector matches, in waves with health gates "
    "(a deployment of kind agent: /deployments/{ref}/rollback, pause, cancel and delete apply)",
    responses={
        404: {"description": "agent version not uploaded"},
        409: {"description": "name taken"},
        422: {"description": "bad selector or waves; the detail names the problem"},
    },
)
def create_agent_deployment(
    body: AgentDeploymentCreate, session: SessionDep, rt: RuntimeDep
) -> DeploymentPublic:
    name = body.name or f"agent-{body.version}"[:40] + f"-{datetime.now(UTC):%Y%m%d%H%M%S%f}"
    dep_id = rt.rollouts.create_agent(
        name=name,
        version=body.version,
        selector=body.selector,
        priority=body.priority,
        waves=body.waves,
        gate=body.gate,
        health_timeout_s=body.health_timeout_s,
    )
    session.expire_all()
    dep = session.get(Deployment, dep_id)
    assert dep is not None
    return deployment_public(session, dep)


@router.put(
    "/devices/{device_id}/agent",
    response_model=DesiredState,
    summary="Set the agent version one device runs (below every agent deployment); null clears it. "
    "Returns the device's desired state",
    responses={404: {"description": "unknown device, or agent version not uploaded"}},
)
def assign_agent(device_id: DeviceIdPath, body: DeviceAgentAssign, rt: RuntimeDep) -> DesiredState:
    return rt.twin.assign_agent(
        device_id=device_id, version=body.version, health_timeout_s=body.health_timeout_s
    )
