"""The surfaces people use: live detections (WebSocket), counts for charts, snapshots, energy, events
search, Prometheus ``/metrics`` and the dashboard pages, plus the services behind them.

The services behind them (live hub, commands, metrics, retention) belong to the runtime;
``mount_surfaces(app)`` adds the routes and static files.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, Response, WebSocket
from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.engine import Engine
from starlette.websockets import WebSocketDisconnect

from controller.api.deps import runtime, ws_subprotocol
from controller.db.tables import Detection, Device, Event
from controller.link.commands import CommandError
from controller.observe.energy import device_energy, fleet_summary, load_payloads
from controller.observe.live import LiveFilter, TooManyClients
from controller.observe.metrics import CONTENT_TYPE
from controller.runtime import ControllerRuntime
from fleet_protocol.messages import CommandName, Message, Severity

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
_NO_NUL = r"^[^\x00]*$"
_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
MAX_STAT_BUCKETS = 10_000
Handler = Callable[[str, Message], str | None]


def _rt(request: Request | WebSocket) -> ControllerRuntime:
    return runtime(request)


def _utc(dt: datetime) -> datetime:
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def _window(since: datetime | None, until: datetime | None, default: timedelta) -> tuple[datetime, datetime]:
    until_ = _utc(until) if until is not None else datetime.now(UTC)
    since_ = _utc(since) if since is not None else until_ - default
    if since_ >= until_:
        raise HTTPException(
            422, [{"loc": ["query", "since"], "msg": "since must be before until", "type": "value_error"}]
        )
    return since_, until_


def _bucket_expr(engine: Engine, column: Any, bucket: int) -> Any:
    if engine.dialect.name == "sqlite":
        epoch = sa.cast(sa.func.strftime("%s", column), sa.BigInteger)
        # Raw "/" on two integers: SQLite's integer division (SQLAlchemy's "/" would be true division).
        return epoch.op("/")(sa.literal(bucket, sa.BigInteger)) * bucket
    pg_epoch = sa.extract("epoch", column)
    return sa.cast(sa.func.floor(pg_epoch / bucket) * bucket, sa.BigInteger)


def build_live_router() -> APIRouter:
    router = APIRouter()

    # ------------------------------------------------------------------ live detections

    @router.websocket("/api/v1/detections/live")
    async def live(
        ws: WebSocket,
        device: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        camera: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        label: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        min_score: Annotated[float | None, Query(ge=0.0, le=1.0)] = None,
    ) -> None:
        hub = _rt(ws).hub
        # The token was checked by controller.security.tokens before this point (header, subprotocol or query).
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
        "/api/v1/detections/live/clients",
        summary="Connected live-detection clients: filters, queue depth, messages sent and dropped",
    )
    def live_clients(request: Request) -> list[dict[str, Any]]:
        return _rt(request).hub.clients()

    # ------------------------------------------------------------------ counts per label per bucket

    @router.get(
        "/api/v1/detections/stats",
        summary="Detections per label per time bucket (captured time), for charts",
    )
    def detection_stats(
        request: Request,
        bucket: Annotated[int, Query(ge=1, le=86400, description="bucket width in seconds")] = 60,
        since: Annotated[datetime | None, Query(description="default: until - 1 h")] = None,
        until: Annotated[datetime | None, Query(description="default: now (exclusive)")] = None,
        device: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        camera: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        min_score: Annotated[float | None, Query(ge=0.0, le=1.0)] = None,
    ) -> dict[str, Any]:
        since_, until_ = _window(since, until, timedelta(hours=1))
        if (until_ - since_).total_seconds() / bucket > MAX_STAT_BUCKETS:
            raise HTTPException(
                422,
                [
                    {
                        "loc": ["query", "bucket"],
                        "msg": f"more than {MAX_STAT_BUCKETS} buckets; widen the bucket",
                        "type": "value_error",
                    }
                ],
            )
        engine = _rt(request).engine
        t = Detection.__table__  # type: ignore[attr-defined]
        b = _bucket_expr(engine, t.c.captured_at, bucket).label("b")
        q = sa.select(b, t.c.label, sa.func.count()).where(
            t.c.captured_at >= since_, t.c.captured_at < until_
        )
        if device is not None:
            q = q.where(t.c.device_id == device)
        if camera is not None:
            q = q.where(t.c.camera == camera)
        if min_score is not None:
            q = q.where(t.c.score >= min_score)
        q = q.group_by(b, t.c.label).order_by(b)
        buckets: dict[int, dict[str, int]] = {}
        labels: dict[str, int] = {}
        with engine.connect() as conn:
            for start, lbl, n in conn.execute(q):
                buckets.setdefault(int(start), {})[lbl] = int(n)
                labels[lbl] = labels.get(lbl, 0) + int(n)
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

    # ------------------------------------------------------------------ snapshot

    @router.get(
        "/api/v1/devices/{device_id}/cameras/{camera}/snapshot",
        summary="The camera's current frame as JPEG (boxes=true draws the latest detections), asked of the device",
        response_class=Response,
        responses={
            200: {"content": {"image/jpeg": {}}},
            404: {"description": "unknown device or camera"},
            409: {"description": "device offline"},
            502: {"description": "the device answered with an error"},
            503: {"description": "the camera has no frame yet, or the controller is not connected to MQTT"},
            504: {"description": "the device did not answer in time"},
        },
    )
    def snapshot(
        request: Request,
        device_id: Annotated[str, PathParam(max_length=64, pattern=_ID)],
        camera: Annotated[str, PathParam(max_length=64, pattern=_ID)],
        boxes: bool = False,
        timeout: Annotated[
            float | None, Query(gt=0, le=60, description="seconds; default from settings")
        ] = None,
    ) -> Response:
        rt = _rt(request)
        with rt.engine.connect() as conn:
            t = Device.__table__  # type: ignore[attr-defined]
            row = conn.execute(sa.select(t.c.status, t.c.offline_since).where(t.c.id == device_id)).first()
        if row is None:
            raise HTTPException(404, f"device {device_id!r} is not known")
        if row[0] != "online":
            since = f" since {row[1].isoformat()}" if row[1] is not None else ""
            raise HTTPException(
                409, f"device {device_id} is offline{since}; a snapshot needs the device online"
            )
        if not rt.bridge.connected:
            raise HTTPException(503, "the controller is not connected to the MQTT broker")
        try:
            res = rt.commands.request(
                device_id,
                CommandName.SNAPSHOT,
                {"camera": camera, "boxes": boxes},
                timeout=timeout or rt.settings.command_timeout_s,
            )
        except CommandError as exc:
            code = {"timeout": 504, "busy": 503, "stopping": 503}.get(exc.reason, 503)
            raise HTTPException(code, str(exc)) from None
        if not res.ok:
            err = res.error or "unknown error"
            if err.startswith("unknown camera"):
                raise HTTPException(404, f"device {device_id}: {err}")
            if "no frame" in err or err.startswith("busy"):
                raise HTTPException(503, f"device {device_id}: {err}")
            raise HTTPException(502, f"device {device_id} could not take a snapshot: {err}")
        try:
            jpeg = base64.b64decode(str(res.result.get("jpeg_base64", "")), validate=True)
        except (binascii.Error, ValueError):
            jpeg = b""
        if not jpeg.startswith(b"\xff\xd8"):
            raise HTTPException(502, f"device {device_id} sent a snapshot that is not a JPEG")
        headers = {"Cache-Control": "no-store"}
        for k in ("frame", "width", "height", "boxes", "captured_at"):
            if k in res.result:
                headers[f"X-Snapshot-{k.replace('_', '-').title()}"] = str(res.result[k])
        return Response(content=jpeg, media_type="image/jpeg", headers=headers)

    # ------------------------------------------------------------------ energy

    @router.get(
        "/api/v1/energy",
        summary="Measured energy per device and for the fleet (GPU via NVML, CPU via RAPL); "
        "null means not measured",
    )
    def energy(
        request: Request,
        since: Annotated[datetime | None, Query(description="default: until - 1 h")] = None,
        until: Annotated[datetime | None, Query(description="default: now")] = None,
        bucket: Annotated[int, Query(ge=10, le=86400, description="series bucket in seconds")] = 300,
        device: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
    ) -> dict[str, Any]:
        since_, until_ = _window(since, until, timedelta(hours=1))
        rt = _rt(request)
        per = load_payloads(rt.engine, since=since_, until=until_, device=device)
        with rt.engine.connect() as conn:
            t = Device.__table__  # type: ignore[attr-defined]
            q = sa.select(t.c.id)
            if device is not None:
                q = q.where(t.c.id == device)
            ids = [r[0] for r in conn.execute(q)]
        devs = [device_energy(d, per.get(d, [])) for d in sorted(set(ids) | set(per))]
        return {
            "since": since_.isoformat(),
            "until": until_.isoformat(),
            "bucket": bucket,
            "devices": [d.public() for d in devs],
            "fleet": fleet_summary(devs, bucket_s=bucket),
        }

    # ------------------------------------------------------------------ events search

    @router.get(
        "/api/v1/events/search",
        summary="Device events with until and severity filters, newest first",
    )
    def events_search(
        request: Request,
        device: Annotated[str | None, Query(max_length=64, pattern=_NO_NUL)] = None,
        kind: Annotated[str | None, Query(max_length=32, pattern=_NO_NUL)] = None,
        # An enum, not free text: a value the column cannot hold (NUL on PostgreSQL) is a 422, not a 500.
        severity: Annotated[
            list[Severity] | None, Query(description="info, warning, error (repeatable)")
        ] = None,
        since: Annotated[datetime | None, Query()] = None,
        until: Annotated[datetime | None, Query(description="exclusive")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        t = Event.__table__  # type: ignore[attr-defined]
        q = sa.select(t)
        if device is not None:
            q = q.where(t.c.device_id == device)
        if kind is not None:
            q = q.where(t.c.kind == kind)
        if severity:
            q = q.where(t.c.severity.in_([s.value for s in severity]))
        if since is not None:
            q = q.where(t.c.ts >= _utc(since))
        if until is not None:
            q = q.where(t.c.ts < _utc(until))
        q = q.order_by(t.c.ts.desc(), t.c.id.desc()).limit(limit)
        with _rt(request).engine.connect() as conn:
            rows = conn.execute(q).mappings().all()
        return [{k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in r.items()} for r in rows]

    # ------------------------------------------------------------------ metrics

    @router.get("/metrics", response_class=Response, summary="Prometheus metrics (text format)")
    def metrics(request: Request) -> Response:
        return Response(content=_rt(request).metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ dashboard pages

    @router.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @router.get("/devices/{device_id}", include_in_schema=False)
    def device_page(device_id: Annotated[str, PathParam(max_length=64)]) -> FileResponse:
        return FileResponse(STATIC_DIR / "device.html", headers={"Cache-Control": "no-cache"})

    return router


def mount_surfaces(app: FastAPI) -> None:
    """Routes of this module and the dashboard's static files."""
    app.include_router(build_live_router())
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
