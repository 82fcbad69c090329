"""Variant builds as jobs any replica may claim: claim owner, token and heartbeat on model_version.

A version whose status is ``building`` is a job (controller/registry/build_jobs.py). Versions left
``building`` by an older controller have no claim, so the first worker to poll takes them.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("model_version") as batch:
        batch.add_column(sa.Column("build_owner", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("build_token", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("build_heartbeat_at", TS, nullable=True))
        batch.add_column(sa.Column("build_attempts", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("model_version") as batch:
        batch.drop_column("build_attempts")
        batch.drop_column("build_heartbeat_at")
        batch.drop_column("build_token")
        batch.drop_column("build_owner")
