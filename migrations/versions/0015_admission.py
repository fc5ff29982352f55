"""admission waits its turn, and every child has a deadline

design §22. ``children`` gains the state ``queued`` (in its CHECK and in the one-active
index, which holds every unfinished child); its ``priority`` (0-9); when it entered
admission (``queued_at``: set for every child a policy admitted, queued or not), its
place in the queue (``queue_tag``: its priority band and its turn among parents) and
when its wait times out (``queue_expires_at``); and when it must have ended
(``deadline_at``, from its first admission). The queue is read in order through
``ix_children_queue``; the slots a scope holds are counted through
``ix_children_admission`` (preset, extension, runner) and ``..._parent``: only children
a policy admitted are in them, so a start under no policy writes no entry. ``admission``
holds the policies by scope, with each one's rate tokens. SQLite rebuilds ``children``
for its CHECK; every row stays as it was (none is queued before this revision).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05 06:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

TIME = sa.REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = "('prepared', 'admitted', 'running', 'waiting', 'done', 'cancelled')"
_AFTER = "('prepared', 'queued', 'admitted', 'running', 'waiting', 'done', 'cancelled')"
_ACTIVE_BEFORE = "state IN ('prepared', 'admitted', 'running', 'waiting')"
_ACTIVE_AFTER = "state IN ('prepared', 'queued', 'admitted', 'running', 'waiting')"
_QUEUED = "state = 'queued'"
_ADMISSION = "queued_at IS NOT NULL AND state IN ('queued', 'admitted', 'running')"
_DEADLINE = "deadline_at IS NOT NULL AND state IN ('queued', 'waiting')"
_EXPIRY = "queue_expires_at IS NOT NULL AND state = 'queued'"


def _one_active(batch_op: object, where: str) -> None:
    batch_op.create_index(  # type: ignore[attr-defined]
        "ix_children_one_active",
        ["conversation_id"],
        unique=True,
        sqlite_where=sa.text(where),
        postgresql_where=sa.text(where),
    )


_INDEXES = (
    ("ix_children_queue", ["queue_tag", "id"], _QUEUED),
    ("ix_children_queue_parent", ["parent_conversation_id", "queue_tag"], _QUEUED),
    ("ix_children_admission", ["runner_id", "extension_id", "profile", "state"], _ADMISSION),
    ("ix_children_admission_parent", ["parent_conversation_id", "state"], _ADMISSION),
    ("ix_children_deadline", ["deadline_at"], _DEADLINE),
    ("ix_children_queue_expiry", ["queue_expires_at"], _EXPIRY),
)


def upgrade() -> None:
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("priority", sa.Integer(), server_default=sa.text("5"), nullable=False)
        )
        batch_op.add_column(sa.Column("queued_at", TIME, nullable=True))
        batch_op.add_column(sa.Column("queue_tag", TIME, nullable=True))
        batch_op.add_column(sa.Column("queue_expires_at", TIME, nullable=True))
        batch_op.add_column(sa.Column("deadline_at", TIME, nullable=True))
        batch_op.drop_constraint(op.f("ck_children_state"), type_="check")
        batch_op.create_check_constraint("state", f"state IN {_AFTER}")
        batch_op.create_check_constraint("priority_in_range", "priority BETWEEN 0 AND 9")
        batch_op.create_check_constraint(
            "queued_has_place",
            "state != 'queued' OR (queue_tag IS NOT NULL AND queued_at IS NOT NULL)",
        )
        batch_op.drop_index("ix_children_one_active")
        _one_active(batch_op, _ACTIVE_AFTER)
        for name, columns, where in _INDEXES:
            batch_op.create_index(
                name,
                columns,
                unique=False,
                sqlite_where=sa.text(where),
                postgresql_where=sa.text(where),
            )
    op.create_table(
        "admission",
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=True),
        sa.Column("rate_n", sa.Integer(), nullable=True),
        sa.Column("rate_s", TIME, nullable=True),
        sa.Column("max_queued", sa.Integer(), nullable=False),
        sa.Column("queue_timeout_s", TIME, nullable=True),
        sa.Column("tokens", TIME, nullable=True),
        sa.Column("refilled_at", TIME, nullable=True),
        sa.Column("updated_at", TIME, nullable=False),
        sa.CheckConstraint(
            "concurrency IS NULL OR concurrency >= 1",
            name=op.f("ck_admission_concurrency_positive"),
        ),
        sa.CheckConstraint(
            "(rate_n IS NULL) = (rate_s IS NULL) AND (rate_n IS NULL OR (rate_n >= 1 AND rate_s > 0))",
            name=op.f("ck_admission_rate_whole"),
        ),
        sa.CheckConstraint("max_queued >= 0", name=op.f("ck_admission_max_queued_non_negative")),
        sa.PrimaryKeyConstraint("scope", name=op.f("pk_admission")),
    )


def downgrade() -> None:
    op.drop_table("admission")
    # A queued child cannot be held by the schema before: it ends unadmitted, as a
    # cancel would end it.
    op.execute(
        "UPDATE children SET state = 'cancelled', error = 'cancelled: admission wait ended by"
        " downgrade', finished_at = updated_at WHERE state = 'queued'"
    )
    with op.batch_alter_table("children", schema=None) as batch_op:
        for name, _, where in reversed(_INDEXES):
            batch_op.drop_index(name, sqlite_where=sa.text(where), postgresql_where=sa.text(where))
        batch_op.drop_index("ix_children_one_active")
        _one_active(batch_op, _ACTIVE_BEFORE)
        batch_op.drop_constraint(op.f("ck_children_queued_has_place"), type_="check")
        batch_op.drop_constraint(op.f("ck_children_priority_in_range"), type_="check")
        batch_op.drop_constraint(op.f("ck_children_state"), type_="check")
        batch_op.create_check_constraint("state", f"state IN {_BEFORE}")
        batch_op.drop_column("deadline_at")
        batch_op.drop_column("queue_expires_at")
        batch_op.drop_column("queue_tag")
        batch_op.drop_column("queued_at")
        batch_op.drop_column("priority")
