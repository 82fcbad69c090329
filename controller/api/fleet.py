"""The fleet as a whole: liveness (``/healthz``), Prometheus ``/metrics``, ingest counters, measured
energy, and the public key agents verify artifacts with."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response, status

from controller.api.deps import FilterQuery, RuntimeDep, SessionDep, time_window
from controller.api.schemas import ArtifactKey, Health, IngestStats, IngestTotals
from controller.db import crud
from controller.observe.energy import fleet_summary, window_energy
from controller.observe.metrics import CONTENT_TYPE

router = APIRouter(tags=["fleet"])


@router.get(
    "/healthz",
    response_model=Health,
    response_model_exclude_none=True,  # mqtt_error only when there is one, epoch only while leading
    summary="Liveness: database reachable, MQTT connected (or why not: mqtt_error); this replica and "
    "whether it leads",
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
        replica=rt.replica_id,
        leader=rt.leadership.is_leader(),
        epoch=rt.elector.epoch if rt.elector is not None else None,
    )


@router.get("/metrics", response_class=Response, summary="Prometheus metrics (text format)")
def metrics(rt: RuntimeDep) -> Response:
    return Response(content=rt.metrics.render(), media_type=CONTENT_TYPE)


@router.get(
    "/api/v1/stats/ingest", response_model=IngestStats, summary="Ingest counters per topic kind and outcome"
)
def ingest_stats(rt: RuntimeDep, session: SessionDep) -> IngestStats:
    totals = crud.seq_totals(session)
    return IngestStats(
        counters=rt.bridge.counters.snapshot(),
        queue_depth=rt.ingest.queue_depth,
        queue_max=rt.settings.ingest_queue_max,
        status_queue_depth=rt.status.queue_depth,
        mqtt_connected=rt.bridge.connected,
        fleet=IngestTotals(**totals._asdict()),
        over_budget=rt.bridge.budgets.over() if rt.bridge.budgets is not None else {},
    )


@router.get(
    "/api/v1/energy",
    summary="Measured energy per device and for the fleet (GPU via NVML, CPU via RAPL); "
    "null means not measured",
)
def energy(
    session: SessionDep,
    rt: RuntimeDep,
    since: Annotated[datetime | None, Query(description="default: until - 1 h")] = None,
    until: Annotated[datetime | None, Query(description="default: now")] = None,
    bucket: Annotated[int, Query(ge=10, le=86400, description="series bucket in seconds")] = 300,
    device: FilterQuery = None,
) -> dict[str, Any]:
    since_, until_ = time_window(since, until, timedelta(hours=1))
    ids = crud.device_ids(session, device_id=device)
    devs = window_energy(rt.engine, device_ids=ids, since=since_, until=until_, device=device)
    return {
        "since": since_.isoformat(),
        "until": until_.isoformat(),
        "bucket": bucket,
        "devices": [d.public() for d in devs],
        "fleet": fleet_summary(devs, bucket_s=bucket),
    }


@router.get(
    "/api/v1/keys/artifacts",
    response_model=ArtifactKey,
    summary="The public key agents verify artifact signatures with",
)
def artifact_key(rt: RuntimeDep) -> ArtifactKey:
    return ArtifactKey(public_key=rt.signer.public_key, key_id=rt.signer.key_id)
