"""Rollouts of pool cameras: the ``rollout_camera`` members (a pool camera, wherever it runs, is the
unit of a wave), and the canary variant each pool placement admitted (``pool_placement.canary``) or
why it did not (``canary_held``).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-12
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "rollout_camera",
        sa.Column("rollout_id", sa.Integer(), nullable=False),
        sa.Column("pool", sa.String(length=64), nullable=False),
        sa.Column("camera", sa.String(length=64), nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("wave", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("target_version", sa.Integer(), nullable=True),
        sa.Column("baseline_fps", sa.Float(), nullable=True),
        sa.Column("baseline_latency_ms", sa.Float(), nullable=True),
        sa.Column("admitted_at", TS, nullable=True),
        sa.Column("settled_at", TS, nullable=True),
        sa.Column("soak_restarts", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollout.id"]),
        sa.PrimaryKeyConstraint("rollout_id", "pool", "camera"),
    )
    with op.batch_alter_table("pool_placement") as batch:
        batch.add_column(sa.Column("canary", sa.String(length=129), nullable=True))
        batch.add_column(sa.Column("canary_held", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pool_placement") as batch:
        batch.drop_column("canary_held")
        batch.drop_column("canary")
    op.drop_table("rollout_camera")
