"""The test databases: a SQLite file, or a fresh PostgreSQL schema of the test's own.

PostgreSQL comes from ``EDGEFLEET_TEST_POSTGRES_URL`` (default: the machine's PostgreSQL with trust
auth). A PostgreSQL test skips, naming the reason, when that server cannot be reached, except when
``EDGEFLEET_REQUIRE_POSTGRES=1`` (tests/run.sh sets it): then it fails, so CI never skips PostgreSQL
without anyone noticing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DATABASES = ("sqlite", "postgresql")


def postgres_base_url() -> str:
    return os.environ.get("EDGEFLEET_TEST_POSTGRES_URL", PG_DEFAULT)


def postgres_required() -> bool:
    return os.environ.get("EDGEFLEET_REQUIRE_POSTGRES", "") == "1"


def _unreachable(base: str, exc: Exception) -> None:
    why = f"PostgreSQL at {base} is not reachable ({type(exc).__name__}: {str(exc).strip()[:200]})"
    if postgres_required():
        pytest.fail(f"{why}; EDGEFLEET_REQUIRE_POSTGRES=1 forbids skipping it")
    pytest.skip(f"{why}; start it or set EDGEFLEET_TEST_POSTGRES_URL")


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A URL whose connections use a new, empty schema (``search_path``); dropped afterwards.

    Each test then has tables of its own on one server: no cross-test leftovers, no database to create.
    """
    base = postgres_base_url()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    # A bounded connect: an unreachable server must skip (or fail) quickly, not hang the suite.
    admin = sa.create_engine(base, connect_args={"connect_timeout": 5})
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        _unreachable(base, exc)
    sep = "&" if "?" in base else "?"
    try:
        yield f"{base}{sep}options=-csearch_path%3D{schema}"
    finally:
        try:
            with admin.begin() as conn:
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        finally:
            admin.dispose()


@contextmanager
def database_url(kind: str, folder: Path) -> Iterator[str]:
    """``kind`` is ``sqlite`` (a file in ``folder``) or ``postgresql`` (a schema of its own)."""
    if kind == "sqlite":
        folder.mkdir(parents=True, exist_ok=True)
        yield f"sqlite:///{folder / 'controller.db'}"
    elif kind == "postgresql":
        with postgres_schema() as url:
            yield url
    else:
        raise ValueError(f"unknown test database {kind!r}")
