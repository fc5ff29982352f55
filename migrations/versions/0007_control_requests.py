"""control requests: an operator's cancel or steer, applied by the owning host

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 21:30:00.000000
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

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "controls",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("conversation_id", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Text(), nullable=True),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("request_id", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("applied_at", TIME, nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.CheckConstraint("action IN ('cancel', 'steer')", name=op.f("ck_controls_action")),
        sa.CheckConstraint(
            "(applied_at IS NULL) = (outcome IS NULL)", name=op.f("ck_controls_applied_has_outcome")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_controls")),
    )
    # A host asks for the pending ones after every commit it sees: only they are indexed.
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.create_index(
            "ix_controls_pending",
            ["id"],
            unique=False,
            sqlite_where=sa.text("applied_at IS NULL"),
            postgresql_where=sa.text("applied_at IS NULL"),
        )


def downgrade() -> None:
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_controls_pending",
            sqlite_where=sa.text("applied_at IS NULL"),
            postgresql_where=sa.text("applied_at IS NULL"),
        )
    op.drop_table("controls")
