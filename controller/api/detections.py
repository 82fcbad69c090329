"""``/api/v1/detections``: stored detections page by page, counts per label per time bucket for
charts, and the live stream (WebSocket) with its clients."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, WebSocket
from starlette.websockets import WebSocketDisconnect

from controller.api.deps import FilterQuery, RuntimeDep, SessionDep, time_window, ws_subprotocol
from controller.api.errors import invalid_query
from controller.api.presenters import decode_cursor, detection_out, encode_cursor
from controller.api.schemas import DetectionPage
from controller.db import crud
from controller.observe.live import LiveFilter, TooManyClients

router = APIRouter(prefix="/api/v1/detections", tags=["detections"])

MAX_STAT_BUCKETS = 10_000


@router.get(
    "",
    response_model=DetectionPage,
    summary="Stored detections, newest capture first, paginated by an opaque cursor",
)
def list_detections(
    session: SessionDep,
    device: FilterQuery = None,
    camera: FilterQuery = None,
    label: FilterQuery = None,
    since: Annotated[datetime | None, Query(description="captured at or after (ISO 8601 or unix s)")] = None,
    until: Annotated[datetime | None, Query(description="captured before (ISO 8601 or unix s)")] = None,
    min_score: Annotated[float | None, Query(ge=0.0, le=1.0)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> DetectionPage:
    rows = crud.list_detections(
        session,
        device_id=device,
        camera=camera,
        label=label,
        since=since,
        until=until,
        min_score=min_score,
        before=decode_cursor(cursor) if cursor is not None else None,
        limit=limit + 1,  # one more than asked: is there a next page?
    )
    more = len(rows) > limit
    rows = rows[:limit]
    last = rows[-1] if rows else None
    nxt = (
        encode_cursor(last.captured_at, last.id)
        if more and last is not None and last.id is not None
        else None
    )
    return DetectionPage(items=[detection_out(r) for r in rows], next_cursor=nxt)


@router.websocket("/live")
async def live(
    ws: WebSocket,
    rt: RuntimeDep,
    device: FilterQuery = None,
    camera: FilterQuery = None,
    label: FilterQuery = None,
    min_score: Annotated[float | None, Query(ge=0.0, le=1.0)] = None,
) -> None:
    hub = rt.hub
    # The token was checked by controller.api.deps.authorize before this point (header, subprotocol
    # or query).
    await ws.accept(subprotocol=ws_subprotocol(ws))
    try:
        client = hub.add(LiveFilter(device, camera, label, min_score), asyncio.get_running_loop())
    except TooManyClients as exc:
        await ws.close(code=1013, reason=str(exc))
        return

    async def reader() -> None:
        # The client never needs to send; this only notices that it went away.
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                await ws.receive_text()

    reading = asyncio.create_task(reader())
    try:
        await ws.send_json({"type": "hello", "client": client.id, "filters": client.info()["filters"]})
        while not reading.done():
            waiter = asyncio.create_task(client.wake.wait())
            await asyncio.wait({waiter, reading}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if reading.done():
                break
            dropped, items = client.take()
            if dropped:
                await ws.send_json({"type": "dropped", "count": dropped})
            for it in items:
                await ws.send_json(it)
                client.sent += 1
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        reading.cancel()
        hub.remove(client)


@router.get(
    "/live/clients",
    summary="Connected live-detection clients: filters, queue depth, messages sent and dropped",
)
def live_clients(rt: RuntimeDep) -> list[dict[str, Any]]:
    return rt.hub.clients()


@router.get(
    "/stats",
    summary="Detections per label per time bucket (captured time), for charts",
)
def detection_stats(
    session: SessionDep,
    bucket: Annotated[int, Query(ge=1, le=86400, description="bucket width in seconds")] = 60,
    since: Annotated[datetime | None, Query(description="default: until - 1 h")] = None,
    until: Annotated[datetime | None, Query(description="default: now (exclusive)")] = None,
    device: FilterQuery = None,
    camera: FilterQuery = None,
    min_score: Annotated[float | None, Query(ge=0.0, le=1.0)] = None,
) -> dict[str, Any]:
    since_, until_ = time_window(since, until, timedelta(hours=1))
    if (until_ - since_).total_seconds() / bucket > MAX_STAT_BUCKETS:
        raise invalid_query("bucket", f"more than {MAX_STAT_BUCKETS} buckets; widen the bucket")
    counts = crud.detection_counts(
        session,
        bucket=bucket,
        since=since_,
        until=until_,
        device_id=device,
        camera=camera,
        min_score=min_score,
    )
    buckets: dict[int, dict[str, int]] = {}
    labels: dict[str, int] = {}
    for start, lbl, n in counts:
        buckets.setdefault(start, {})[lbl] = n
        labels[lbl] = labels.get(lbl, 0) + n
    return {
        "bucket": bucket,
        "since": since_.isoformat(),
        "until": until_.isoformat(),
        "labels": dict(sorted(labels.items(), key=lambda kv: -kv[1])),
        "buckets": [
            {"start": datetime.fromtimestamp(s, UTC).isoformat(), "counts": c}
            for s, c in sorted(buckets.items())
        ],
    }
