"""Incarnations: dedup, acks and counters per (device, incarnation).

``device_seq`` and ``ingested_seq`` gain ``incarnation`` in their primary keys; every existing row is
the legacy space ('' , what an agent older than incarnations sends in), so acks carry on where they
stopped. ``device`` records the incarnation it sends in now and since when. SQLite cannot alter a
primary key in place: its tables are rebuilt (batch mode); PostgreSQL swaps the constraint.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


TS = sa.DateTime(timezone=True)


# The space's column: '' for the rows there are (the legacy space), and for a row an older controller
# replica inserts during a rolling upgrade.
def _incarnation() -> sa.Column[str]:
    return sa.Column("incarnation", sa.String(length=32), nullable=False, server_default="")


def _set_primary_key(table: str, columns: list[str]) -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        # The rebuilt table takes the new key; SQLAlchemy warns that it differs from the reflected one,
        # which is the point.
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*as primary_key=True, not matching", category=sa.exc.SAWarning
            )
            with op.batch_alter_table(table, recreate="always") as batch:
                batch.create_primary_key(f"pk_{table}", columns)
        return
    name = sa.inspect(bind).get_pk_constraint(table)["name"] or f"{table}_pkey"
    op.drop_constraint(name, table, type_="primary")
    op.create_primary_key(f"{table}_pkey", table, columns)


def upgrade() -> None:
    with op.batch_alter_table("device_seq") as batch:
        batch.add_column(_incarnation())
        batch.add_column(sa.Column("started_at", TS, nullable=True))
    _set_primary_key("device_seq", ["device_id", "incarnation"])
    with op.batch_alter_table("ingested_seq") as batch:
        batch.add_column(_incarnation())
    _set_primary_key("ingested_seq", ["device_id", "incarnation", "seq"])
    with op.batch_alter_table("device") as batch:
        batch.add_column(sa.Column("incarnation", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("incarnation_started_at", TS, nullable=True))


def downgrade() -> None:
    # One space per device again: only the legacy space's rows fit; the others' dedup records go.
    op.execute(sa.text("DELETE FROM ingested_seq WHERE incarnation <> ''"))
    op.execute(sa.text("DELETE FROM device_seq WHERE incarnation <> ''"))
    with op.batch_alter_table("device") as batch:
        batch.drop_column("incarnation_started_at")
        batch.drop_column("incarnation")
    _set_primary_key("ingested_seq", ["device_id", "seq"])
    with op.batch_alter_table("ingested_seq") as batch:
        batch.drop_column("incarnation")
    _set_primary_key("device_seq", ["device_id"])
    with op.batch_alter_table("device_seq") as batch:
        batch.drop_column("started_at")
        batch.drop_column("incarnation")
