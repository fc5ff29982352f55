"""a child knows which code ran it: runner versions, pins and patches

design §34. ``children`` records the runner version that prepared each execution
(``version``) and the one of its newest attempt (``attempt_version``); a child a host of
another version would not run under the policy ``pin`` keeps ``pinned_version`` (a host
of that version takes it; ``delegation unpin`` sets ``unpinned_at`` and lets the current
code resume it), found through ``ix_children_pinned``. ``engine_instances`` records each
host instance's ``runner_version``. ``steps`` records the version that recorded each
step and the newest attempt that asked for it (``asked_attempt``): ``show`` lists the
steps the newest attempt never asked for. ``controls`` takes the action ``unpin``. Every
column is NULL for what came before (unversioned: today's behaviour).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 12:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

TIME = sa.REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_ACTIONS = "action IN ('cancel', 'steer', 'input', 'event')"
_NEW_ACTIONS = "action IN ('cancel', 'steer', 'input', 'event', 'unpin')"


def upgrade() -> None:
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.add_column(sa.Column("version", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("attempt_version", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("pinned_version", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("unpinned_at", TIME, nullable=True))
    op.create_index(
        "ix_children_pinned",
        "children",
        ["pinned_version"],
        unique=False,
        sqlite_where=sa.text("pinned_version IS NOT NULL"),
        postgresql_where=sa.text("pinned_version IS NOT NULL"),
    )
    with op.batch_alter_table("engine_instances", schema=None) as batch_op:
        batch_op.add_column(sa.Column("runner_version", sa.Text(), nullable=True))
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("version", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("asked_attempt", sa.Integer(), nullable=True))
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_controls_action"), type_="check")
        batch_op.create_check_constraint("action", _NEW_ACTIONS)


def downgrade() -> None:
    op.execute("DELETE FROM controls WHERE action = 'unpin'")
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_controls_action"), type_="check")
        batch_op.create_check_constraint("action", _OLD_ACTIONS)
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.drop_column("asked_attempt")
        batch_op.drop_column("version")
    with op.batch_alter_table("engine_instances", schema=None) as batch_op:
        batch_op.drop_column("runner_version")
    op.drop_index(
        "ix_children_pinned",
        table_name="children",
        sqlite_where=sa.text("pinned_version IS NOT NULL"),
        postgresql_where=sa.text("pinned_version IS NOT NULL"),
    )
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_column("unpinned_at")
        batch_op.drop_column("pinned_version")
        batch_op.drop_column("attempt_version")
        batch_op.drop_column("version")
