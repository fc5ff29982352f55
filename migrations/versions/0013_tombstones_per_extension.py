"""tombstones per extension: an index of each (runner, extension)'s revoked leases

A runner keeps the newest tombstones of each of its extensions (design §18), no longer of
the runner as a whole, so that one extension's releases never drop another's. Trimming
them after a release reads only that extension's, through this index. No row changes.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TOMBSTONE = "kind = 'lease' AND revoked_at IS NOT NULL"


def upgrade() -> None:
    with op.batch_alter_table("grants", schema=None) as batch_op:
        batch_op.create_index(
            "ix_grants_tombstones",
            ["runner_id", "extension_id", "revoked_at"],
            unique=False,
            sqlite_where=sa.text(_TOMBSTONE),
            postgresql_where=sa.text(_TOMBSTONE),
        )


def downgrade() -> None:
    with op.batch_alter_table("grants", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_grants_tombstones",
            sqlite_where=sa.text(_TOMBSTONE),
            postgresql_where=sa.text(_TOMBSTONE),
        )
