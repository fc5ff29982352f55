"""an operator's controls listed by child

design §33. ``delegation controls CHILD`` lists a conversation's control requests with
their outcomes, and a control given again with its request id is found rather than
recorded twice: both read ``controls`` by ``conversation_id`` through
``ix_controls_conversation`` (conversation, id), where only the pending ones were
indexed. No row changes.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 12:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.create_index("ix_controls_conversation", ["conversation_id", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("controls", schema=None) as batch_op:
        batch_op.drop_index("ix_controls_conversation")
