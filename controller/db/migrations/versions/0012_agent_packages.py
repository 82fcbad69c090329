"""Agent self-update: agent packages and agent rollouts.

``agent_package`` holds the uploaded agent packages; ``device.agent_desired`` the agent version a
device should run (direct, and the refs now and before); ``deployment.kind`` / ``agent_version`` /
``agent_health_timeout_s`` make a deployment roll out an agent version instead of a model (every
existing deployment is a model one).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "agent_package",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("requires", sa.JSON(), nullable=False),
        sa.Column("notes", sa.String(), nullable=True),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("uploaded_at", TS, nullable=False),
        sa.UniqueConstraint("version", name="uq_agent_package_version"),
    )
    op.create_index("ix_agent_package_sha256", "agent_package", ["sha256"])
    with op.batch_alter_table("device") as batch:
        batch.add_column(sa.Column("agent_desired", sa.JSON(), nullable=True))
    with op.batch_alter_table("deployment") as batch:
        batch.add_column(sa.Column("kind", sa.String(length=8), nullable=False, server_default="model"))
        batch.add_column(sa.Column("agent_version", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("agent_health_timeout_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("deployment") as batch:
        batch.drop_column("agent_health_timeout_s")
        batch.drop_column("agent_version")
        batch.drop_column("kind")
    with op.batch_alter_table("device") as batch:
        batch.drop_column("agent_desired")
    op.drop_index("ix_agent_package_sha256", table_name="agent_package")
    op.drop_table("agent_package")
