"""priority is a head start, not a band; a scope caps the priority it admits

SPEC §31. Priority bands were strict: a parent submitting at 9 kept another parent's
earlier child (priority 5) waiting behind all of its work. ``children`` gains
``queue_turn``, the child's turn among parents, kept once it is admitted so that a
parent's next turn follows its last (``ix_children_parent_turn``), and the newest turn
served is found through ``ix_children_turn_served``; a queued child's ``queue_tag`` is
its turn plus ``(9 - priority) * 8`` turns of head start (design §22). The index of a
parent's last queued tag is no longer read and goes. A child queued before this revision
keeps its place among the others: its turn is its old turn within its band, its tag
recomputed from it. ``admission`` gains ``max_priority`` (NULL: no cap).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 18:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

TIME = sa.REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_QUEUED = sa.text("state = 'queued'")
_TURNED = sa.text("queue_turn IS NOT NULL")
_SERVED = sa.text("queue_turn IS NOT NULL AND state != 'queued'")
_BAND = float(2**40)  # revision 0015's turns of one priority band
_AGING = 8.0


def upgrade() -> None:
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.add_column(sa.Column("queue_turn", TIME, nullable=True))
    op.execute(
        f"UPDATE children SET queue_turn = queue_tag - (9 - priority) * {_BAND}"
        " WHERE state = 'queued' AND queue_tag >= 0"
    )
    op.execute("UPDATE children SET queue_turn = 0 WHERE state = 'queued' AND queue_tag < 0")
    op.execute(
        f"UPDATE children SET queue_tag = queue_turn + (9 - priority) * {_AGING}"
        " WHERE state = 'queued' AND queue_tag >= 0"
    )
    op.drop_index(
        "ix_children_queue_parent",
        table_name="children",
        sqlite_where=_QUEUED,
        postgresql_where=_QUEUED,
    )
    op.create_index(
        "ix_children_turn_served",
        "children",
        ["queue_turn"],
        unique=False,
        sqlite_where=_SERVED,
        postgresql_where=_SERVED,
    )
    op.create_index(
        "ix_children_parent_turn",
        "children",
        ["parent_conversation_id", "queue_turn"],
        unique=False,
        sqlite_where=_TURNED,
        postgresql_where=_TURNED,
    )
    with op.batch_alter_table("admission", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_priority", sa.Integer(), nullable=True))
        batch_op.create_check_constraint(
            "max_priority_in_range", "max_priority IS NULL OR max_priority BETWEEN 0 AND 9"
        )


def downgrade() -> None:
    with op.batch_alter_table("admission", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_admission_max_priority_in_range"), type_="check")
        batch_op.drop_column("max_priority")
    op.drop_index(
        "ix_children_parent_turn",
        table_name="children",
        sqlite_where=_TURNED,
        postgresql_where=_TURNED,
    )
    op.drop_index(
        "ix_children_turn_served",
        table_name="children",
        sqlite_where=_SERVED,
        postgresql_where=_SERVED,
    )
    op.execute(
        f"UPDATE children SET queue_tag = queue_turn + (9 - priority) * {_BAND}"
        " WHERE state = 'queued' AND queue_tag >= 0"
    )
    op.create_index(
        "ix_children_queue_parent",
        "children",
        ["parent_conversation_id", "queue_tag"],
        unique=False,
        sqlite_where=_QUEUED,
        postgresql_where=_QUEUED,
    )
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_column("queue_turn")
