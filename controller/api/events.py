"""``/api/v1/events``: what devices reported (camera up/down, model download and activation, disk
low, watchdog restarts) and what the controller recorded about them (decommission, a new incarnation,
command results, re-sends), newest first, each with its ``source``; ``/events/search`` adds until and
severity filters."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from controller.api.deps import FilterQuery, SessionDep, utc
from controller.db import crud
from controller.db.tables import EventPublic
from controller.types import NO_NUL_PATTERN
from fleet_protocol.messages import Severity

router = APIRouter(prefix="/api/v1/events", tags=["events"])

KindQuery = Annotated[str | None, Query(max_length=32, pattern=NO_NUL_PATTERN)]
SourceQuery = Annotated[
    Literal["device", "controller"] | None,
    Query(description="device: sent by the device; controller: written by the controller"),
]


@router.get("", response_model=list[EventPublic], summary="Device events, newest first")
def list_events(
    session: SessionDep,
    device: FilterQuery = None,
    kind: KindQuery = None,
    source: SourceQuery = None,
    since: Annotated[datetime | None, Query(description="ISO 8601 or unix seconds")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[Any]:
    return list(
        crud.list_events(session, device_id=device, kind=kind, source=source, since=since, limit=limit)
    )


@router.get(
    "/search",
    summary="Device events with until and severity filters, newest first",
)
def events_search(
    session: SessionDep,
    device: FilterQuery = None,
    kind: KindQuery = None,
    # An enum, not free text: a value the column cannot hold (NUL on PostgreSQL) is a 422, not a 500.
    severity: Annotated[list[Severity] | None, Query(description="info, warning, error (repeatable)")] = None,
    since: Annotated[datetime | None, Query()] = None,
    until: Annotated[datetime | None, Query(description="exclusive")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict[str, Any]]:
    rows = crud.search_events(
        session,
        device_id=device,
        kind=kind,
        severities=[s.value for s in severity] if severity else None,
        since=utc(since) if since is not None else None,
        until=utc(until) if until is not None else None,
        limit=limit,
    )
    return [{k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in r.items()} for r in rows]
