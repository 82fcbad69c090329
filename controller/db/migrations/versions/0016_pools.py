"""Camera pools: a site's cameras shared by the devices a selector matches.

``pool`` is the declaration's policy, ``pool_camera`` its cameras (source, model, frame rates, the
operator's pin), ``pool_device`` the operator's cordons and drains, ``pool_placement`` where each
camera runs in the last stored plan. New tables only: nothing existing changes, and a downgrade drops
them (pools are lost; devices, deployments and events are untouched).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "pool",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("selector", sa.String(), nullable=False),
        sa.Column("strategy", sa.String(length=8), nullable=False),
        sa.Column("headroom", sa.Float(), nullable=False),
        sa.Column("reserve_n1", sa.Boolean(), nullable=False),
        sa.Column("failover_grace_s", sa.Float(), nullable=False),
        sa.Column("failback", sa.String(length=16), nullable=False),
        sa.Column("max_moves_per_min", sa.Integer(), nullable=False),
        sa.Column("min_dwell_s", sa.Float(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "pool_camera",
        sa.Column("pool", sa.String(length=64), nullable=False),
        sa.Column("camera", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=2048), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("target_fps", sa.Float(), nullable=False),
        sa.Column("min_fps", sa.Float(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("spread_group", sa.String(length=64), nullable=True),
        sa.Column("prefer", sa.String(length=64), nullable=True),
        sa.Column("pin", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(["pool"], ["pool.name"]),
        sa.PrimaryKeyConstraint("pool", "camera"),
    )
    op.create_table(
        "pool_device",
        sa.Column("pool", sa.String(length=64), nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("cordoned", sa.Boolean(), nullable=False),
        sa.Column("draining", sa.Boolean(), nullable=False),
        sa.Column("since", TS, nullable=False),
        sa.ForeignKeyConstraint(["pool"], ["pool.name"]),
        sa.PrimaryKeyConstraint("pool", "device_id"),
    )
    op.create_table(
        "pool_placement",
        sa.Column("pool", sa.String(length=64), nullable=False),
        sa.Column("camera", sa.String(length=64), nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("fps", sa.Float(), nullable=False),
        sa.Column("since", TS, nullable=False),
        sa.ForeignKeyConstraint(["pool"], ["pool.name"]),
        sa.PrimaryKeyConstraint("pool", "camera"),
    )


def downgrade() -> None:
    op.drop_table("pool_placement")
    op.drop_table("pool_device")
    op.drop_table("pool_camera")
    op.drop_table("pool")
