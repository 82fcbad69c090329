"""The track a detection belongs to (PROTOCOL.md "Tracks"): ``detection.track_id``, null for
detections of agents before tracking and of tracks not yet confirmed, and an index to find a track's
detections by it.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD COLUMN (nullable, no default): no table rewrite on either database, however many rows.
    op.add_column("detection", sa.Column("track_id", sa.BigInteger(), nullable=True))
    op.create_index("ix_detection_track", "detection", ["track_id"])


def downgrade() -> None:
    op.drop_index("ix_detection_track", table_name="detection")
    with op.batch_alter_table("detection") as batch:
        batch.drop_column("track_id")
