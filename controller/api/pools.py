"""``/api/v1/pools``: a site's cameras declared as a pool, placed on the devices a selector matches;
the operator's cordons, drains and moves, and dry-run plans (``controller.fleet.pools``)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Response, status

from controller.api.deps import DeviceIdPath, IdPath, RuntimeDep
from controller.api.schemas import (
    PoolCameraPublic,
    PoolDegraded,
    PoolDevicePublic,
    PoolHeld,
    PoolLoad,
    PoolMove,
    PoolMoveEvent,
    PoolMoveRequest,
    PoolPlacementPublic,
    PoolPlan,
    PoolPlanRequest,
    PoolPublic,
    PoolSummaryPublic,
)
from controller.fleet import placement
from controller.fleet.pools import DryRun, PoolDeclaration, PoolState
from controller.types import ID_MAX, ID_PATTERN

router = APIRouter(prefix="/api/v1", tags=["pools"])

PoolCameraPath = Annotated[
    str, Path(description="camera id in the pool", max_length=ID_MAX, pattern=ID_PATTERN)
]
_UNKNOWN: dict[int | str, dict[str, Any]] = {404: {"description": "unknown pool"}}
_UNKNOWN_MEMBER: dict[int | str, dict[str, Any]] = {
    404: {"description": "unknown pool, or a device that is not in it (not enrolled, or not matched)"}
}


def _move(m: placement.Move) -> PoolMove:
    return PoolMove(camera=m.camera, source=m.source, target=m.target, fps=m.fps, reason=m.reason.value)


def _held(h: placement.Held) -> PoolHeld:
    return PoolHeld(**_move(h.move).model_dump(), why=h.why)


def _load(load: placement.Load) -> PoolLoad:
    util = load.util
    return PoolLoad(
        lane_ms_per_s=round(load.lane_ms_per_s, 3),
        lane_limit=load.lane_limit,
        cpu_ms_per_s=round(load.cpu_ms_per_s, 3),
        cpu_limit=load.cpu_limit,
        cameras=load.cameras,
        util=round(util, 4) if math.isfinite(util) else None,
    )


def _degraded(plan: placement.Plan) -> dict[str, PoolDegraded]:
    return {
        cam: PoolDegraded(fps=d.fps, target_fps=d.target_fps, reason=d.reason)
        for cam, d in plan.degraded.items()
    }


def _placements(plan: placement.Plan) -> dict[str, PoolPlacementPublic]:
    return {
        cam: PoolPlacementPublic(
            device=p.device,
            fps=p.fps,
            since=datetime.fromtimestamp(p.since, UTC),
            canary=p.canary,
            canary_held=plan.canary_held.get(cam),
        )
        for cam, p in plan.placements.items()
    }


def pool_public(st: PoolState) -> PoolPublic:
    pool, plan = st.pool, st.plan
    on: dict[str, int] = {}
    for p in st.placements.values():
        on[p.device_id] = on.get(p.device_id, 0) + 1
    events = []
    for e in st.recent:
        data = e.data or {}
        try:
            events.append(
                PoolMoveEvent(
                    ts=e.ts,
                    camera=str(data["camera"]),
                    source=str(data["source"]),
                    target=str(data["target"]),
                    fps=float(data["fps"]),
                    reason=str(data["reason"]),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue  # not one of ours: only the controller writes this kind, but a row may be hand-made
    return PoolPublic(
        name=pool.name,
        selector=pool.selector,
        strategy=pool.strategy,
        headroom=pool.headroom,
        reserve_n1=pool.reserve_n1,
        failover_grace_s=pool.failover_grace_s,
        failback=pool.failback,
        max_moves_per_min=pool.max_moves_per_min,
        min_dwell_s=pool.min_dwell_s,
        cameras=[
            PoolCameraPublic(
                id=c.camera,
                source=c.source,
                model=c.model,
                version=c.version,
                target_fps=c.target_fps,
                min_fps=c.min_fps,
                priority=c.priority,
                spread_group=c.spread_group,
                prefer=c.prefer,
                pin=c.pin,
            )
            for c in st.cameras
        ],
        devices=[
            PoolDevicePublic(
                id=m.id,
                online=m.online,
                status=m.status,  # type: ignore[arg-type]
                in_grace=m.in_grace,
                cordoned=m.cordoned,
                draining=m.draining,
                cameras=on.get(m.id, 0),
                load=_load(plan.loads[m.id]) if m.id in plan.loads else None,
            )
            for m in st.members
        ],
        placements={
            cam: PoolPlacementPublic(
                device=p.device_id,
                fps=p.fps,
                since=p.since,
                handover_from=p.handover_from,
                canary=p.canary,
                canary_held=p.canary_held,
            )
            for cam, p in sorted(st.placements.items())
        },
        unplaced=dict(plan.unplaced),
        degraded=_degraded(plan),
        pending=[_move(m) for m in plan.moves],
        held=[_held(h) for h in plan.held],
        n_plus_one=plan.n_plus_one,
        canary_held=dict(plan.canary_held),
        recent_moves=events,
        created_at=pool.created_at,
        updated_at=pool.updated_at,
    )


def plan_public(run: DryRun) -> PoolPlan:
    plan = run.plan
    return PoolPlan(
        pool=run.pool,
        fail=run.fail,
        moves=[_move(m) for m in plan.moves],
        held=[_held(h) for h in plan.held],
        unplaced=dict(plan.unplaced),
        degraded=_degraded(plan),
        loads={dev: _load(load) for dev, load in sorted(plan.loads.items())},
        n_plus_one=plan.n_plus_one,
        placements=_placements(plan),
        canary_held=dict(plan.canary_held),
    )


@router.put(
    "/pools/{name}",
    response_model=PoolPublic,
    summary="Declare a pool (create or replace): its devices (a label selector), its placement policy and "
    "its cameras. Cordons, drains and the pins of cameras still declared are kept; the pool is planned "
    "again at once",
    responses={
        404: {"description": "a camera's model version is not registered"},
        409: {"description": "the pool was changed at the same time; try again"},
        422: {
            "description": "a bad selector, source, frame rate or id; a source with a literal password "
            "(use a {secret:NAME} reference); the detail names the field"
        },
    },
)
def put_pool(name: IdPath, body: PoolDeclaration, rt: RuntimeDep) -> PoolPublic:
    return pool_public(rt.pools.apply(name, body))


@router.get("/pools", response_model=list[PoolSummaryPublic], summary="Pools, by name")
def pools(rt: RuntimeDep) -> list[PoolSummaryPublic]:
    return [
        PoolSummaryPublic(
            name=p.pool.name,
            selector=p.pool.selector,
            strategy=p.pool.strategy,
            cameras=p.cameras,
            placed=p.placed,
            devices=p.devices,
            updated_at=p.pool.updated_at,
        )
        for p in rt.pools.summaries()
    ]


@router.get(
    "/pools/{name}",
    response_model=PoolPublic,
    summary="One pool: declaration, devices (online, cordoned, draining, load), where each camera runs, "
    "unplaced and degraded cameras and why, N+1, recent moves",
    responses=_UNKNOWN,
)
def pool(name: IdPath, rt: RuntimeDep) -> PoolPublic:
    return pool_public(rt.pools.state(name))


@router.delete(
    "/pools/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a pool: its declaration, cordons and placements (its events stay)",
    responses=_UNKNOWN,
)
def delete_pool(name: IdPath, rt: RuntimeDep) -> Response:
    rt.pools.delete(name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/pools/{name}/plan",
    response_model=PoolPlan,
    summary="Dry run: the plan if the devices in 'fail' went offline now (what moves and why, what is "
    "degraded or unplaced, loads, N+1). Nothing is stored",
    responses=_UNKNOWN_MEMBER,
)
def plan_pool(name: IdPath, rt: RuntimeDep, body: PoolPlanRequest | None = None) -> PoolPlan:
    return plan_public(rt.pools.dry_run(name, (body or PoolPlanRequest()).fail))


def _device_action(action: str, doc: str) -> None:
    """``POST /pools/{name}/devices/{device_id}/<action>``: the pool service's action of that name."""

    @router.post(
        f"/pools/{{name}}/devices/{{device_id}}/{action}",
        response_model=PoolPublic,
        summary=doc,
        responses=_UNKNOWN_MEMBER,
        name=f"{action}_pool_device",
    )
    def operate(name: IdPath, device_id: DeviceIdPath, rt: RuntimeDep) -> PoolPublic:
        st: PoolState = getattr(rt.pools, action)(name, device_id)
        return pool_public(st)


_device_action(
    "cordon", "Cordon a device of the pool: it takes no new camera, those it runs stay; idempotent"
)
_device_action(
    "drain", "Drain a device of the pool: cordoned, and its cameras planned elsewhere (reason cordoned)"
)
_device_action("uncordon", "Let a device take cameras again (none moves back by itself); idempotent")


@router.post(
    "/pools/{name}/cameras/{camera}/move",
    response_model=PoolPublic,
    summary="Pin a camera to a device of the pool: it moves there when it fits (reason manual, under the "
    "pool's rate limit; otherwise the move is listed as held, with why)",
    responses={
        404: {"description": "unknown pool, camera, or a device that is not in the pool"},
        409: {"description": "the device is cordoned or draining in the pool"},
    },
)
def move_camera(name: IdPath, camera: PoolCameraPath, body: PoolMoveRequest, rt: RuntimeDep) -> PoolPublic:
    return pool_public(rt.pools.move(name, camera, body.device))


@router.delete(
    "/pools/{name}/cameras/{camera}/move",
    response_model=PoolPublic,
    summary="Unpin a camera: it stays where it runs, and may be planned anywhere from now on",
    responses={404: {"description": "unknown pool or camera"}},
)
def unpin_camera(name: IdPath, camera: PoolCameraPath, rt: RuntimeDep) -> PoolPublic:
    return pool_public(rt.pools.unpin(name, camera))
