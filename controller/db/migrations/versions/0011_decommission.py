"""Decommission: decommissioned devices keep their history.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # The status itself is a string column: 'decommissioned' needs no schema change.
    with op.batch_alter_table("device") as batch:
        batch.add_column(sa.Column("decommissioned_at", TS, nullable=True))


def downgrade() -> None:
    # An older controller knows no such status: those devices read as offline.
    op.execute(sa.text("UPDATE device SET status = 'offline' WHERE status = 'decommissioned'"))
    with op.batch_alter_table("device") as batch:
        batch.drop_column("decommissioned_at")
