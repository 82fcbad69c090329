"""Each sequence space keeps the runs of covered seqs above its ``upto`` on its own row.

``device_seq.above`` holds, as JSON ``[[first, last], ...]``, the runs above ``upto`` that are stored
(``ingested_seq``) or declared dropped (``dropped_range``): what an ack's ranges say. Ingest reads it
with the row it locks, instead of reading every stored seq above ``upto`` on each commit. The column is
filled here from those two tables, for the spaces that have anything above ``upto``.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Runs of consecutive stored seqs above each space's upto (seq - row_number is constant along a run).
_STORED_RUNS = sa.text(
    "SELECT device_id, incarnation, MIN(seq), MAX(seq) FROM ("
    "SELECT i.device_id, i.incarnation, i.seq, i.seq - ROW_NUMBER() OVER ("
    "PARTITION BY i.device_id, i.incarnation ORDER BY i.seq) AS grp "
    "FROM ingested_seq i JOIN device_seq d "
    "ON d.device_id = i.device_id AND d.incarnation = i.incarnation AND i.seq > d.upto) AS runs "
    "GROUP BY device_id, incarnation, grp"
)
_DECLARED_RUNS = sa.text(
    'SELECT r.device_id, r.incarnation, r."first", r."last" FROM dropped_range r JOIN device_seq d '
    'ON d.device_id = r.device_id AND d.incarnation = r.incarnation AND r."last" > d.upto'
)


def _merge(runs: list[tuple[int, int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def upgrade() -> None:
    with op.batch_alter_table("device_seq") as batch:
        batch.add_column(sa.Column("above", sa.Text(), nullable=False, server_default="[]"))
    conn = op.get_bind()
    runs: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for query in (_STORED_RUNS, _DECLARED_RUNS):
        for dev, inc, first, last in conn.execute(query):
            runs.setdefault((str(dev), str(inc)), []).append((int(first), int(last)))
    update = sa.text("UPDATE device_seq SET above = :above WHERE device_id = :d AND incarnation = :i")
    for (dev, inc), found in runs.items():
        upto = int(
            conn.execute(
                sa.text("SELECT upto FROM device_seq WHERE device_id = :d AND incarnation = :i"),
                {"d": dev, "i": inc},
            ).scalar_one()
        )
        merged = _merge([(max(a, upto + 1), b) for a, b in found if b > upto])
        conn.execute(update, {"above": json.dumps(merged, separators=(",", ":")), "d": dev, "i": inc})


def downgrade() -> None:
    with op.batch_alter_table("device_seq") as batch:
        batch.drop_column("above")
