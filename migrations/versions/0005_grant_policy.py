"""a grant keeps its parent run's policy (the ceiling of its children's options)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 21:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NULL (every grant before this revision) means no ceiling, as before.
    with op.batch_alter_table("grants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("policy", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("grants", schema=None) as batch_op:
        batch_op.drop_column("policy")
