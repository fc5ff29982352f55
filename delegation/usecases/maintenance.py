"""Use cases of the engine's own: boot reconciliation, lease expiry, retention (design §7).

Each is one write transaction of set-based statements (:mod:`delegation.store.lifecycle`),
so boot stays fast with thousands of children. Like :mod:`delegation.usecases.service`, they take
``now`` and leave what follows a commit (stopping and resuming runs, re-arming timers)
to the engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from delegation import errors
from delegation.config import EngineConfig
from delegation.machine import Outcome
from delegation.os_processes import ProcessId
from delegation.records import ChildRecord, Resumable
from delegation.store import children, controls, grants, lifecycle, retention, steers
from delegation.store import registrations as runners
from delegation.store.controls import ControlRecord
from delegation.store.failures import undone_if_busy, waits_briefly
from delegation.store.sql import Connection
from delegation.usecases import service, stored, versions

log = logging.getLogger("delegation.engine")

HOST_RESTARTED = "cancelled: host restarted"
ADMISSION_INTERRUPTED = "child admission interrupted by host restart"
INTERRUPTED = "child interrupted by host restart"
RECOVERY_TEXT = "resumed after host restart"
UNREADABLE = errors.ChildUnreadable.default_message()
OPERATOR_CANCELLED = "cancelled by operator"


def pending_controls(conn: Connection, instance_id: str) -> list[ControlRecord]:
    """Control requests not applied yet that this host applies (design §11): for its own
    children, and for those no live host runs (another live host applies its own).

    Set-based: the requests' children and their hosts' liveness in a few statements,
    however many are pending (a lease expiry across hosts leaves thousands)."""
    pending = controls.pending(conn)
    if not pending:
        return []
    found = children.find_many(conn, [(c.conversation_id, c.run_id) for c in pending])

    def owner(control: ControlRecord) -> str | None:
        child = found.get((control.conversation_id, control.run_id))
        return None if child is None or child.terminal else child.engine_instance_id

    owners = {control.id: owner(control) for control in pending}
    others = {o for o in owners.values() if o is not None and o != instance_id}
    live = runners.live_instances(conn, others) if others else set()
    return [c for c in pending if owners[c.id] in (None, instance_id) or owners[c.id] not in live]


def undelivered_steers(conn: Connection, child_ids: list[int]) -> list[tuple[int, int, str]]:
    """Steers accepted (by any host) for these children and not handed to their runs
    yet: (child id, steer id, message), oldest first."""
    return steers.undelivered(conn, child_ids)


def control_applied(conn: Connection, now: float, control_id: int, outcome: str) -> None:
    controls.applied(conn, control_id, outcome, now)


def apply_cancel(conn: Connection, now: float, control: ControlRecord) -> ChildRecord | None:
    """An operator's cancel: request the cancellation durably and record the control
    applied, in one transaction (applied twice, it changes nothing). Returns the child
    (None when there is no such child), which is yet to be stopped if not terminal."""
    try:
        child = service.cancel_exact(
            conn, now, control.conversation_id, control.run_id, OPERATOR_CANCELLED
        )
    except errors.DelegationError as exc:
        failure = {"failure": str(exc), "failureReason": exc.reason}
        controls.applied(conn, control.id, json.dumps(failure), now)
        return None
    controls.applied(conn, control.id, json.dumps(_cancel_outcome(child)), now)
    return child


def apply_cancels(
    conn: Connection, now: float, pending: Sequence[ControlRecord]
) -> list[ChildRecord]:
    """:func:`apply_cancel` of many operators' cancels, in one transaction, set-based for
    the children found (a request whose child is not found, or whose ids are not valid,
    is applied alone and records its failure). Returns the children yet to be stopped."""
    found = children.find_many(conn, [(c.conversation_id, c.run_id) for c in pending])
    of: dict[int, ChildRecord] = {}
    for control in pending:
        child = found.get((control.conversation_id, control.run_id))
        if child is None:
            apply_cancel(conn, now, control)  # its failure, recorded as one cancel's is
        else:
            of[control.id] = child
    unfinished = {child.id for child in of.values() if not child.terminal}
    children.request_cancel(conn, unfinished, now, OPERATOR_CANCELLED)
    now_of = {child.id: child for child in children.of_ids(conn, sorted(unfinished))}
    outcomes = [
        (control_id, json.dumps(_cancel_outcome(now_of.get(child.id, child))))
        for control_id, child in of.items()
    ]
    controls.applied_many(conn, outcomes, now)
    return [child for child in now_of.values() if not child.terminal]


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


def purge(conn: Connection, now: float, retention_s: float, batch: int = 1000) -> int:
    """Delete up to ``batch`` finished children past retention (see the store's purge)."""
    return retention.purge(conn, retention_s, now, batch)


@dataclass(frozen=True, slots=True)
class Takeover:
    """What a takeover committed, for the engine to act on after the commit: kill the
    lost runs' processes, stop the children it cancelled, then resume the rest."""

    taken: list[str]  # the host instances taken over
    stopping: list[int]
    resumable: list[Resumable]
    processes: list[ProcessId]
    server_now: float = 0.0  # the database's time of the heartbeat (0: none taken)
    ended: Mapping[Outcome, int] = dataclasses.field(default_factory=dict)  # what it ended
    # The run ids of the children it ended because what they stored no longer decodes.
    unreadable: list[str] = dataclasses.field(default_factory=list)
    deferred: bool = False  # a heartbeat's takeover met a held row: the next beat tries
    # The run ids of the children it ended: another runner version ran them (§34).
    refused: list[str] = dataclasses.field(default_factory=list)


NOTHING = Takeover([], [], [], [])


def reconcile(
    conn: Connection, now: float, cfg: EngineConfig, instance_id: str, shared: bool
) -> Takeover:
    """Boot: record this host instance and take over from the previous ones (design §7):
    from every other one on SQLite (one host per file), and from the dead or closed
    ones only on a database several hosts share (design §12)."""
    service.boot(conn, instance_id, now, cfg.runner_version)
    lifecycle.heartbeat(conn, instance_id)
    return take_over(conn, cfg, instance_id, now, everyone=not shared, reason="restart")


def rejoin(conn: Connection, now: float, instance_id: str, version: str | None = None) -> None:
    """A fenced host goes on as a new instance (``Membership.fenced``)."""
    service.boot(conn, instance_id, now, version)
    lifecycle.heartbeat(conn, instance_id)


def heartbeat(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    instance_id: str,
    take: bool,
    reconnected: Callable[[], bool],
) -> Takeover:
    """A live host's heartbeat on a shared database, and the takeover of whatever host
    instance has died meanwhile (none, most of the time).

    Raises:
        errors.HostFenced: another host took this instance over (it was thought dead).
    """
    server_now = lifecycle.heartbeat(conn, instance_id)
    if server_now is None:
        raise errors.HostFenced(f"host instance {instance_id} was taken over by another host")
    if not take:  # a closing host only beats
        return dataclasses.replace(NOTHING, server_now=server_now)
    # A takeover that meets a row another transaction holds (a paused host's batch, a
    # deadlock with another host's bulk update) waits for the next beat; the beat
    # commits anyway, or a live host would miss beat after beat and cut itself off.
    # Committed on the loop's thread (a lock waited for only briefly) the beat goes
    # to the writer instead, which waits the whole busy timeout first.
    try:
        with undone_if_busy(conn):
            takeover = take_over(
                conn, cfg, instance_id, now, everyone=False, locks=not reconnected()
            )
    except errors.DatabaseBusy as exc:
        if waits_briefly():
            raise
        log.info("takeover left to the next heartbeat: %s", exc, extra={"action": "takeover_busy"})
        return dataclasses.replace(NOTHING, server_now=server_now, deferred=True)
    return dataclasses.replace(takeover, server_now=server_now)


def hand_over(
    conn: Connection, now: float, cfg: EngineConfig, old: str, instance_id: str
) -> Takeover:
    """A host back from a cut (``Membership.back_from_cut``) closes the instance it was and,
    in the same transaction, takes it over as the one it is now: its connections and
    tool calls end, and its leased children are resumed here."""
    service.close_instance(conn, now, old)
    return take_over(conn, cfg, instance_id, now, everyone=False)


def server_time(conn: Connection) -> float:
    return lifecycle.server_time(conn)


def take_over(
    conn: Connection,
    cfg: EngineConfig,
    instance_id: str,
    now: float,
    *,
    everyone: bool,
    locks: bool = True,
    reason: str = "takeover",
) -> Takeover:
    """Take over the work of dead host instances, as a boot does for one host.

    Marks the instances (exactly one host takes each); ends their connections and tool
    grants (their foreground children are cancelled); expires overdue leases; ends their
    children never admitted; finishes those whose cancellation was requested; suspends
    their running children; ends those whose stored record no longer decodes; and for
    every other admitted child of a live lease, within the attempt limit, commits a
    ``recovery`` event and sets it running under this instance, as the host's version
    policy judges it (design §34; ``reason``: ``restart`` at a boot, else ``takeover``).
    """
    if not everyone and not lifecycle.first_to(conn, lifecycle.TAKEOVER_LOCK):
        return NOTHING  # another host is taking over right now; the next beat looks again
    taken = lifecycle.take_instances(
        conn,
        instance_id,
        now,
        cfg.host_timeout_s,
        everyone=everyone,
        locks=locks,
        suspect_s=2 * cfg.host_heartbeat_s,
    )
    # SQLite (everyone): the boot's write transaction already excludes every writer.
    lost_any = not everyone and lifecycle.lock_lost(conn, instance_id)
    previous = runners.open_connections_of_taken(conn)
    if not taken and not everyone and not lost_any and not previous:
        return NOTHING
    lost = [ProcessId(*p) for p in lifecycle.lost_processes(conn, instance_id)]
    lifecycle.forget_lost_processes(conn, instance_id)  # the engine kills them next
    # Operators' cancels left for these children: requested now, so nothing they name
    # is resumed (a resumed command would run again from its start first).
    cancelled = [
        (control.id, child.id)
        for control in controls.pending(conn)
        if control.action == "cancel"
        and _lost(conn, control, instance_id)
        and (child := apply_cancel(conn, now, control)) is not None
    ]
    # First the never-admitted: the restart, not what it ends below, interrupted them.
    # A cancellation requested before the restart still wins.
    ended = Counter(lifecycle.end_unadmitted(conn, instance_id, ADMISSION_INTERRUPTED, now))
    previous_tools = grants.tools_of_connections(conn, previous)
    stopping = service.close_tools(conn, previous_tools, now, HOST_RESTARTED)
    for connection_id in previous:
        runners.disconnect(conn, connection_id, now)
    expired, _ = expire_due(conn, now)
    stopping += expired
    ended.update(
        lifecycle.settle_for_resume(conn, instance_id, cfg.max_recovery_attempts, INTERRUPTED, now)
    )
    # A child whose stored record no longer decodes cannot run again: it ends here, and
    # the rest resume (design §18).
    unreadable = [row for row in lifecycle.stored_to_resume(conn, instance_id) if _unreadable(row)]
    if unreadable:
        ids = [row.id for row in unreadable]
        ended[Outcome.FAILED] += lifecycle.end_lost(conn, instance_id, ids, UNREADABLE, now)
    host = versions.HostVersion.of(cfg)
    notes, refused = _judge_versions(conn, now, instance_id, host)
    ended[Outcome.FAILED] += len(refused)
    lifecycle.begin_resume(conn, instance_id, RECOVERY_TEXT, notes)
    for control_id, child_id in cancelled:  # what the cancels came to
        if (child := children.get(conn, child_id)) is not None:
            controls.set_outcome(conn, control_id, json.dumps(_cancel_outcome(child)))
    resumable = [
        dataclasses.replace(item, reason=reason)
        for item in lifecycle.resumables(conn, instance_id, now)
    ]
    versions.attempted(conn, [item.child.id for item in resumable], host)
    unread = [row.run_id for row in unreadable]
    return Takeover(
        taken, stopping, resumable, lost, ended=dict(ended), unreadable=unread, refused=refused
    )


def _judge_versions(
    conn: Connection, now: float, instance_id: str, host: versions.HostVersion
) -> tuple[dict[int, str], list[str]]:
    """The host's version policy on the children left to resume (design §34): those
    refused end, those pinned wait; the rest resume. Returns the notes of the recovery
    events of those whose version changed, and the run ids of those refused."""
    if host.version is None:  # unversioned: every child resumes, as before versions
        return {}, []
    notes: dict[int, str] = {}
    refused: list[str] = []
    for child in children.of_ids(conn, lifecycle.to_resume(conn, instance_id)):
        match versions.verdict(child, host):
            case versions.Verdict.REFUSE:
                error = versions.refusal(child, host)
                lifecycle.end_lost(conn, instance_id, [child.id], error, now)
                refused.append(child.run_id)
            case versions.Verdict.PIN:
                if versions.pin(conn, now, child, instance_id):
                    controls.wake(conn)  # a host of its version takes it
            case _:
                if note := versions.note(child, host):
                    notes[child.id] = note
    return notes, refused


def _unreadable(row: lifecycle.Stored) -> bool:
    try:
        stored.for_run(row.request, row.preset, row.options, row.policy)
    except errors.ChildUnreadable:
        return True
    return False


def _lost(conn: Connection, control: ControlRecord, me: str) -> bool:
    """Whether the child a control request names is among what a takeover acts on."""
    child = children.find(conn, control.conversation_id, control.run_id)
    if child is None or child.terminal:
        return False
    owner = child.engine_instance_id
    return owner is None or (owner != me and not runners.instance_is_live(conn, owner))
