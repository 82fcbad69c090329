"""The migration that adds camera pools: its four tables hold a pool, its cameras, a cordon and a
placement after the upgrade; a downgrade drops exactly them and leaves the rest of the data; upgrading
again gives empty tables (SQLite and PostgreSQL)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory

from controller.db.engine import alembic_config, make_engine, migrate

REVISION = "0016"
TABLES = ("pool", "pool_camera", "pool_device", "pool_placement")


def _tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def _fill(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO pool (name, selector, strategy, headroom, reserve_n1, failover_grace_s, failback, "
                "max_moves_per_min, min_dwell_s, created_at, updated_at) VALUES ('site-north', 'site=north', "
                "'spread', 0.8, false, 10, 'never', 5, 600, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO pool_camera (pool, camera, source, model, version, target_fps, min_fps, priority, "
                "spread_group, prefer, pin) VALUES ('site-north', 'door-1', "
                "'rtsp://{secret:cams}@10.0.0.1/s', 'tiny', '1', 10, 5, 0, NULL, 'box-1', NULL)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO pool_device (pool, device_id, cordoned, draining, since) "
                "VALUES ('site-north', 'box-2', true, false, CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO pool_placement (pool, camera, device_id, fps, since) "
                "VALUES ('site-north', 'door-1', 'box-1', 10, CURRENT_TIMESTAMP)"
            )
        )


def test_pools_tables_come_with_the_upgrade_and_go_with_the_downgrade(db_url: str) -> None:
    before = ScriptDirectory.from_config(alembic_config(db_url)).get_revision(REVISION).down_revision
    assert isinstance(before, str)
    engine = make_engine(db_url)
    try:
        migrate(db_url, engine=engine, revision=before)
        assert not _tables(engine) & set(TABLES)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO device (id, labels, enrolled, status, desired_version, duplicates, "
                    "created_at) VALUES ('box-1', '{}', true, 'offline', 0, 0, CURRENT_TIMESTAMP)"
                )
            )

        migrate(db_url, engine=engine)
        assert set(TABLES) <= _tables(engine)
        _fill(engine)
        with engine.connect() as conn:
            placed = conn.execute(sa.text("SELECT camera, device_id, fps FROM pool_placement")).all()
            cordoned = conn.execute(sa.text("SELECT device_id, cordoned, draining FROM pool_device")).all()
        assert [tuple(r) for r in placed] == [("door-1", "box-1", 10.0)]
        assert [(d, bool(c), bool(dr)) for d, c, dr in cordoned] == [("box-2", True, False)]

        cfg = alembic_config(db_url)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, before)
        assert not _tables(engine) & set(TABLES)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT id FROM device")).scalars().all() == ["box-1"]

        migrate(db_url, engine=engine)
        with engine.connect() as conn:
            for table in TABLES:
                assert conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one() == 0
    finally:
        engine.dispose()
