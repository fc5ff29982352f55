"""a child keeps the trace context it was started in (OpenTelemetry, design §13)

``trace_context`` is the W3C ``traceparent`` of the ``child.start`` call that reserved
the child, so that every attempt to execute it, after a restart in another process
too, is a span of that same trace. NULL (every child before this revision, and every
child started without OpenTelemetry) means none: an attempt then starts a new trace.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.add_column(sa.Column("trace_context", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("children", schema=None) as batch_op:
        batch_op.drop_column("trace_context")
