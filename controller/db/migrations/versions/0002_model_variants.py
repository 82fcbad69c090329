"""Model registry: variant builds on model versions, the model_variant table, device assignments.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # batch mode: SQLite cannot ALTER most things in place; on PostgreSQL it is a plain ALTER.
    with op.batch_alter_table("model_version") as batch:
        batch.drop_constraint("uq_model_version_sha256", type_="unique")
        batch.create_index("ix_model_version_sha256", ["sha256"])
        batch.add_column(sa.Column("status", sa.String(length=16), nullable=False, server_default="ready"))
        batch.add_column(sa.Column("build_stage", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("build_progress", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("build_error", sa.String(), nullable=True))
    with op.batch_alter_table("device") as batch:
        batch.add_column(sa.Column("assignments", sa.JSON(), nullable=True))
    op.create_table(
        "model_variant",
        sa.Column("variant", sa.String(length=8), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=True),
        sa.Column("latency_ms_1t", sa.Float(), nullable=True),
        sa.Column("latency_ms_2t", sa.Float(), nullable=True),
        sa.Column("f1", sa.Float(), nullable=True),
        sa.Column("mean_iou", sa.Float(), nullable=True),
        sa.Column("detections", sa.Integer(), nullable=True),
        sa.Column("fit", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("target", sa.String(length=8), nullable=False),
        sa.Column("build_s", sa.Float(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["model_version_id"], ["model_version.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("model_version_id", "variant", name="uq_model_variant_version_variant"),
    )
    op.create_index("ix_model_variant_sha256", "model_variant", ["sha256"])


def downgrade() -> None:
    op.drop_index("ix_model_variant_sha256", table_name="model_variant")
    op.drop_table("model_variant")
    with op.batch_alter_table("device") as batch:
        batch.drop_column("assignments")
    with op.batch_alter_table("model_version") as batch:
        batch.drop_column("build_error")
        batch.drop_column("build_progress")
        batch.drop_column("build_stage")
        batch.drop_column("status")
        batch.drop_index("ix_model_version_sha256")
        batch.create_unique_constraint("uq_model_version_sha256", ["sha256"])
