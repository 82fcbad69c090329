"""A deployment whose rollout failed is ``failed``, like its rollout.

Before, such a deployment was stored ``rolled_back``, the word of the operator's roll back too, so
the two outcomes read alike. The rows of failed rollouts are rewritten; ``rolled_back`` is left to
deployments the operator rolled back. Neither state applies to any device, so a replica of the
previous release reading ``failed`` treats the deployment as it did before (applied nowhere).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        sa.text(
            "UPDATE deployment SET state = 'failed' WHERE state = 'rolled_back' "
            "AND id IN (SELECT deployment_id FROM rollout WHERE state = 'failed')"
        )
    )


def downgrade() -> None:
    op.execute(sa.text("UPDATE deployment SET state = 'rolled_back' WHERE state = 'failed'"))
