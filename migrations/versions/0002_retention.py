"""retention and first admission: purged children, origin tool, indexes

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 20:29:07.233792
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# Both dialects: epoch seconds need double precision on PostgreSQL (its REAL is 4 bytes),
# and uint64 wire integers (generations, sequences) its BIGINT; SQLite's DDL is unchanged.
TIME = sa.REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")
BIG = sa.Integer().with_variant(sa.BigInteger(), "postgresql")

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "purged",
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("conversation_id", sa.Text(), nullable=False),
        sa.Column("grant_id", sa.Text(), nullable=True),
        sa.Column("lease_id", sa.Text(), nullable=True),
        sa.Column("purged_at", TIME, nullable=False),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_purged")),
    )
    with op.batch_alter_table("purged", schema=None) as batch_op:
        batch_op.create_index(
            "ix_purged_grant_conversation", ["grant_id", "conversation_id"], unique=False
        )

    # Rebuild rather than ALTER ... ADD COLUMN, so the stored DDL stays exactly the
    # metadata's (SQLite would append the column after the table's constraints).
    # (PostgreSQL alters in place: no rebuild there.)
    rebuild = "always" if op.get_bind().dialect.name == "sqlite" else "auto"
    with op.batch_alter_table("children", schema=None, recreate=rebuild) as batch_op:
        batch_op.add_column(sa.Column("origin_grant_id", sa.Text(), nullable=True))
        batch_op.create_index("ix_children_finished", ["finished_at"], unique=False)

    with op.batch_alter_table("grants", schema=None) as batch_op:
        batch_op.create_index(
            "ix_grants_expiry",
            ["expires_at"],
            unique=False,
            sqlite_where=sa.text("revoked_at IS NULL"),
            postgresql_where=sa.text("revoked_at IS NULL"),
        )


def downgrade() -> None:
    with op.batch_alter_table("grants", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_grants_expiry",
            sqlite_where=sa.text("revoked_at IS NULL"),
            postgresql_where=sa.text("revoked_at IS NULL"),
        )

    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_index("ix_children_finished")
        batch_op.drop_column("origin_grant_id")

    with op.batch_alter_table("purged", schema=None) as batch_op:
        batch_op.drop_index("ix_purged_grant_conversation")

    op.drop_table("purged")
