"""Ingest truth per device: ``device_seq`` (upto, highest seq, stored / dropped / duplicate counters).

Filled from the history already in ``ingested_seq`` (and the duplicates counted on ``device``) once,
here, so that a controller never has to scan that history at start and its acks carry on where the
old ones stopped.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Per device: upto is the end of the run of consecutive seqs that starts at 1 (seq - row_number() is 0
# exactly on that run), max_seq the highest seq, and the counts of stored and declared-dropped seqs.
# Plain SQL that SQLite (window functions: 3.25+) and PostgreSQL both run.
BACKFILL = """
INSERT INTO device_seq (device_id, upto, max_seq, stored, dropped, duplicates)
SELECT c.device_id, COALESCE(r.upto, 0), c.max_seq, c.stored, c.dropped, COALESCE(d.duplicates, 0)
FROM (
    SELECT device_id, MAX(seq) AS max_seq,
           SUM(CASE WHEN dropped THEN 0 ELSE 1 END) AS stored,
           SUM(CASE WHEN dropped THEN 1 ELSE 0 END) AS dropped
    FROM ingested_seq GROUP BY device_id
) c
LEFT JOIN (
    SELECT device_id, MAX(seq) AS upto
    FROM (
        SELECT device_id, seq, seq - ROW_NUMBER() OVER (PARTITION BY device_id ORDER BY seq) AS grp
        FROM ingested_seq
    ) runs
    WHERE grp = 0
    GROUP BY device_id
) r ON r.device_id = c.device_id
LEFT JOIN device d ON d.id = c.device_id
"""


def upgrade() -> None:
    op.create_table(
        "device_seq",
        sa.Column("device_id", sa.String(length=64), primary_key=True),
        sa.Column("upto", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("max_seq", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("stored", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("dropped", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("duplicates", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.execute(sa.text(BACKFILL))


def downgrade() -> None:
    op.drop_table("device_seq")
