"""A pool camera moved off a live device keeps running there until its new device runs it.

``pool_placement.handover_from`` names the device a camera left by a move that was not a failure (a
drain, a manual move, a failback, an overload): that device's desired state keeps the camera until the
new device reports it running (or the handover times out, or the old device goes offline), so the
camera is never unanalysed during the move. Null for every existing row. Also indexes placements by
device, which is how each device's desired state reads them.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pool_placement") as batch:
        batch.add_column(sa.Column("handover_from", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("handover_since", sa.DateTime(timezone=True), nullable=True))
    # Each device's desired state reads its placements and handovers by device, not by pool.
    op.create_index("ix_pool_placement_device", "pool_placement", ["device_id"])
    op.create_index("ix_pool_placement_handover", "pool_placement", ["handover_from"])


def downgrade() -> None:
    op.drop_index("ix_pool_placement_handover", table_name="pool_placement")
    op.drop_index("ix_pool_placement_device", table_name="pool_placement")
    with op.batch_alter_table("pool_placement") as batch:
        batch.drop_column("handover_since")
        batch.drop_column("handover_from")
