"""API security: bearer tokens (kept as sha256 only), four roles, and the rule that gives each route
its role (the dependency that applies it to every route is ``controller.api.deps.authorize``).

Roles:

- ``viewer``: reads (technicians): every GET, the live WebSocket, snapshots, ``/metrics``;
- ``operator``: a viewer's reads and every other method except the two below: models, deployments,
  rollouts, enrollment, labels, assignments, commands, revoking and decommissioning devices;
- ``release``: a viewer's reads and shipping the edge agent's own software (``RELEASE_PATHS``:
  agent packages, agent deployments, a device's agent version), which runs as code on every device
  it reaches; nothing an operator does;
- ``admin``: everything, including token management (``/api/v1/tokens``).

Operator and release are apart on purpose: a model an operator deploys is data the agent's runtime
loads, whereas an agent package is code that every device it reaches installs and runs.

The required role is derived from the HTTP method and the path the router matched by
``required_role``, so a route added anywhere later is guarded without touching it; only the few public
paths (liveness and the dashboard's static pages, which hold no data) are listed.

Where a token may come from: ``Authorization: Bearer <token>``; on the WebSocket also the subprotocol
``bearer.<base64url(token)>`` offered next to ``edgefleet`` (browsers cannot set headers on a
WebSocket), or a ``token`` query parameter, which uvicorn's logs never show (``RedactTokens``).

The bootstrap admin token comes from ``EDGEFLEET_ADMIN_TOKEN`` or, unset, is made on first start in
``<data_dir>/admin.token`` (mode 0600). It is never logged, and it is never stored in the database, so
changing the setting takes effect at the next start.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller.db.tables import ApiToken, utcnow

log = logging.getLogger(__name__)

ADMIN_TOKEN_FILE = "admin.token"
TOKEN_PREFIX = "eft_"
# Characters of a token kept in clear: enough to tell tokens apart and to find the row, far too few
# to guess the rest (the random part has 256 bits).
SHOWN_CHARS = 12
# The WebSocket subprotocol the dashboard speaks; the token travels in a second, ``bearer.…`` one.
WS_SUBPROTOCOL = "edgefleet"
WS_BEARER_PREFIX = "bearer."
# last_used_at is written at most this often per token: a dashboard polling every second must not
# turn every read into a write.
TOUCH_INTERVAL_S = 60.0
TOKENS_PATH = "/api/v1/tokens"
# Routes anyone may call: liveness for load balancers, and the dashboard's pages (static HTML; the
# data they show comes from the API with the user's token). /docs, /openapi.json and /static are not
# routes this guard sees: they are open too, and hold no fleet data.
PUBLIC_PATHS = frozenset({"/healthz", "/", "/models", "/deployments", "/agent-packages"})
# The technician's page /devices/{device_id}, the site operator's /pools/{name} and /rollouts/{id}.
PUBLIC_PAGE = re.compile(r"/(?:devices|pools|rollouts)/[^/]+")
READ_METHODS = frozenset({"GET", "HEAD"})
# Changes on these paths, or below them, need the release role: the agent software that devices
# install and run (the device's id is one path segment).
RELEASE_PATHS = (
    re.compile(r"/api/v1/agent-packages(/.*)?"),
    re.compile(r"/api/v1/agent-deployments(/.*)?"),
    re.compile(r"/api/v1/devices/[^/]+/agent(/.*)?"),
)

# Reads that need an operator: a device's log and its diagnostics bundle are asked of the device and
# carry what a viewer (a wall screen, a contractor) has no need to see.
OPERATOR_READ_PATHS = (re.compile(r"/api/v1/devices/[^/]+/(logs|diagnostics)"),)


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    RELEASE = "release"
    ADMIN = "admin"

    def allows(self, needed: Role) -> bool:
        return needed in _GRANTS[self]


# Not a ladder: operator and release each add their own changes to a viewer's reads.
_GRANTS: dict[Role, frozenset[Role]] = {
    Role.VIEWER: frozenset({Role.VIEWER}),
    Role.OPERATOR: frozenset({Role.VIEWER, Role.OPERATOR}),
    Role.RELEASE: frozenset({Role.VIEWER, Role.RELEASE}),
    Role.ADMIN: frozenset(Role),
}


@dataclass(frozen=True)
class Principal:
    """Who called: the token's id (None for the bootstrap admin token), name and role."""

    token_id: int | None
    name: str
    role: Role


def required_role(method: str | None, path: str) -> Role | None:
    """The role a request needs, from its method (None: WebSocket) and the path the router matched.

    None means public. Anything not listed as public needs at least a viewer, so a new route is
    never open by mistake. The concrete path is used, not the route's template: FastAPI hands
    dependencies the route as its own router declared it, without the prefixes it was included under.
    """
    if path in PUBLIC_PATHS or PUBLIC_PAGE.fullmatch(path):
        return None
    if path == TOKENS_PATH or path.startswith(TOKENS_PATH + "/"):
        return Role.ADMIN
    if method is not None and any(p.fullmatch(path) for p in OPERATOR_READ_PATHS):
        return Role.OPERATOR
    if method is None or method.upper() in READ_METHODS:
        return Role.VIEWER
    if any(p.fullmatch(path) for p in RELEASE_PATHS):
        return Role.RELEASE
    return Role.OPERATOR


# --------------------------------------------------------------------------- tokens


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    # A plain sha256 is enough: tokens are 256-bit random strings, not passwords people chose, so
    # there is nothing for a slow hash to protect against.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def shown_part(token: str) -> str:
    return token[:SHOWN_CHARS]


class TokenAuthority:
    """Checks presented tokens and manages the stored ones (hash, name, role, shown prefix)."""

    def __init__(self, engine: Engine, admin_token: str) -> None:
        self._engine = engine
        self._admin_hash = hash_token(admin_token)
        self._touched: dict[int, float] = {}
        self._lock = threading.Lock()
        self._revoke_listeners: list[Callable[[int], object]] = []

    def on_revoke(self, listener: Callable[[int], object]) -> None:
        """Called with a token's id each time it is revoked (e.g. to close its open WebSockets)."""
        self._revoke_listeners.append(listener)

    def is_active(self, token_id: int | None) -> bool:
        """Whether a token authenticated earlier is still valid (the bootstrap admin token always is)."""
        if token_id is None:
            return True
        t = ApiToken.__table__  # type: ignore[attr-defined]
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(t.c.revoked_at).where(t.c.id == token_id)).first()
        return row is not None and row.revoked_at is None

    def authenticate(self, token: str) -> Principal | None:
        digest = hash_token(token)
        if hmac.compare_digest(digest, self._admin_hash):
            return Principal(None, "admin (bootstrap)", Role.ADMIN)
        if not token.startswith(TOKEN_PREFIX):
            return None  # not one this controller made: no database round trip for scanners' guesses
        t = ApiToken.__table__  # type: ignore[attr-defined]
        # Rows are found by the clear prefix and then compared in constant time, so response times
        # say nothing about how much of a guessed token's hash matched.
        with self._engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.id, t.c.name, t.c.role, t.c.token_hash).where(
                    t.c.prefix == shown_part(token), t.c.revoked_at.is_(None)
                )
            ).all()
        for row in rows:
            if hmac.compare_digest(str(row.token_hash), digest):
                self._touch(int(row.id))
                return Principal(int(row.id), str(row.name), Role(row.role))
        return None

    def _touch(self, token_id: int) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._touched.get(token_id, -TOUCH_INTERVAL_S) < TOUCH_INTERVAL_S:
                return
            self._touched[token_id] = now
        t = ApiToken.__table__  # type: ignore[attr-defined]
        try:
            with self._engine.begin() as conn:
                conn.execute(sa.update(t).where(t.c.id == token_id).values(last_used_at=utcnow()))
        except sa.exc.SQLAlchemyError as exc:
            # Bookkeeping only: a busy database must not refuse a valid token.
            log.warning("could not record the use of API token #%s: %s", token_id, type(exc).__name__)

    def create(self, *, name: str, role: Role) -> tuple[ApiToken, str]:
        """A new token; the raw token is returned here and nowhere else."""
        token = new_token()
        row = ApiToken(name=name, role=role.value, prefix=shown_part(token), token_hash=hash_token(token))
        with Session(self._engine, expire_on_commit=False) as session:
            session.add(row)
            session.commit()
        return row, token

    def list(self) -> list[ApiToken]:
        with Session(self._engine, expire_on_commit=False) as session:
            return list(session.exec(select(ApiToken).order_by(col(ApiToken.id))).all())

    def revoke(self, token_id: int) -> ApiToken | None:
        """Revoke (idempotent); None when there is no such token."""
        with Session(self._engine, expire_on_commit=False) as session:
            row = session.get(ApiToken, token_id)
            if row is None:
                return None
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                session.add(row)
                session.commit()
        # What the token opened before (a live WebSocket) goes too; idempotent, like the revoke.
        for listener in self._revoke_listeners:
            try:
                listener(token_id)
            except Exception:
                log.exception("API token revoke listener failed")
        return row


def load_or_create_admin_token(
    data_dir: Path, configured: SecretStr | None, *, token_file: Path | None = None, create: bool = True
) -> str:
    """The bootstrap admin token: the configured one, else the one in ``token_file``, else
    ``data_dir/admin.token`` (made if missing and ``create`` allows it).

    ``create=False`` is for replicas: a token made by one replica would be unknown to the others.
    A token file that group or others may read is refused, as for the signing key: it may already
    have been copied.
    """
    if configured is not None:
        return configured.get_secret_value()
    if token_file is not None:
        if not token_file.exists():
            raise FileNotFoundError(
                f"{token_file}: the admin API token file (EDGEFLEET_ADMIN_TOKEN_FILE) is missing"
            )
        return _read_token_file(token_file)
    path = data_dir / ADMIN_TOKEN_FILE
    if not create and not path.exists():
        raise FileNotFoundError(
            f"{path}: no admin API token. Controller replicas never make their own (each would accept "
            "only its own): set EDGEFLEET_ADMIN_TOKEN or EDGEFLEET_ADMIN_TOKEN_FILE, the same on every replica"
        )
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        token = new_token()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it at the same moment: use theirs, below
        else:
            with os.fdopen(fd, "w") as fh:
                fh.write(token + "\n")
            log.info("no EDGEFLEET_ADMIN_TOKEN set: made an admin API token in %s (mode 0600)", path)
            return token
    return _read_token_file(path)


def _read_token_file(path: Path) -> str:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise PermissionError(
            f"{path}: the admin API token is readable by others (mode {mode:04o}); refusing to use it. "
            f"If it cannot have been copied, run `chmod 600 {path}`; otherwise delete it to make a new one."
        )
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} is empty; delete it to make a new admin API token")
    log.info("admin API token loaded from %s", path)
    return token


# --------------------------------------------------------------------------- logs

_QUERY_TOKEN = re.compile(r"(?i)([?&](?:access_)?token=)[^&\s\"']*")


class RedactTokens(logging.Filter):
    """Replaces ``token=…`` query values in uvicorn's access and connection lines with ``***``.

    Redacts inside the message and each argument, keeping ``record.args`` a tuple of the same length:
    uvicorn's ``AccessFormatter`` unpacks exactly five arguments from it (replacing the args with ``()``
    made every such line a ``--- Logging error ---`` traceback, and lost it).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = _redact(record.msg)
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_redact_arg(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {k: _redact_arg(v) for k, v in args.items()}
        return True


def _redact(text: str) -> str:
    return _QUERY_TOKEN.sub(r"\1***", text)


def _redact_arg(arg: object) -> object:
    if isinstance(arg, str):
        return _redact(arg)
    if isinstance(arg, (int, float, bytes)) or arg is None:
        return arg
    # Something else (a URL object): kept as it is unless its text carries a token; such a value is
    # only ever formatted with %s, so its redacted text takes its place.
    try:
        text = str(arg)
    except Exception:
        return arg
    return _redact(text) if _QUERY_TOKEN.search(text) else arg


def install_log_redaction() -> None:
    """uvicorn logs request paths with their query string: the live WebSocket may carry a token there."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())
