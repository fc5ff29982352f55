"""Use cases of the engine's own: boot reconciliation, lease expiry, retention (SPEC §7).

Each is one write transaction of set-based statements (:mod:`delegation.store.lifecycle`),
so boot stays fast with thousands of children. Like :mod:`delegation.service`, they take
``now`` and leave what follows a commit (stopping and resuming runs, re-arming timers)
to the engine.
"""

from __future__ import annotations

import json

from delegation import errors, service
from delegation.config import EngineConfig
from delegation.processes import ProcessId
from delegation.records import ChildRecord, Resumable
from delegation.store import Connection, children, controls, grants, lifecycle, processes, runners
from delegation.store.controls import ControlRecord

HOST_RESTARTED = "cancelled: host restarted"
ADMISSION_INTERRUPTED = "child admission interrupted by host restart"
INTERRUPTED = "child interrupted by host restart"
RECOVERY_TEXT = "resumed after host restart"
OPERATOR_CANCELLED = "cancelled by operator"


def orphans(conn: Connection) -> list[ProcessId]:
    """The processes recorded by runs of earlier host instances (SPEC §10)."""
    return processes.recorded(conn)


def pending_controls(conn: Connection) -> list[ControlRecord]:
    """Operators' control requests not applied yet (SPEC §11)."""
    return controls.pending(conn)


def control_applied(conn: Connection, control_id: int, outcome: str, now: float) -> None:
    controls.applied(conn, control_id, outcome, now)


def apply_cancel(conn: Connection, control: ControlRecord, now: float) -> ChildRecord | None:
    """An operator's cancel: request the cancellation durably and record the control
    applied, in one transaction (applied twice, it changes nothing). Returns the child
    (None when there is no such child), which is yet to be stopped if not terminal."""
    try:
        child = service.cancel_exact(
            conn, control.conversation_id, control.run_id, OPERATOR_CANCELLED, now
        )
    except errors.DelegationError as exc:
        failure = {"failure": str(exc), "failureReason": exc.reason}
        controls.applied(conn, control.id, json.dumps(failure), now)
        return None
    controls.applied(conn, control.id, json.dumps(_cancel_outcome(child)), now)
    return child


def _cancel_outcome(child: ChildRecord) -> dict[str, str]:
    state = child.state if child.terminal else "cancelling"
    return {"runId": child.run_id, "state": state, "error": child.error}


def expire_due(conn: Connection, now: float) -> tuple[list[int], float | None]:
    """Expire every lease past its deadline: cancel its children, remove the lease.

    A lease is live at exactly ``expires_at`` and expired one tick after. Returns the
    children whose cancellation was requested and the next deadline, if any.
    """
    return lifecycle.expire_due(conn, service.LEASE_EXPIRED, now)


def next_deadline(conn: Connection) -> float | None:
    return lifecycle.next_deadline(conn)


def purge(conn: Connection, retention_s: float, now: float, batch: int = 1000) -> int:
    """Delete up to ``batch`` finished children past retention (see the store's purge)."""
    return lifecycle.purge(conn, retention_s, now, batch)


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
    # Operators' cancels left while no host ran: requested now, so nothing they name
    # is resumed (a resumed command would run again from its start first).
    cancelled = [
        (control.id, child.id)
        for control in controls.pending(conn)
        if control.action == "cancel" and (child := apply_cancel(conn, control, now)) is not None
    ]
    # First the never-admitted: the restart, not what it ends below, interrupted them.
    # A cancellation requested before the restart still wins.
    lifecycle.end_unadmitted(conn, ADMISSION_INTERRUPTED, now)
    previous = runners.open_connections(conn)
    previous_tools = grants.tools_of_connections(conn, previous)
    stopping = service.close_tools(conn, previous_tools, now, HOST_RESTARTED)
    for connection_id in previous:
        runners.disconnect(conn, connection_id, now)
    lifecycle.close_other_instances(conn, instance_id, now)
    expired, _ = expire_due(conn, now)
    stopping += expired
    lifecycle.settle_for_resume(conn, cfg.max_recovery_attempts, INTERRUPTED, RECOVERY_TEXT, now)
    for control_id, child_id in cancelled:  # what the cancels came to
        if (child := children.get(conn, child_id)) is not None:
            controls.set_outcome(conn, control_id, json.dumps(_cancel_outcome(child)))
    return stopping, lifecycle.resumables(conn, instance_id, now)
