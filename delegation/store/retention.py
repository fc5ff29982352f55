"""Retention (design §9): finished children past their retention period go, with what
nothing needs any more once they are gone; the purged are remembered, by id, one more
period."""

from __future__ import annotations

from sqlalchemy import Connection

from delegation.store.lifecycle import PURGE_LOCK, first_to, q


def purge(conn: Connection, retention_s: float, now: float, batch: int = 1000) -> int:
    """Delete up to ``batch`` finished children older than the retention period, with
    their events and steers, and the tombstones, grants and connections nothing needs.

    Purged children are remembered (ids only) for one more period. Returns how many
    children were purged; call again while it returns ``batch``.
    """
    if not first_to(conn, PURGE_LOCK):
        return 0  # another host purges right now; the next sweep finds what is left
    p = {"cutoff": now - retention_s, "now": now, "batch": batch}
    # Only a finished child has finished_at (CHECK finished_iff_terminal). Naming the
    # states too made SQLite pick the state index and sort every finished child, each
    # batch: quadratic in a large purge. This walks ix_children_finished in order.
    chosen = "SELECT id FROM children WHERE finished_at < :cutoff ORDER BY finished_at LIMIT :batch"
    conn.execute(
        q(
            conn,
            "INSERT INTO purged (run_id, conversation_id, grant_id, lease_id, purged_at)"
            " SELECT run_id, conversation_id, grant_id, lease_id, :now FROM children"
            f" WHERE id IN ({chosen}) ON CONFLICT (run_id) DO UPDATE SET"
            " conversation_id = excluded.conversation_id, grant_id = excluded.grant_id,"
            " lease_id = excluded.lease_id, purged_at = excluded.purged_at",
        ),
        p,
    )
    count = conn.execute(q(conn, f"DELETE FROM children WHERE id IN ({chosen})"), p).rowcount
    for statement in (
        "DELETE FROM purged WHERE purged_at < :cutoff",
        "DELETE FROM grants WHERE ((kind = 'lease' AND revoked_at < :cutoff)"
        " OR (kind = 'tool' AND closed_at < :cutoff))"
        " AND NOT EXISTS (SELECT 1 FROM children c WHERE c.grant_id = grants.id)",
        "DELETE FROM connections WHERE closed_at < :cutoff"
        " AND NOT EXISTS (SELECT 1 FROM grants g WHERE g.connection_id = connections.id)",
        "DELETE FROM engine_instances AS h WHERE closed_at < :cutoff"
        " AND NOT EXISTS (SELECT 1 FROM connections c WHERE c.engine_instance_id = h.id)"
        " AND NOT EXISTS (SELECT 1 FROM grants g WHERE g.engine_instance_id = h.id)"
        " AND NOT EXISTS (SELECT 1 FROM children c WHERE c.engine_instance_id = h.id)",
        # Events sent to a conversation (design §21): taken, or nothing left to take them.
        "DELETE FROM signals WHERE sent_at < :cutoff AND (taken_at IS NOT NULL OR NOT EXISTS"
        " (SELECT 1 FROM children c WHERE c.conversation_id = signals.conversation_id"
        " AND c.finished_at IS NULL))",
    ):
        conn.execute(q(conn, statement), {"cutoff": p["cutoff"]})
    return int(count)
