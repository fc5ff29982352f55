"""a child may wait: the state ``waiting``, what it waits for, events sent to it

design §21. ``children`` gains the state ``waiting`` (in its CHECK and in the one-active
index, which holds every unfinished child), when a waiting child wakes (``wake_at``,
indexed by owner for the host's wake-ups), how often it woke (``wakes``) and how many
input requests of the execution are open (``inputs_open``). ``waits`` holds what an
execution waits for, one row per wait, named as its step is; ``signals`` the events sent
to a conversation until a wait takes one. ``controls`` takes an operator's ``input``
and ``event`` too. SQLite rebuilds ``children`` and ``controls`` for their CHECKs; every
row stays as it was (none is waiting before this revision).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

TIME = sa.REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = "('prepared', 'admitted', 'running', 'done', 'cancelled')"
_AFTER = "('prepared', 'admitted', 'running', 'waiting', 'done', 'cancelled')"
_ACTIVE_BEFORE = "state IN ('prepared', 'admitted', 'running')"
_ACTIVE_AFTER = "state IN ('prepared', 'admitted', 'running', 'waiting')"
_ADMITTED_BEFORE = "state NOT IN ('admitted', 'running') OR admitted_at IS NOT NULL"
_ADMITTED_AFTER = "state NOT IN ('admitted', 'running', 'waiting') OR admitted_at IS NOT NULL"
_WAITING = "state = 'waiting'"
_ACTIONS_BEFORE = "action IN ('cancel', 'steer')"
_ACTIONS_AFTER = "action IN ('cancel', 'steer', 'input', 'event')"


def _one_active(batch_op: object, where: str) -> None:
    batch_op.create_index(  # type: ignore[attr-defined]
        "ix_children_one_active",
        ["conversation_id"],
        unique=True,
        sqlite_where=sa.text(where),
        postgresql_where=sa.text(where),
    )


def upgrade() -> None:
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.add_column(sa.Column("wake_at", TIME, nullable=True))
        batch_op.add_column(
            sa.Column("wakes", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
        batch_op.add_column(
            sa.Column("inputs_open", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
        batch_op.drop_constraint(op.f("ck_children_state"), type_="check")
        batch_op.create_check_constraint("state", f"state IN {_AFTER}")
        batch_op.drop_constraint(op.f("ck_children_admitted_has_time"), type_="check")
        batch_op.create_check_constraint("admitted_has_time", _ADMITTED_AFTER)
        batch_op.create_check_constraint(
            "wait_counts_non_negative", "wakes >= 0 AND inputs_open >= 0"
        )
        batch_op.drop_index("ix_children_one_active")
        _one_active(batch_op, _ACTIVE_AFTER)
        batch_op.create_index(
            "ix_children_waking",
            ["engine_instance_id", "wake_at"],
            unique=False,
            sqlite_where=sa.text(_WAITING),
            postgresql_where=sa.text(_WAITING),
        )
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_controls_action"), type_="check")
        batch_op.create_check_constraint("action", _ACTIONS_AFTER)
    op.create_table(
        "waits",
        sa.Column("child_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("prompt", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("options", sa.Text(), nullable=True),
        sa.Column("tool_name", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("tool_call_id", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("input", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("event_key", sa.Text(), nullable=True),
        sa.Column("expires_at", TIME, nullable=True),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("answered_at", TIME, nullable=True),
        sa.Column("answer", sa.LargeBinary(), nullable=True),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("closed_at", TIME, nullable=True),
        sa.CheckConstraint(
            "kind IN ('input', 'approval', 'event', 'sleep')", name=op.f("ck_waits_kind")
        ),
        sa.CheckConstraint(
            "(answered_at IS NULL) = (answer IS NULL)", name=op.f("ck_waits_answered_has_answer")
        ),
        sa.CheckConstraint(
            "(kind = 'event') = (event_key IS NOT NULL)", name=op.f("ck_waits_event_has_key")
        ),
        sa.ForeignKeyConstraint(
            ["child_id"],
            ["children.id"],
            name=op.f("fk_waits_child_id_children"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("child_id", "name", name=op.f("pk_waits")),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "signals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("conversation_id", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("sent_at", TIME, nullable=False),
        sa.Column("taken_by", sa.Integer(), nullable=True),
        sa.Column("taken_at", TIME, nullable=True),
        sa.CheckConstraint(
            "(taken_by IS NULL) = (taken_at IS NULL)", name=op.f("ck_signals_taken_by_someone")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_signals")),
    )
    with op.batch_alter_table("signals", schema=None) as batch_op:
        batch_op.create_index(
            "ix_signals_untaken",
            ["conversation_id", "key"],
            unique=True,
            sqlite_where=sa.text("taken_at IS NULL"),
            postgresql_where=sa.text("taken_at IS NULL"),
        )
        batch_op.create_index(
            "ix_signals_idempotency",
            ["conversation_id", "idempotency_key"],
            unique=True,
            sqlite_where=sa.text("idempotency_key IS NOT NULL"),
            postgresql_where=sa.text("idempotency_key IS NOT NULL"),
        )
        batch_op.create_index("ix_signals_sent", ["sent_at"], unique=False)


def downgrade() -> None:
    op.drop_table("signals")
    op.drop_table("waits")
    op.execute("DELETE FROM controls WHERE action IN ('input', 'event')")
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_controls_action"), type_="check")
        batch_op.create_check_constraint("action", _ACTIONS_BEFORE)
    # A waiting child cannot be held by the schema before: it ends, as a restart ends a
    # child it cannot resume.
    op.execute(
        "UPDATE children SET state = 'done', error = 'child interrupted by downgrade',"
        " finished_at = updated_at WHERE state = 'waiting'"
    )
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_children_waking",
            sqlite_where=sa.text(_WAITING),
            postgresql_where=sa.text(_WAITING),
        )
        batch_op.drop_index("ix_children_one_active")
        _one_active(batch_op, _ACTIVE_BEFORE)
        batch_op.drop_constraint(op.f("ck_children_wait_counts_non_negative"), type_="check")
        batch_op.drop_constraint(op.f("ck_children_admitted_has_time"), type_="check")
        batch_op.create_check_constraint("admitted_has_time", _ADMITTED_BEFORE)
        batch_op.drop_constraint(op.f("ck_children_state"), type_="check")
        batch_op.create_check_constraint("state", f"state IN {_BEFORE}")
        batch_op.drop_column("inputs_open")
        batch_op.drop_column("wakes")
        batch_op.drop_column("wake_at")
