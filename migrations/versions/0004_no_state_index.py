"""no index on state alone: unfinished children are found through ix_children_one_active

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 00:55:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A start wrote an entry into this index and its admission moved the entry: two
    # index updates per start for the few queries that look for unfinished children,
    # which the partial unique index ix_children_one_active serves as well.
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_index("ix_children_state")


def downgrade() -> None:
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.create_index("ix_children_state", ["state"], unique=False)
