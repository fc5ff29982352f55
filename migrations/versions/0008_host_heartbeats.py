"""host heartbeats: several hosts on one PostgreSQL database (design §12)

A host instance writes ``heartbeat_at`` (the database's clock) every few seconds; one
whose heartbeat is too old is taken over by a live host, which records itself in
``taken_by`` so that exactly one host takes each dead instance's work.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 00:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

TIME = sa.REAL().with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("host_instances", schema=None) as batch_op:
        batch_op.add_column(sa.Column("heartbeat_at", TIME, nullable=True))
        batch_op.add_column(sa.Column("taken_by", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("host_instances", schema=None) as batch_op:
        batch_op.drop_column("taken_by")
        batch_op.drop_column("heartbeat_at")
