"""``/api/v1/counts``: line crossings per direction and zone entries and exits per label and time
bucket, summed from the devices' zone and line events, and the occupancy of each zone now from the
devices' latest heartbeats (PROTOCOL.md "Zones and lines")."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query

from controller.api.deps import FilterQuery, SessionDep, time_window
from controller.api.errors import invalid_query
from controller.observe.counts import CountFilter, occupancy, totals, zone_line_counts

router = APIRouter(prefix="/api/v1/counts", tags=["counts"])

# As many buckets as a chart of the detections may ask for.
MAX_COUNT_BUCKETS = 10_000
# The contract's zone and line ids, so a filter that could never match is a 422, not an empty answer.
PlaceQuery = Annotated[str | None, Query(max_length=32, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


@router.get(
    "",
    summary="Line crossings (in/out) and zone entries/exits per label per time bucket, and occupancy now",
    description=(
        "Counted from the devices' `line_crossed`, `zone_entered` and `zone_left` events (by their time) "
        "in `[since, until)`; each bucket lists `lines` rows `{device, camera, line, label, in, out}` and "
        "`zones` rows `{device, camera, zone, label, entered, left}`; `totals` adds them up over the "
        "window. `occupancy` is each zone's tracks inside it now per label, from the latest heartbeat "
        "of each device (`as_of`, `online`); a zone reported empty has one row with `label` null and "
        "`count` 0 (none with a `line` filter: lines have no occupancy). `zone` and `line` filter one kind "
        "of place each, so not both at once."
    ),
)
def counts(
    session: SessionDep,
    bucket: Annotated[int, Query(ge=1, le=86400, description="bucket width in seconds")] = 3600,
    since: Annotated[datetime | None, Query(description="default: until - 24 h")] = None,
    until: Annotated[datetime | None, Query(description="default: now (exclusive)")] = None,
    device: FilterQuery = None,
    camera: FilterQuery = None,
    zone: PlaceQuery = None,
    line: PlaceQuery = None,
    label: FilterQuery = None,
) -> dict[str, Any]:
    since_, until_ = time_window(since, until, timedelta(hours=24))
    if (until_ - since_).total_seconds() / bucket > MAX_COUNT_BUCKETS:
        raise invalid_query("bucket", f"more than {MAX_COUNT_BUCKETS} buckets; widen the bucket")
    if zone is not None and line is not None:
        raise invalid_query("line", "filter by a zone or by a line, not both")
    where = CountFilter(device_id=device, camera=camera, zone=zone, line=line, label=label)
    buckets = zone_line_counts(session, bucket=bucket, since=since_, until=until_, where=where)
    return {
        "bucket": bucket,
        "since": since_.isoformat(),
        "until": until_.isoformat(),
        "totals": totals(buckets),
        "buckets": buckets,
        "occupancy": [] if line is not None else occupancy(session, where=where),
    }
