"""Deployments and rollouts: the deployment, rollout and rollout_device tables; the direct
assignment layer of each device kept apart (``device.direct``), filled from what was assigned.

Revision ID: 0003
Revises: 0002
Create Date: 2025-03-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("device") as batch:
        batch.add_column(sa.Column("direct", sa.JSON(), nullable=True))
    _fill_direct()
    op.create_table(
        "deployment",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("variant", sa.String(length=8), nullable=False),
        sa.Column("selector", sa.String(), nullable=False),
        sa.Column("cameras", sa.JSON(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name", name="uq_deployment_name"),
    )
    op.create_table(
        "rollout",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("waves", sa.JSON(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("current_wave", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("gate", sa.JSON(), nullable=False),
        sa.Column("gates", sa.JSON(), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployment.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("deployment_id", name="uq_rollout_deployment"),
    )
    op.create_table(
        "rollout_device",
        sa.Column("rollout_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("wave", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("cameras", sa.JSON(), nullable=False),
        sa.Column("target_version", sa.Integer(), nullable=True),
        sa.Column("baseline_fps", sa.Float(), nullable=True),
        sa.Column("baseline_latency_ms", sa.Float(), nullable=True),
        sa.Column("admitted_at", TS, nullable=True),
        sa.Column("settled_at", TS, nullable=True),
        sa.Column("reason", sa.String(), nullable=True),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollout.id"]),
        sa.PrimaryKeyConstraint("rollout_id", "device_id"),
    )


def _fill_direct() -> None:
    """Before this revision every assignment was direct: keep them as the bottom layer."""
    device = sa.table(
        "device",
        sa.column("id", sa.String()),
        sa.column("desired", sa.JSON()),
        sa.column("assignments", sa.JSON()),
        sa.column("direct", sa.JSON()),
    )
    conn = op.get_bind()
    rows = conn.execute(sa.select(device.c.id, device.c.desired, device.c.assignments)).all()
    for dev_id, desired, assignments in rows:
        cams = (desired or {}).get("cameras") or {}
        direct = {}
        for cam, a in (assignments or {}).items():
            cd = cams.get(cam) or {}
            direct[cam] = {
                "model": a.get("model"),
                "version": a.get("version"),
                "pin": a.get("pin") or "auto",
                "threshold": cd.get("threshold"),
                "max_fps": cd.get("max_fps"),
                "labels": cd.get("labels"),
            }
        if direct:
            conn.execute(sa.update(device).where(device.c.id == dev_id).values(direct=direct))


def downgrade() -> None:
    op.drop_table("rollout_device")
    op.drop_table("rollout")
    op.drop_table("deployment")
    with op.batch_alter_table("device") as batch:
        batch.drop_column("direct")
