"""The PostgreSQL test database helper: a PostgreSQL test skips, naming why, only while the server is
unreachable, and fails instead when EDGEFLEET_REQUIRE_POSTGRES=1 (tests/run.sh), so CI cannot skip it."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.databases import database_url, postgres_base_url
from tests.support.mqtt_broker import free_port


def _nowhere(monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"
    monkeypatch.setenv("EDGEFLEET_TEST_POSTGRES_URL", url)
    return url


def test_unreachable_postgres_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url = _nowhere(monkeypatch)
    monkeypatch.delenv("EDGEFLEET_REQUIRE_POSTGRES", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped, database_url("postgresql", tmp_path):
        pass
    assert url in str(skipped.value) and "not reachable" in str(skipped.value)


def test_unreachable_postgres_fails_when_required(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _nowhere(monkeypatch)
    monkeypatch.setenv("EDGEFLEET_REQUIRE_POSTGRES", "1")
    with pytest.raises(pytest.fail.Exception) as failed, database_url("postgresql", tmp_path):
        pass
    assert "EDGEFLEET_REQUIRE_POSTGRES=1" in str(failed.value)


def test_each_postgres_database_is_a_schema_of_its_own(tmp_path: Path) -> None:
    with database_url("postgresql", tmp_path) as a, database_url("postgresql", tmp_path) as b:
        assert a != b
        engine = sa.create_engine(a)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text("CREATE TABLE t (x int)"))
                schema = conn.execute(sa.text("SELECT current_schema()")).scalar_one()
        finally:
            engine.dispose()
    admin = sa.create_engine(postgres_base_url())
    try:
        with admin.connect() as conn:
            left = conn.execute(
                sa.text("SELECT count(*) FROM information_schema.schemata WHERE schema_name = :s"),
                {"s": schema},
            ).scalar_one()
    finally:
        admin.dispose()
    assert schema.startswith("t_") and left == 0, "the schema is dropped afterwards"
