"""Per-device broker credentials: the hash of each device's MQTT password, when it was issued, and
when it was revoked (controller/link/broker_auth.py). The password itself is never stored.

Revision ID: 0004
Revises: 0003
Create Date: 2025-03-15
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("device") as batch:
        batch.add_column(sa.Column("mqtt_password_hash", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("mqtt_issued_at", TS, nullable=True))
        batch.add_column(sa.Column("mqtt_revoked_at", TS, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("device") as batch:
        batch.drop_column("mqtt_revoked_at")
        batch.drop_column("mqtt_issued_at")
        batch.drop_column("mqtt_password_hash")
