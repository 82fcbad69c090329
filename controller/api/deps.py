"""What routes depend on: the runtime, a database session, the guard every route passes
(``authorize``: the role a route needs comes from ``controller.security.tokens.required_role``), and
the path and query parameters several routers share."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Query, status
from sqlmodel import Session
from starlette.requests import HTTPConnection

from controller.api.errors import invalid_query
from controller.runtime import ControllerRuntime
from controller.security.tokens import WS_BEARER_PREFIX, WS_SUBPROTOCOL, Principal, required_role
from controller.types import ID_MAX, ID_PATTERN, NO_NUL_PATTERN


def runtime(conn: HTTPConnection) -> ControllerRuntime:
    """The running controller of this app (set by the lifespan before the first request)."""
    rt: ControllerRuntime = conn.app.state.runtime
    return rt


def get_session(conn: HTTPConnection) -> Iterator[Session]:
    with Session(runtime(conn).engine, expire_on_commit=False) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
RuntimeDep = Annotated[ControllerRuntime, Depends(runtime)]

# An identifier is an MQTT topic level and a folder name: anything else is a 422 naming the parameter.
IdPath = Annotated[str, Path(max_length=ID_MAX, pattern=ID_PATTERN)]
DeviceIdPath = Annotated[str, Path(description="device id", max_length=ID_MAX, pattern=ID_PATTERN)]
CameraPath = Annotated[
    str, Path(description="camera id on the device", max_length=ID_MAX, pattern=ID_PATTERN)
]
# A filter compared with a column (device, camera, label): query strings reach the database, and
# PostgreSQL refuses NUL in text, which must be a 422, not a 500.
FilterQuery = Annotated[str | None, Query(max_length=ID_MAX, pattern=NO_NUL_PATTERN)]


def utc(dt: datetime) -> datetime:
    """A query's time in UTC (a naive one is taken as UTC)."""
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def time_window(
    since: datetime | None, until: datetime | None, default: timedelta
) -> tuple[datetime, datetime]:
    """``[since, until)`` in UTC: until defaults to now, since to ``default`` before until; a 422
    naming ``since`` when it is not before until."""
    until_ = utc(until) if until is not None else datetime.now(UTC)
    since_ = utc(since) if since is not None else until_ - default
    if since_ >= until_:
        raise invalid_query("since", "since must be before until")
    return since_, until_


def _unauthorized(detail: str, *, invalid: bool) -> HTTPException:
    challenge = 'Bearer realm="edgefleet"' + (', error="invalid_token"' if invalid else "")
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": challenge})


def presented_token(conn: HTTPConnection) -> str | None:
    """The token of a request: the Authorization header; on a WebSocket also the ``bearer.…``
    subprotocol or the ``token`` query parameter."""
    header = conn.headers.get("authorization")
    if header:
        scheme, _, value = header.partition(" ")
        return value.strip() if scheme.lower() == "bearer" and value.strip() else ""
    if conn.scope["type"] != "websocket":
        return None
    for proto in conn.scope.get("subprotocols") or ():
        if proto.startswith(WS_BEARER_PREFIX):
            encoded = proto[len(WS_BEARER_PREFIX) :]
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            except (binascii.Error, ValueError):
                return ""
    return conn.query_params.get("token")


def authorize(conn: HTTPConnection) -> Principal | None:
    """The app-wide dependency: 401 without a valid token, 403 when its role is too low."""
    # What the router matched on: the decoded path without the mount point (root_path) it was served under.
    path: str = conn.scope["path"]
    root = conn.scope.get("root_path") or ""
    if root and path.startswith(root):
        path = path[len(root) :]
    method = conn.scope.get("method") if conn.scope["type"] == "http" else None
    needed = required_role(method, path)
    if needed is None:
        return None
    token = presented_token(conn)
    if token is None:
        raise _unauthorized("an API token is needed: send 'Authorization: Bearer <token>'", invalid=False)
    principal = runtime(conn).auth.authenticate(token) if token else None
    if principal is None:
        raise _unauthorized("the API token is not valid (unknown or revoked)", invalid=True)
    if not principal.role.allows(needed):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"this needs the {needed.value} role; the token '{principal.name}' has the "
            f"{principal.role.value} role",
        )
    conn.state.principal = principal
    return principal


def ws_subprotocol(conn: HTTPConnection) -> str | None:
    """The subprotocol to accept a WebSocket with: ``edgefleet`` when offered (a browser that
    offered subprotocols fails the connection unless one is chosen); never the token's."""
    offered = conn.scope.get("subprotocols") or ()
    return WS_SUBPROTOCOL if WS_SUBPROTOCOL in offered else None
