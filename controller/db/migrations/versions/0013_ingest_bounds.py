"""Ingest bounds: declared-dropped seqs as runs, and the source of every event.

``dropped_range`` holds one row per run of seqs an agent declared dropped (before: one
``ingested_seq`` row per seq, ``dropped`` true); the existing rows are folded into runs. ``event.source``
says who wrote an event: ``device`` for those that came with a seq on a device's events topic, the
controller's own (no seq) ``controller``.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
_EXPAND_CHUNK = 5000


def upgrade() -> None:
    op.create_table(
        "dropped_range",
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("incarnation", sa.String(length=32), nullable=False, server_default=""),
        sa.Column("first", sa.BigInteger(), nullable=False),
        sa.Column("last", sa.BigInteger(), nullable=False),
        sa.Column("declared_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("device_id", "incarnation", "first"),
    )
    # Runs of consecutive dropped seqs (seq - row_number is constant along a run), on both databases.
    op.execute(
        sa.text(
            "INSERT INTO dropped_range (device_id, incarnation, first, last, declared_at) "
            "SELECT device_id, incarnation, MIN(seq), MAX(seq), MIN(stored_at) FROM ("
            "SELECT device_id, incarnation, seq, stored_at, seq - ROW_NUMBER() OVER ("
            "PARTITION BY device_id, incarnation ORDER BY seq) AS grp "
            "FROM ingested_seq WHERE dropped) AS runs "
            "GROUP BY device_id, incarnation, grp"
        )
    )
    op.execute(sa.text("DELETE FROM ingested_seq WHERE dropped"))
    with op.batch_alter_table("event") as batch:
        batch.add_column(
            sa.Column("source", sa.String(length=16), nullable=False, server_default="controller")
        )
    # Every event a device sent carries its seq; the controller's own have none.
    op.execute(sa.text("UPDATE event SET source = 'device' WHERE seq IS NOT NULL"))


def downgrade() -> None:
    with op.batch_alter_table("event") as batch:
        batch.drop_column("source")
    conn = op.get_bind()
    runs = conn.execute(
        sa.text("SELECT device_id, incarnation, first, last, declared_at FROM dropped_range")
    ).all()
    ins = sa.text(
        "INSERT INTO ingested_seq (device_id, incarnation, seq, kind, stored_at, dropped) "
        "VALUES (:d, :i, :q, 'dropped', :at, :dropped)"
    )
    for dev, inc, first, last, at in runs:
        for a in range(int(first), int(last) + 1, _EXPAND_CHUNK):
            b = min(int(last), a + _EXPAND_CHUNK - 1)
            conn.execute(
                ins, [{"d": dev, "i": inc, "q": q, "at": at, "dropped": True} for q in range(a, b + 1)]
            )
    op.drop_table("dropped_range")
