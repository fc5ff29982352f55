"""a step journal, and each execution's options as at its start (design §14, §15)

``steps``: one row per step an execution recorded, keyed by the child (the execution)
and the step's name; purged with its child (ON DELETE CASCADE).

``children.options``: the effective options a child was reserved with, so that a
follow-up narrows the first execution's snapshot rather than the preset as registered
since. NULL for every child before this revision: its stored request and preset give
them as they were then.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.add_column(sa.Column("options", sa.LargeBinary(), nullable=True))
    op.create_table(
        "steps",
        sa.Column("child_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("raw", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("value", sa.LargeBinary(), nullable=False),
        sa.Column(
            "recorded_at",
            sa.REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql"),
            nullable=False,
        ),
        sa.CheckConstraint("ordinal >= 1", name=op.f("ck_steps_ordinal_positive")),
        sa.CheckConstraint("raw IN (0, 1)", name=op.f("ck_steps_raw_bool")),
        sa.ForeignKeyConstraint(
            ["child_id"],
            ["children.id"],
            name=op.f("fk_steps_child_id_children"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("child_id", "name", name=op.f("pk_steps")),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("steps")
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_column("options")
