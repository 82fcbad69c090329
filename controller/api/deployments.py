"""``/api/v1/deployments`` and ``/api/v1/rollouts``: a model version for the devices a label selector
matches, rolled out in waves with health gates, and the operator's actions on it."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Response, status
from sqlmodel import Session

from controller.api.deps import IdPath, RuntimeDep, SessionDep
from controller.api.presenters import deployment_public, rollout_public
from controller.api.schemas import DeploymentCreate, DeploymentPublic, RolloutPublic
from controller.db.states import DeploymentState
from controller.db.tables import Deployment
from controller.errors import NotFoundError
from controller.fleet.deployments import get_deployment, list_deployments, rollout_of

router = APIRouter(prefix="/api/v1", tags=["deployments"])


def _deployment_or_404(session: Session, ref: str) -> Deployment:
    dep = get_deployment(session, ref)
    if dep is None or dep.state == DeploymentState.DELETED:
        raise NotFoundError(f"deployment {ref!r} is not known")
    return dep


def _present(session: Session, dep_id: int) -> DeploymentPublic:
    """The deployment as a service just left it (written in the service's own session)."""
    session.expire_all()
    dep = session.get(Deployment, dep_id)
    assert dep is not None
    return deployment_public(session, dep)


@router.post(
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
def create_deployment(body: DeploymentCreate, session: SessionDep, rt: RuntimeDep) -> DeploymentPublic:
    name = body.name or f"{body.model}-{body.version}"[:40] + f"-{datetime.now(UTC):%Y%m%d%H%M%S%f}"
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
    return _present(session, dep_id)


@router.get("/deployments", response_model=list[DeploymentPublic], summary="Deployments with their rollouts")
def deployments(session: SessionDep) -> list[DeploymentPublic]:
    return [deployment_public(session, d) for d in list_deployments(session)]


@router.get(
    "/deployments/{ref}",
    response_model=DeploymentPublic,
    summary="One deployment (by id or name): rollout, waves, gate evaluations, per-device state",
    responses={404: {"description": "unknown deployment"}},
)
def deployment(ref: IdPath, session: SessionDep) -> DeploymentPublic:
    return deployment_public(session, _deployment_or_404(session, ref))


def _operation(name: str, doc: str) -> None:
    """``POST /deployments/{ref}/<name>``: the rollout service's action of that name."""

    @router.post(
        f"/deployments/{{ref}}/{name}",
        response_model=DeploymentPublic,
        summary=doc,
        responses={404: {"description": "unknown deployment"}},
        name=f"{name}_deployment",
    )
    def operate(ref: IdPath, session: SessionDep, rt: RuntimeDep) -> DeploymentPublic:
        _deployment_or_404(session, ref)
        dep_id: int = getattr(rt.rollouts, name)(ref)
        return _present(session, dep_id)


_operation("pause", "Stop admitting new waves (checks of the current one go on); idempotent")
_operation("resume", "Admit waves again; idempotent")
_operation("cancel", "Stop: devices already active keep it, devices still applying go back; idempotent")
_operation("rollback", "Every device it reached goes back to its previous layer; any state, idempotent")


@router.delete(
    "/deployments/{ref}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a deployment: each device it applied to falls back to its next layer (a "
    "lower-priority deployment or its direct assignment) and gets a new desired state; a rollout "
    "still running or paused is cancelled first. The name is free again afterwards",
    responses={404: {"description": "unknown deployment, or already deleted"}},
)
def delete_deployment(ref: IdPath, rt: RuntimeDep) -> Response:
    rt.rollouts.delete(ref)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/rollouts", response_model=list[RolloutPublic], summary="Every rollout, newest first")
def rollouts(session: SessionDep) -> list[RolloutPublic]:
    out = []
    for dep in reversed(list_deployments(session)):
        assert dep.id is not None
        ro = rollout_of(session, dep.id)
        if ro is not None:
            out.append(rollout_public(session, dep, ro))
    return out
