"""``/api/v1/detections``: stored detections page by page, counts per label per time bucket for
charts, and the live stream (WebSocket) with its clients: detections (``{"type": "detection"}``) and the
devices' zone and line events (``zone_event``, ``line_event``) as they are stored."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, WebSocket
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocketDisconnect

from controller.api.deps import FilterQuery, RuntimeDep, SessionDep, time_window, ws_subprotocol
from controller.api.errors import invalid_query
from controller.api.presenters import decode_cursor, detection_out, encode_cursor
from controller.api.schemas import DetectionPage
from controller.db import crud
from controller.observe.live import LiveFilter, TooManyClients
from controller.security.tokens import Principal
from fleet_protocol.messages import MAX_WIRE_INT

router = APIRouter(prefix="/api/v1/detections", tags=["detections"])

MAX_STAT_BUCKETS = 10_000
# A live socket's token is checked again this often, besides being closed at once on revoke (a token
# revoked by another controller process sharing the database, or one whose revoke hook was missed).
LIVE_REAUTH_S = 5.0
# Policy violation: the token the socket was opened with is no longer valid.
WS_TOKEN_REVOKED = 1008


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
    track_id: Annotated[
        int | None, Query(ge=0, le=MAX_WIRE_INT, description="only this track's detections (see track_id)")
    ] = None,
) -> DetectionPage:
    rows = crud.list_detections(
        session,
        device_id=device,
        camera=camera,
        label=label,
        track_id=track_id,
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
    superseded = crud.superseded_ids(session, rows)
    return DetectionPage(
        items=[detection_out(r, superseded=r.id in superseded) for r in rows], next_cursor=nxt
    )


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
    # or query); revoking it later closes this socket (code 1008).
    principal: Principal | None = getattr(ws.state, "principal", None)
    token_id = principal.token_id if principal is not None else None
    await ws.accept(subprotocol=ws_subprotocol(ws))
    try:
        client = hub.add(
            LiveFilter(device, camera, label, min_score), asyncio.get_running_loop(), token_id=token_id
        )
    except TooManyClients as exc:
        await ws.close(code=1013, reason=str(exc))
        return

    async def reader() -> None:
        # The client never needs to send; this only notices that it went away.
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                await ws.receive_text()

    reading = asyncio.create_task(reader())
    loop = asyncio.get_running_loop()
    try:
        if token_id is not None and not await run_in_threadpool(rt.auth.is_active, token_id):
            client.revoke()  # revoked between the check and hub.add: the hook found no client to close
        await ws.send_json({"type": "hello", "client": client.id, "filters": client.info()["filters"]})
        checked = loop.time()
        while not reading.done():
            waiter = asyncio.create_task(client.wake.wait())
            await asyncio.wait({waiter, reading}, timeout=LIVE_REAUTH_S, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if reading.done():
                break
            if token_id is not None and loop.time() - checked >= LIVE_REAUTH_S:
                checked = loop.time()
                if not await run_in_threadpool(rt.auth.is_active, token_id):
                    client.revoke()
            if client.revoked:
                await ws.close(code=WS_TOKEN_REVOKED, reason="the API token was revoked")
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
    superseded: Annotated[
        bool,
        Query(
            description="also count superseded detections (a pool camera's old device analysing it after a "
            "move); by default each camera counts one analyser"
        ),
    ] = False,
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
        superseded=superseded,
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
