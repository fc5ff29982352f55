"""a child's end is announced, whoever writes it (design §18), on PostgreSQL

A trigger sends ``NOTIFY delegation, '<child id>'`` whenever a child's state becomes
terminal (``done``, ``cancelled``), delivered when that transaction commits: a host's
finish, another host's takeover, a boot's reconciliation alike. A follower on another
host is woken by it (a cancel writes no event, so no batch of events announces it).
Nothing changes on SQLite, where every commit moves the file's ``data_version``.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-10 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The channel the hosts LISTEN to (delegation.store.postgres.admin.CHANNEL); the payload
# is what their watch reads as child ids.
_FUNCTION = """
CREATE FUNCTION delegation_child_ended() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('delegation', NEW.id::text);
    RETURN NULL;
END
$$
"""
# Row by row, but only for a row that ends (the WHEN is checked before any call): every
# other update of a child pays nothing.
_TRIGGER = """
CREATE TRIGGER children_ended AFTER UPDATE OF state ON children FOR EACH ROW
WHEN (NEW.state IN ('done', 'cancelled') AND OLD.state IS DISTINCT FROM NEW.state)
EXECUTE FUNCTION delegation_child_ended()
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_FUNCTION)
    op.execute(_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS children_ended ON children")
    op.execute("DROP FUNCTION IF EXISTS delegation_child_ended()")
