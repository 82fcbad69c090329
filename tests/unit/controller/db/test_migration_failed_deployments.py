"""The migration that names a failed rollout's deployment ``failed``: old rows rewritten, the
operator's roll backs left as they are, and back again on a downgrade (SQLite and PostgreSQL)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory

from controller.db.engine import alembic_config, make_engine, migrate

REVISION = "0014"


def _states(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT name, state FROM deployment")).all()
    return {str(name): str(state) for name, state in rows}


def test_a_deployment_whose_rollout_failed_becomes_failed_and_a_downgrade_restores_it(db_url: str) -> None:
    before = ScriptDirectory.from_config(alembic_config(db_url)).get_revision(REVISION).down_revision
    assert isinstance(before, str)
    engine = make_engine(db_url)
    try:
        migrate(db_url, engine=engine, revision=before)
        with engine.begin() as conn:
            for i, (name, dep_state, ro_state) in enumerate(
                [
                    ("gate-failed", "rolled_back", "failed"),
                    ("by-hand", "rolled_back", "rolled_back"),
                    ("fine", "active", "succeeded"),
                ],
                start=1,
            ):
                conn.execute(
                    sa.text(
                        "INSERT INTO deployment (id, name, model, version, variant, selector, cameras, "
                        "priority, state, created_at, kind) VALUES (:id, :name, 'tiny', '1', 'auto', '', "
                        "'[]', 0, :state, CURRENT_TIMESTAMP, 'model')"
                    ),
                    {"id": i, "name": name, "state": dep_state},
                )
                conn.execute(
                    sa.text(
                        "INSERT INTO rollout (id, deployment_id, state, waves, plan, current_wave, gate, "
                        "gates, created_at, updated_at) VALUES (:id, :id, :state, '[]', '[]', 0, '{}', "
                        "'[]', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                    ),
                    {"id": i, "state": ro_state},
                )
        migrate(db_url, engine=engine)
        assert _states(engine) == {"gate-failed": "failed", "by-hand": "rolled_back", "fine": "active"}

        cfg = alembic_config(db_url)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, before)
        assert _states(engine) == {"gate-failed": "rolled_back", "by-hand": "rolled_back", "fine": "active"}
        migrate(db_url, engine=engine)
        assert _states(engine)["gate-failed"] == "failed"
    finally:
        engine.dispose()
