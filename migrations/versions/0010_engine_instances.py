"""engine instances: ``host_instances`` is renamed ``engine_instances``

The table holds the engine's own instances (one per host's life, design §12), whose ids
rows name in ``engine_instance_id``; ``host_instance_id`` is a runner's host. Only the
table's name changes: its rows stay, and the references to it follow the rename on
both dialects (PostgreSQL's by the table itself, SQLite's rewritten by its RENAME).
The constraints keep their names (renaming one on SQLite rebuilds its table).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.rename_table("host_instances", "engine_instances")


def downgrade() -> None:
    op.rename_table("engine_instances", "host_instances")
