"""the operating-system process of each command child, so a boot can kill orphans

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 21:10:00.000000
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

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A process is (pid, start ticks, boot id): a pid alone may name a later process.
    op.create_table(
        "processes",
        sa.Column("child_id", sa.Integer(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("start_ticks", BIG, nullable=False),
        sa.Column("boot_id", sa.Text(), nullable=False),
        sa.Column("recorded_at", TIME, nullable=False),
        sa.CheckConstraint("pid > 0", name=op.f("ck_processes_pid_positive")),
        sa.ForeignKeyConstraint(
            ["child_id"],
            ["children.id"],
            name=op.f("fk_processes_child_id_children"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("child_id", name=op.f("pk_processes")),
    )


def downgrade() -> None:
    op.drop_table("processes")
