"""Use cases of the engine's own: boot reconciliation, lease expiry, retention (SPEC §7).

Each is one write transaction of set-based SQL, so boot stays fast with thousands of
children. Like :mod:`delegation.service`, they take ``now`` and leave what follows a
commit (stopping and resuming runs, re-arming timers) to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from sqlalchemy import Connection, text

from delegation import service
from delegation.config import EngineConfig
from delegation.options import ExecutionOptions
from delegation.processes import ProcessId
from delegation.records import ChildRecord
from delegation.store import children, controls, grants, processes, runners
from delegation.store.children import ACTIVE, ACTIVE_TERM
from delegation.store.controls import ControlRecord

HOST_RESTARTED = "cancelled: host restarted"
ADMISSION_INTERRUPTED = "child admission interrupted by host restart"
INTERRUPTED = "child interrupted by host restart"
RECOVERY_TEXT = "resumed after host restart"

_policy = msgspec.json.Decoder(ExecutionOptions)
_DUE = "kind = 'lease' AND revoked_at IS NULL AND expires_at < :now"
_LIVE_LEASE_CHILDREN = (
    "SELECT c.id FROM children c JOIN grants g ON g.id = c.grant_id"
    " WHERE g.kind = 'lease' AND g.revoked_at IS NULL AND g.expires_at >= :now"
)


@dataclass(frozen=True, slots=True)
class Resumable:
    """A child of a live lease to run again: its recovery event is committed and it is
    ``running`` under the new host instance; ``steers`` were queued and not delivered."""

    child: ChildRecord
    attempt: int
    last_sequence: int
    steers: tuple[tuple[int, str], ...] = ()
    policy: ExecutionOptions | None = None  # its grant's: the ceiling of its options
    delivered: tuple[str, ...] = ()  # steers handed to earlier attempts, oldest first


def orphans(conn: Connection) -> list[ProcessId]:
    """The processes recorded by runs of earlier host instances (SPEC §10)."""
    return processes.recorded(conn)


def pending_controls(conn: Connection) -> list[ControlRecord]:
    """Operators' control requests not applied yet (SPEC §11)."""
    return controls.pending(conn)


def control_applied(conn: Connection, control_id: int, outcome: str, now: float) -> None:
    controls.applied(conn, control_id, outcome, now)


def expire_due(conn: Connection, now: float) -> tuple[list[int], float | None]:
    """Expire every lease past its deadline: cancel its children, remove the lease.

    A lease is live at exactly ``expires_at`` and expired one tick after. Returns the
    children whose cancellation was requested and the next deadline, if any.
    """
    under_due = f"grant_id IN (SELECT id FROM grants WHERE {_DUE})"
    affected = children.active_ids(conn, text(under_due).bindparams(now=now))
    if affected:
        conn.execute(
            text(
                "UPDATE children SET cancel_requested_at = :now, cancel_reason = :reason,"
                " updated_at = :now WHERE state IN ('prepared', 'admitted', 'running')"
                f" AND cancel_requested_at IS NULL AND {under_due}"
            ),
            {"now": now, "reason": service.LEASE_EXPIRED},
        )
    conn.execute(text(f"DELETE FROM grants WHERE {_DUE}"), {"now": now})
    return affected, next_deadline(conn)


def next_deadline(conn: Connection) -> float | None:
    value = conn.execute(
        text("SELECT MIN(expires_at) FROM grants WHERE kind = 'lease' AND revoked_at IS NULL")
    ).scalar()
    return None if value is None else float(value)


def reconcile(
    conn: Connection, cfg: EngineConfig, instance_id: str, now: float
) -> tuple[list[int], list[Resumable]]:
    """Boot: take over from every previous host instance (SPEC §7).

    Records the new instance; ends the previous connections and tool grants (their
    foreground children are cancelled); expires overdue leases; ends children never
    admitted; finishes children whose cancellation was requested; suspends running
    children; and for every admitted child of a live lease, within the attempt
    limit, commits a ``recovery`` event and returns it for resuming.
    Returns (children to stop, children to resume).
    """
    service.boot(conn, instance_id, now)
    processes.forget_all(conn)  # killed by the engine before this boot (see orphans)
    # First the never-admitted: the restart, not what it ends below, interrupted them.
    # A cancellation requested before the restart still wins.
    for statement in (
        f"UPDATE {ACTIVE} SET state = 'cancelled', error = cancel_reason, finished_at = :now,"
        f" updated_at = :now WHERE {ACTIVE_TERM} AND state = 'prepared'"
        " AND cancel_requested_at IS NOT NULL",
        f"UPDATE {ACTIVE} SET state = 'done', error = :error, finished_at = :now,"
        f" updated_at = :now WHERE {ACTIVE_TERM} AND state = 'prepared'",
    ):
        conn.execute(text(statement), {"now": now, "error": ADMISSION_INTERRUPTED})
    previous = runners.open_connections(conn)
    previous_tools = grants.tools_of_connections(conn, previous)
    stopping = service.close_tools(conn, previous_tools, now, HOST_RESTARTED)
    for connection_id in previous:
        runners.disconnect(conn, connection_id, now)
    conn.execute(
        text("UPDATE host_instances SET closed_at = :now WHERE closed_at IS NULL AND id != :me"),
        {"now": now, "me": instance_id},
    )
    expired, _ = expire_due(conn, now)
    stopping += expired
    statements = (
        # Asked to cancel, and nothing runs them any more.
        f"UPDATE {ACTIVE} SET state = 'cancelled', error = cancel_reason, finished_at = :now,"
        f" updated_at = :now WHERE {ACTIVE_TERM} AND state IN ('admitted', 'running')"
        " AND cancel_requested_at IS NOT NULL",
        # Their host instance is gone.
        f"UPDATE {ACTIVE} SET state = 'admitted', updated_at = :now"
        f" WHERE {ACTIVE_TERM} AND state = 'running'",
        # Not under a live lease, or resumed too often: interrupted for good.
        f"UPDATE {ACTIVE} SET state = 'done', error = :interrupted, finished_at = :now,"
        f" updated_at = :now WHERE {ACTIVE_TERM} AND state = 'admitted'"
        f" AND (id NOT IN ({_LIVE_LEASE_CHILDREN}) OR recovery_attempts >= :max)",
        f"UPDATE {ACTIVE} SET recovery_attempts = recovery_attempts + 1"
        f" WHERE {ACTIVE_TERM} AND state = 'admitted'",
        "INSERT INTO events (child_id, sequence, body)"
        " SELECT id, seq, CAST(json_object('sequence', seq, 'kind', 'recovery',"
        " 'text', :recovery_text || ' (attempt ' || recovery_attempts || ')') AS BLOB)"
        " FROM (SELECT id, recovery_attempts, COALESCE((SELECT MAX(sequence) FROM events e"
        f" WHERE e.child_id = children.id), 0) + 1 AS seq FROM {ACTIVE}"
        f" WHERE {ACTIVE_TERM} AND state = 'admitted')",
    )
    values = {
        "now": now,
        "max": cfg.max_recovery_attempts,
        "interrupted": INTERRUPTED,
        "recovery_text": RECOVERY_TEXT,
    }
    for statement in statements:
        conn.execute(text(statement), {k: v for k, v in values.items() if f":{k}" in statement})
    return stopping, _resumables(conn, instance_id, now)


def _resumables(conn: Connection, instance_id: str, now: float) -> list[Resumable]:
    """Every admitted child left, set running under this instance in one statement."""
    rows = conn.execute(
        text(
            "SELECT id, recovery_attempts, (SELECT MAX(sequence) FROM events e"
            f" WHERE e.child_id = children.id) AS last FROM {ACTIVE}"
            f" WHERE {ACTIVE_TERM} AND state = 'admitted' ORDER BY id"
        )
    ).all()
    found = {child.id: child for child in children.by_state(conn, "admitted")}
    queued: dict[int, list[tuple[int, str]]] = {}
    delivered: dict[int, list[str]] = {}
    for child_id, steer_id, message, handed in conn.execute(
        text(
            "SELECT s.child_id, s.id, s.message, s.delivered_at IS NOT NULL FROM steers s"
            f" WHERE s.child_id IN (SELECT id FROM {ACTIVE}"
            f" WHERE {ACTIVE_TERM} AND state = 'admitted')"
            " AND s.outcome = 'injected' ORDER BY s.id"
        )
    ):
        if handed:
            delivered.setdefault(child_id, []).append(message)
        else:
            queued.setdefault(child_id, []).append((steer_id, message))
    policies = {
        child_id: _policy.decode(raw)
        for child_id, raw in conn.execute(
            text(
                "SELECT c.id, g.policy FROM grants g JOIN"
                f" (SELECT id, grant_id FROM {ACTIVE} WHERE {ACTIVE_TERM} AND state = 'admitted')"
                " c ON g.id = c.grant_id WHERE g.policy IS NOT NULL"
            )
        )
    }
    conn.execute(
        text(
            f"UPDATE {ACTIVE} SET state = 'running', engine_instance_id = :me,"
            f" updated_at = :now WHERE {ACTIVE_TERM} AND state = 'admitted'"
        ),
        {"me": instance_id, "now": now},
    )
    return [
        Resumable(
            found[row.id],
            row.recovery_attempts,
            int(row.last),
            tuple(queued.get(row.id, ())),
            policies.get(row.id),
            tuple(delivered.get(row.id, ())),
        )
        for row in rows
    ]


def purge(conn: Connection, retention_s: float, now: float, batch: int = 1000) -> int:
    """Delete up to ``batch`` finished children older than the retention period, with
    their events and steers, and the tombstones, grants and connections nothing needs.

    Purged children are remembered (ids only) for one more period. Returns how many
    children were purged; call again while it returns ``batch``.
    """
    p = {"cutoff": now - retention_s, "now": now, "batch": batch}
    # Only a finished child has finished_at (CHECK finished_iff_terminal). Naming the
    # states too made SQLite pick the state index and sort every finished child, each
    # batch: quadratic in a large purge. This walks ix_children_finished in order.
    chosen = "SELECT id FROM children WHERE finished_at < :cutoff ORDER BY finished_at LIMIT :batch"
    conn.execute(
        text(
            "INSERT OR REPLACE INTO purged (run_id, conversation_id, grant_id, lease_id, purged_at)"
            f" SELECT run_id, conversation_id, grant_id, lease_id, :now FROM children"
            f" WHERE id IN ({chosen})"
        ),
        p,
    )
    count = conn.execute(text(f"DELETE FROM children WHERE id IN ({chosen})"), p).rowcount
    for statement in (
        "DELETE FROM purged WHERE purged_at < :cutoff",
        "DELETE FROM grants WHERE ((kind = 'lease' AND revoked_at < :cutoff)"
        " OR (kind = 'tool' AND closed_at < :cutoff))"
        " AND NOT EXISTS (SELECT 1 FROM children c WHERE c.grant_id = grants.id)",
        "DELETE FROM connections WHERE closed_at < :cutoff"
        " AND NOT EXISTS (SELECT 1 FROM grants g WHERE g.connection_id = connections.id)",
        "DELETE FROM host_instances AS h WHERE closed_at < :cutoff"
        " AND NOT EXISTS (SELECT 1 FROM connections c WHERE c.engine_instance_id = h.id)"
        " AND NOT EXISTS (SELECT 1 FROM grants g WHERE g.engine_instance_id = h.id)"
        " AND NOT EXISTS (SELECT 1 FROM children c WHERE c.engine_instance_id = h.id)",
    ):
        conn.execute(text(statement), {"cutoff": p["cutoff"]})
    return int(count)
