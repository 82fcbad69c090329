"""Replicas: the leader's fencing epoch and the table of running controller replicas.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

TS = sa.DateTime(timezone=True)

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "leader_lease",
        sa.Column("name", sa.String(length=32), primary_key=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("holder", sa.String(length=64), nullable=True),
        sa.Column("acquired_at", TS, nullable=True),
    )
    op.create_table(
        "controller_replica",
        sa.Column("replica_id", sa.String(length=64), primary_key=True),
        sa.Column("host", sa.String(length=256), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("seen_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("controller_replica")
    op.drop_table("leader_lease")
