"""Engine factory and programmatic Alembic migrations (no alembic.ini needed)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Session

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 10_000


def make_engine(database_url: str, **kwargs: Any) -> Engine:
    """Create the engine for ``database_url`` (SQLite file or ``postgresql+psycopg://``)."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        # check_same_thread off: the API thread pool and the ingest workers share the pool.
        engine = sa.create_engine(
            url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs
        )
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return sa.create_engine(url, pool_pre_ping=True, connect_args=_postgres_liveness(url), **kwargs)


# A controller killed (or cut off) while one of its transactions waits on a lock leaves a backend
# that would keep that transaction, and its uncommitted dedup rows, open until the lock is free or
# TCP gives up (two hours by default): the restarted controller could not store those seqs meanwhile.
# The server checks the client every few seconds even mid-query, and both ends probe an idle link.
PG_CLIENT_CHECK_MS = 2000
PG_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}


def _postgres_liveness(url: sa.URL) -> dict[str, Any]:
    """libpq connection parameters for ``url`` (a PostgreSQL URL): keepalives, and the server-side
    client check added to any ``options`` the URL already carries."""
    given = url.query.get("options")
    options = " ".join(given) if isinstance(given, tuple) else (given or "")
    if "client_connection_check_interval" not in options:
        options = f"{options} -c client_connection_check_interval={PG_CLIENT_CHECK_MS}".strip()
    return {**PG_KEEPALIVE, "options": options}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # WAL lets API reads run while the ingest worker writes; NORMAL sync is durable across app crashes.
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def alembic_config(database_url: str, *, schema: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation would eat a '%' in a URL-encoded password.
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    if schema:
        cfg.attributes["schema"] = schema
    return cfg


def migrate(database_url: str, *, revision: str = "head", engine: Engine | None = None) -> None:
    """Bring the database at ``database_url`` up to ``revision``.

    With ``engine`` the migration runs on one of its connections (so connect-time settings such as a
    PostgreSQL ``search_path`` apply).
    """
    cfg = alembic_config(database_url)
    if engine is None:
        engine = make_engine(database_url)
        try:
            _upgrade(cfg, engine, revision)
        finally:
            engine.dispose()
    else:
        _upgrade(cfg, engine, revision)
    log.info("database schema at %s", revision)


# Replicas that start together (or `edgefleet migrate` beside them) must not run one migration twice:
# on PostgreSQL the upgrade's transaction first takes this advisory lock, keyed like the leader's
# (controller/db/leader.py) by database and schema. Whoever waits reads the version the first one
# committed and has nothing left to do. A transaction-level lock: it ends with the migration, whatever
# happens to it.
_MIGRATION_LOCK_SQL = (
    "SELECT pg_advisory_xact_lock(hashtextextended('edgefleet-migrate:' || current_database() || ':' "
    "|| coalesce(current_schema(), ''), 0))"
)


def _upgrade(cfg: Config, engine: Engine, revision: str) -> None:
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text(_MIGRATION_LOCK_SQL))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One session, committed on success and rolled back on error."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def db_text(s: str | None) -> str | None:
    """A device's string as the database can hold it: PostgreSQL text cannot hold NUL, and the rest of
    the string is still worth keeping."""
    return s.replace("\x00", "\ufffd") if s is not None else None


def db_json(obj: Any) -> Any:
    """A device's JSON as the database can hold it: NaN/Infinity are valid floats on the wire but not
    JSON, and PostgreSQL would refuse the whole batch over one of them (they become null); a NUL in a
    key or a string becomes U+FFFD, as in :func:`db_text`: PostgreSQL's ``json`` stores the escape of NUL
    but every ``->>`` over the row then fails, so one such event would break later queries of its
    device (found by the topic fuzz test)."""
    return _no_nul(json.loads(json.dumps(obj, allow_nan=True), parse_constant=lambda _c: None))


def _no_nul(v: Any) -> Any:
    if isinstance(v, str):
        return v.replace("\x00", "\ufffd")
    if isinstance(v, dict):
        return {_no_nul(k): _no_nul(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_no_nul(x) for x in v]
    return v
