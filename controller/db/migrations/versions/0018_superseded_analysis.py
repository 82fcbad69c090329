"""Where a pool camera had two analysers: the one a move left, until it stopped.

A move off a device that did not answer (offline, gone, cannot reach the source) cannot stop that
device: partitioned, it may well go on analysing the camera and upload what it saw once the link is
back, while the camera's new device analyses it too. A handover ends the same way for a moment. Each
``superseded_analysis`` row is such a span: detections of ``camera`` from ``device_id`` captured in
``[since, until)`` (``until`` null while the span is open) are marked superseded, so that counts see one
analyser per camera; both sides' detections are kept.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "superseded_analysis",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("pool", sa.String(length=64), nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("camera", sa.String(length=64), nullable=False),
        sa.Column("since", TS, nullable=False),
        sa.Column("until", TS, nullable=True),
        sa.Column("reason", sa.String(length=32), nullable=False),
    )
    op.create_index("ix_superseded_device_camera", "superseded_analysis", ["device_id", "camera"])


def downgrade() -> None:
    op.drop_index("ix_superseded_device_camera", table_name="superseded_analysis")
    op.drop_table("superseded_analysis")
