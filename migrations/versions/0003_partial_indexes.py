"""partial indexes: a start writes no entry for a lease it has not or an end it has not had

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 01:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every query on these columns names a value (``lease_id = ?``, ``finished_at < ?``),
    # which implies NOT NULL, so SQLite still uses the partial indexes for them.
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_index("ix_children_lease")
        batch_op.drop_index("ix_children_finished")
        batch_op.create_index(
            "ix_children_lease",
            ["runner_id", "lease_id"],
            unique=False,
            sqlite_where=sa.text("lease_id IS NOT NULL"),
            postgresql_where=sa.text("lease_id IS NOT NULL"),
        )
        batch_op.create_index(
            "ix_children_finished",
            ["finished_at"],
            unique=False,
            sqlite_where=sa.text("finished_at IS NOT NULL"),
            postgresql_where=sa.text("finished_at IS NOT NULL"),
        )


def downgrade() -> None:
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_children_finished",
            sqlite_where=sa.text("finished_at IS NOT NULL"),
            postgresql_where=sa.text("finished_at IS NOT NULL"),
        )
        batch_op.drop_index(
            "ix_children_lease",
            sqlite_where=sa.text("lease_id IS NOT NULL"),
            postgresql_where=sa.text("lease_id IS NOT NULL"),
        )
        batch_op.create_index("ix_children_finished", ["finished_at"], unique=False)
        batch_op.create_index("ix_children_lease", ["runner_id", "lease_id"], unique=False)
