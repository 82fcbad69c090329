"""Variant ISA: the CPU instruction set an int8 variant was judged on, and whether it is 7-bit (portable).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Rows built before this are left NULL / false: their ISA was never recorded, and the per-device
    # choice treats that as unknown (a device known to lack VNNI then gets fp32 until a rebuild).
    with op.batch_alter_table("model_variant") as batch:
        batch.add_column(sa.Column("int8_isa", sa.String(length=8), nullable=True))
        batch.add_column(sa.Column("reduce_range", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("model_variant") as batch:
        batch.drop_column("reduce_range")
        batch.drop_column("int8_isa")
