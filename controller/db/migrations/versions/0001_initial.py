"""Initial schema: devices, health, detections, dedup record, events, model versions.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written by hand to match controller/db/tables.py; types spelled out so that the migration does not
# change when the models do.
TS = sa.DateTime(timezone=True)
BIGID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "device",
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("enrolled", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("online_since", TS, nullable=True),
        sa.Column("offline_since", TS, nullable=True),
        sa.Column("last_seen", TS, nullable=True),
        sa.Column("agent_version", sa.String(), nullable=True),
        sa.Column("capabilities", sa.JSON(), nullable=True),
        sa.Column("last_health", sa.JSON(), nullable=True),
        sa.Column("desired", sa.JSON(), nullable=True),
        sa.Column("desired_version", sa.Integer(), nullable=False),
        sa.Column("reported", sa.JSON(), nullable=True),
        sa.Column("reported_version", sa.Integer(), nullable=True),
        sa.Column("duplicates", sa.BigInteger(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "health_sample",
        sa.Column("ts", TS, nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("id", BIGID, nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_health_sample_device_ts", "health_sample", ["device_id", "ts"])
    op.create_table(
        "detection",
        sa.Column("id", BIGID, nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("camera", sa.String(), nullable=False),
        sa.Column("frame", sa.BigInteger(), nullable=False),
        sa.Column("captured_at", TS, nullable=False),
        sa.Column("stored_at", TS, nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("label", sa.String(), nullable=False),
        sa.Column("class_id", sa.BigInteger(), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("x0", sa.Float(), nullable=False),
        sa.Column("y0", sa.Float(), nullable=False),
        sa.Column("x1", sa.Float(), nullable=False),
        sa.Column("y1", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_detection_captured", "detection", ["captured_at", "id"])
    op.create_index("ix_detection_device_captured", "detection", ["device_id", "captured_at"])
    op.create_index("ix_detection_device_seq", "detection", ["device_id", "seq"])
    op.create_index("ix_detection_label", "detection", ["label"])
    op.create_index("ix_detection_camera", "detection", ["camera"])
    op.create_table(
        "ingested_seq",
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("stored_at", TS, nullable=False),
        sa.Column("dropped", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("device_id", "seq"),
    )
    op.create_table(
        "event",
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=True),
        sa.Column("ts", TS, nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("camera", sa.String(), nullable=True),
        sa.Column("message", sa.String(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("id", BIGID, nullable=False),
        sa.Column("stored_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_event_device_ts", "event", ["device_id", "ts"])
    op.create_index("ix_event_kind_ts", "event", ["kind", "ts"])
    op.create_index("ix_event_ts", "event", ["ts", "id"])
    op.create_table(
        "model_version",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sha256", name="uq_model_version_sha256"),
        sa.UniqueConstraint("name", "version", name="uq_model_version_name_version"),
    )


def downgrade() -> None:
    op.drop_table("model_version")
    op.drop_index("ix_event_ts", table_name="event")
    op.drop_index("ix_event_kind_ts", table_name="event")
    op.drop_index("ix_event_device_ts", table_name="event")
    op.drop_table("event")
    op.drop_table("ingested_seq")
    op.drop_index("ix_detection_camera", table_name="detection")
    op.drop_index("ix_detection_label", table_name="detection")
    op.drop_index("ix_detection_device_seq", table_name="detection")
    op.drop_index("ix_detection_device_captured", table_name="detection")
    op.drop_index("ix_detection_captured", table_name="detection")
    op.drop_table("detection")
    op.drop_index("ix_health_sample_device_ts", table_name="health_sample")
    op.drop_table("health_sample")
    op.drop_table("device")
