"""Use cases: each function is one write (or read) transaction over the store.

They run inside the store's writer thread (or a reader), take ``now`` as an
argument, check authority first and raise before writing anything, so a refused
call has no effect (the store rolls back the job's savepoint). What must happen
after commit (cancelling tasks, waking waiters) is left to the engine, which acts
on what these functions return.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from delegation import authority, errors
from delegation._struct import I64_MAX, blank
from delegation.config import EngineConfig
from delegation.machine import State, Trigger
from delegation.options import ExecutionOptions
from delegation.protocol import ToolBegin
from delegation.records import ChildRecord, GrantRecord, RunnerConnection, RunnerRecord
from delegation.store import children, controls, grants, processes, steers
from delegation.store import registrations as runners
from delegation.store.sql import Connection
from delegation.wire import (
    STEER_INJECTED,
    STEER_NO_RUNNING_TURN,
    STEER_PROMPT_REQUIRED,
    Identity,
    Params,
    SteerResult,
    valid_id,
)

# Why a child was cancelled: the error it ends with.
CANCEL_REQUESTED = "cancelled: cancel requested"
LEASE_RELEASED = "cancelled: lease released"
LEASE_EXPIRED = "cancelled: lease expired"
TOOL_ENDED = "cancelled: tool call ended"
ORIGIN_TOOL_ENDED = "cancelled: originating tool ended before admission"
PARENT_FAILED = "cancelled: parent run failed"
RUNNER_RESTARTED = "cancelled: runner restarted"
RUNNER_RECONNECTED = "cancelled: runner reconnected"
RUNNER_DISCONNECTED = "cancelled: runner disconnected"
RUN_FAILED = "cancelled: run failed"
HOST_CANCELLED = "cancelled by host"
NOT_ADMITTED = "child run ended before admission"


def identity_of(child: ChildRecord) -> Identity:
    return Identity(**child.identity_fields())


# --- authority over stored records ----------------------------------------------------


def authorized(
    conn: Connection,
    runner: RunnerRecord | None,
    tool: GrantRecord | None,
    rconn: RunnerConnection,
    params: Params,
    now: float,
    *,
    steer: bool,
) -> GrantRecord:
    """design §3.1-3.3: the current connection, then the selected grant, owned by the
    caller (``runner`` and ``tool`` as read for the call)."""
    authority.check_connection(runner, rconn)
    lease = grants.get_lease(conn, rconn.runner_id, params.lease_id)
    grant = authority.select_grant(tool, lease, params)
    return authority.require_owner(grant, rconn, params, now, steer=steer)


def locate_child(
    conn: Connection, rconn: RunnerConnection, params: Params, now: float, *, steer: bool = False
) -> ChildRecord:
    """Authorize the call and find the one child its handle names (design §3.7).

    The runner, the tool grant and the conversation's executions are read in one
    statement; the checks then run in the order of :func:`authorized`.
    """
    authority.check_ids(params)
    runner, tool, executions = grants.runner_tool_and_executions(
        conn, rconn.runner_id, params.run_id, params.tool_call_id, params.child_id
    )
    grant = authorized(conn, runner, tool, rconn, params, now, steer=steer)
    found = [child for child in executions if child.grant_id == grant.id]
    if not found and children.was_purged(conn, grant.id, params.child_id, params.child_run_id):
        raise errors.ChildPurged()
    return authority.locate(found, params.child_id, params.child_run_id)


# --- the run's own transitions ----------------------------------------------------------


_ADMISSION = (Trigger.ADMIT, Trigger.RUN)
_SLOTTED = (Trigger.RUN,)  # admitted by its policy's turn already (design §22)


@dataclass(frozen=True, slots=True)
class Admission:
    """What a run's admission needs to know of its child: whether its policy's turn
    admitted it already (``slotted``: it holds its slots, ``admitted``), and what its
    deadline counts from its first admission (design §22)."""

    slotted: bool = False
    deadline_s: float | None = None
    depth: int = 1
    parent_run_id: str = ""
    # Some policy exists: the child counts in its scopes' slots however it is admitted
    # (``queued_at`` set), so a policy set since its start still sees it.
    counted: bool = False


_PLAIN = Admission()


def _running(conn: Connection, now: float, instance_id: str, how: Admission) -> dict[str, object]:
    if how.slotted:  # admitted (and its deadline set) when it took its slots
        return {"engine_instance_id": instance_id}
    fields: dict[str, object] = {"admitted_at": now, "engine_instance_id": instance_id}
    if how.counted:
        fields["queued_at"] = now
    if how.deadline_s is not None or how.depth > 1:
        own = None if how.deadline_s is None else now + how.deadline_s
        parent = children.deadline_of_run(conn, how.parent_run_id) if how.depth > 1 else None
        found = [d for d in (own, parent) if d is not None]
        if found:
            fields["deadline_at"] = min(found)
    return fields


def admit(
    conn: Connection,
    now: float,
    child_id: int,
    instance_id: str,
    lease_pending: bool,
    how: Admission = _PLAIN,
) -> ChildRecord:
    """prepared → admitted → running in one guarded UPDATE (a ``slotted`` child:
    admitted → running), after re-checking cancellation and the origin tool; returns
    the child's record.

    ``lease_pending`` says the child's lease had admitted no one when it was reserved,
    so this may be the lease's first admission and its authorizing tool must be live.

    Raises:
        errors.AdmissionFailed: cancellation was requested first (the run must stop).
        errors.LeaseNotActivated: a first admission under a lease whose tool has ended.
    """
    if not lease_pending:
        admitted = try_admit(conn, now, child_id, instance_id, how)
        if admitted is not None:
            return admitted
    child = children.get(conn, child_id)
    if child is None:
        raise errors.ChildPurged()
    if child.state in (State.DONE.value, State.CANCELLED.value):
        raise errors.AdmissionFailed(child.error or child.cancel_reason)
    before = State.ADMITTED.value if how.slotted else State.PREPARED.value
    if child.state != before:
        return child  # admitted already: admit() is a no-op then
    if child.cancel_requested_at is not None:
        raise errors.AdmissionFailed(child.cancel_reason)
    lease = grants.get(conn, child.grant_id) if child.lease_id and child.grant_id else None
    if lease is not None and lease.activated_at is None:
        # A first admission under a lease needs the tool that authorized this start.
        origin = grants.get(conn, child.origin_grant_id) if child.origin_grant_id else None
        if origin is None or origin.closed_at is not None or lease.revoked_at is not None:
            raise errors.LeaseNotActivated()
        grants.activate(conn, lease.id, now)
    triggers = _SLOTTED if how.slotted else _ADMISSION
    admitted = children.advance(
        conn, child_id, triggers, now, _running(conn, now, instance_id, how)
    )
    if admitted is None:  # read in this very transaction: never expected
        raise errors.IllegalTransition(f"child state transition admit is not allowed ({child_id})")
    return admitted


def try_admit(
    conn: Connection, now: float, child_id: int, instance_id: str, how: Admission = _PLAIN
) -> ChildRecord | None:
    """The usual admission, one guarded UPDATE: a prepared child no one asked to cancel
    becomes running. None: it did not match and nothing was written (:func:`admit`
    then learns why). Not for a child whose lease may still need activating."""
    triggers = _SLOTTED if how.slotted else _ADMISSION
    running = _running(conn, now, instance_id, how)
    return children.advance(conn, child_id, triggers, now, running, unless_cancelled=True)


End = tuple[int, str, bool]  # a run's end: its child's id, its error, whether it was tracked


def finish(
    conn: Connection, now: float, ends: Sequence[End]
) -> dict[int, ChildRecord | errors.DelegationError]:
    """End runs: each ``cancelled`` if its cancellation was requested, else ``done``; a
    process it recorded (``tracked``) is forgotten, since the run reaped it.

    Set-based (:func:`children.finish`): the runs that end together (a lease expiry of
    thousands) are a few statements. Gives each child its terminal record, or the
    error its end alone would have raised (purged meanwhile; a state neither trigger
    leaves), so that one child's refusal never holds back the others' ends. A child
    ended already is left as it is: this finish committed once, its answer was lost
    with the connection, and it is tried again (design §19); nothing more to record.
    """
    processes.forget(conn, [child_id for child_id, _, tracked in ends if tracked])
    found: dict[int, ChildRecord | errors.DelegationError] = {}
    found.update(children.finish(conn, [(i, error) for i, error, _ in ends], now, NOT_ADMITTED))
    missing = [child_id for child_id, _, _ in ends if child_id not in found]
    present = {child.id: child for child in children.of_ids(conn, missing)} if missing else {}
    for child_id in missing:
        child = present.get(child_id)
        if child is None:
            found[child_id] = errors.ChildPurged()
        elif child.state in (State.DONE.value, State.CANCELLED.value):
            found[child_id] = child
        else:
            found[child_id] = errors.IllegalTransition(
                f"child state transition finish is not allowed from {child.state}"
            )
    return found


def stop_unowned(
    conn: Connection, now: float, instance_id: str, child_ids: Sequence[int]
) -> tuple[list[int], int]:
    """Finish cancelled children that no local task is running (nothing left to stop),
    unless another live host runs them (several hosts on one database): that host is
    asked to stop them with a control request. Returns the children asked of others,
    and how many children were finished here.

    Set-based: a lease expiry of thousands across hosts reads, asks and ends them in a
    few statements, where one child was three round trips."""
    found = [
        child
        for child in children.of_ids(conn, sorted(set(child_ids)))
        if not child.terminal and child.cancel_requested_at is not None
    ]
    # Nothing runs a waiting child (design §21) nor a queued one (§22) anywhere.
    idle = (State.WAITING.value, State.QUEUED.value)
    owners = {
        c.engine_instance_id
        for c in found
        if c.engine_instance_id not in (None, instance_id) and c.state not in idle
    }
    live = runners.live_instances(conn, [o for o in owners if o is not None]) if owners else set()
    elsewhere = [c for c in found if c.engine_instance_id in live and c.state not in idle]
    controls.submit_cancels(conn, [(c.conversation_id, c.run_id) for c in elsewhere], now)
    asked = {c.id for c in elsewhere}
    here = [(c.id, "") for c in found if c.id not in asked]  # stopped: cancel's reason
    stopped = children.finish(conn, here, now, NOT_ADMITTED) if here else {}
    return [c.id for c in elsewhere], len(stopped)


# --- child.cancel, child.steer, child.lease.release ------------------------------------


def cancel(conn: Connection, now: float, rconn: RunnerConnection, params: Params) -> ChildRecord:
    child = locate_child(conn, rconn, params, now)
    children.request_cancel(conn, [child.id], now, CANCEL_REQUESTED)
    updated = children.get(conn, child.id)
    assert updated is not None
    return updated


@dataclass(frozen=True, slots=True)
class SteerOutcome:
    result: SteerResult
    child_id: int
    queued: tuple[int, str] | None  # (steer id, message) when newly queued


def steer(
    conn: Connection, now: float, cfg: EngineConfig, rconn: RunnerConnection, params: Params
) -> SteerOutcome:
    """Record a steer receipt, idempotently, and queue it for a running child."""
    child = locate_child(conn, rconn, params, now, steer=True)
    return _record_steer(conn, cfg, child, params.request_id, params.message, now)


def steer_exact(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    conversation_id: str,
    run_id: str | None,
    request_id: str,
    message: str,
) -> SteerOutcome:
    """The host's own steer of one execution, whatever its grant (an operator's):
    idempotent per requestId like ``child.steer``."""
    return _record_steer(conn, cfg, exact(conn, conversation_id, run_id), request_id, message, now)


def _record_steer(
    conn: Connection,
    cfg: EngineConfig,
    child: ChildRecord,
    request_id: str,
    message: str,
    now: float,
) -> SteerOutcome:
    if not valid_id(request_id) or blank(message) or len(message) > cfg.max_steer_chars:
        raise errors.BadSteer()
    stored = steers.receipt(conn, child.id, request_id)
    if stored is not None:
        if stored[0] != message:
            raise errors.SteerRequestIdReused()
        return SteerOutcome(SteerResult(outcome=stored[1], reason=stored[2]), child.id, None)
    if steers.count(conn, child.id) >= cfg.max_steers_per_child:
        raise errors.SteerLimit()
    live = child.state in (State.ADMITTED.value, State.RUNNING.value)
    if live:
        result = SteerResult(outcome=STEER_INJECTED)
    else:
        result = SteerResult(outcome=STEER_PROMPT_REQUIRED, reason=STEER_NO_RUNNING_TURN)
    steer_id = steers.insert_receipt(
        conn, child.id, request_id, message, result.outcome, result.reason, now
    )
    if live:
        controls.wake(conn)  # the host running the child may be another (design §12)
    return SteerOutcome(result, child.id, (steer_id, message) if live else None)


def release(
    conn: Connection, now: float, cfg: EngineConfig, rconn: RunnerConnection, params: Params
) -> list[int]:
    """Revoke a lease (a durable tombstone) and request cancellation of its children.

    Returns the unfinished children under the lease. Releasing an unknown lease
    leaves a tombstone too, so a later start with that leaseId is fenced (the newest
    ``max_tombstones_per_extension`` tombstones of each extension of a runner are kept).
    """
    authority.check_connection(runners.get_runner(conn, rconn.runner_id), rconn)
    lease = grants.get_lease(conn, rconn.runner_id, params.lease_id)
    authority.check_release_owner(lease, params)
    if lease is None:
        # Tombstones are outside the lease capacity and trimmed to the newest few of the
        # extension, so releases of unknown leases can neither lock the runner out nor
        # grow the file without bound, nor drop another extension's tombstones.
        grants.insert_tombstone(
            conn, rconn.runner_id, params.lease_id, params.extension_id, params.generation, now
        )
        owner = (rconn.runner_id, params.extension_id)
        grants.trim_tombstones(conn, [owner], cfg.max_tombstones_per_extension)
        return []
    return _revoke(conn, cfg, [lease.id], now, "released", LEASE_RELEASED)


# --- lifecycle of connections, tools and runs --------------------------------------------


@dataclass(frozen=True, slots=True)
class Connected:
    """What ``connect`` did: the new connection, the children whose cancellation it
    requested, and, for a runner back as another host instance, the one it was and the
    leases that revoked."""

    handle: RunnerConnection
    affected: list[int]
    was: str | None = None  # the host instance it was, when it came back as another
    revoked: int = 0


def connect(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    instance_id: str,
    runner_id: str,
    host_instance_id: str,
) -> Connected:
    """Register a runner connection (see :class:`Connected`).

    The previous connection's tool grants end. A different ``host_instance_id`` means
    the runner's extension processes are gone: its leases are revoked too.
    """
    if not valid_id(runner_id) or not valid_id(host_instance_id):
        raise errors.InputError("runner registration requires a valid runnerId and hostInstanceId")
    handle, previous = runners.register(conn, runner_id, host_instance_id, instance_id, now)
    affected: list[int] = []
    if previous is not None:
        if previous.connection_id is not None:
            tools = grants.tools_of_connections(conn, [previous.connection_id])
            affected += close_tools(conn, tools, now, RUNNER_RECONNECTED)
        if previous.host_instance_id != host_instance_id:
            leases = grants.leases_of_runner(conn, runner_id)
            affected += _revoke(conn, cfg, leases, now, "runner restarted", RUNNER_RESTARTED)
            return Connected(handle, affected, previous.host_instance_id, len(leases))
    return Connected(handle, affected)


def disconnect(conn: Connection, now: float, rconn: RunnerConnection) -> list[int]:
    affected = close_tools(
        conn, grants.tools_of_connections(conn, [rconn.id]), now, RUNNER_DISCONNECTED
    )
    runners.disconnect(conn, rconn.id, now)
    return affected


def open_tool(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    instance_id: str,
    rconn: RunnerConnection,
    begin: ToolBegin,
) -> GrantRecord:
    """Open the tool grant of one extension tool call (``begin``, as ``tool.begin``
    carries it); its ``policy`` is the parent run's effective options, the ceiling of
    every child started under it (unset: none). Its reads are one statement, its one
    write the grant's ``INSERT``."""
    run_id, tool_call_id, extension_id = begin.run_id, begin.tool_call_id, begin.extension_id
    presets, workspace = begin.presets, begin.workspace
    policy = None if begin.policy is msgspec.UNSET else begin.policy
    runner, live, parent_depth = grants.runner_tool_and_depth(
        conn, rconn.runner_id, run_id, tool_call_id
    )
    authority.check_connection(runner, rconn)
    if not all(valid_id(v) for v in (run_id, begin.conversation_id, tool_call_id, extension_id)):
        raise errors.InputError(
            "tool call requires valid runId, conversationId, toolCallId and extensionId"
        )
    if len(presets) > cfg.max_presets_per_extension:
        raise errors.PresetLimit()
    if policy is not None:
        if not isinstance(policy, ExecutionOptions):
            raise errors.InvalidOptions("tool policy must be ExecutionOptions")
        policy.validate(cfg.providers)
    for preset in presets:
        preset.validate(cfg.providers)
        if preset.extension_id != extension_id or preset.generation == 0:
            raise errors.PresetStale(
                "execution preset must belong to the tool's extension with a non-zero generation"
            )
        if preset.generation > I64_MAX:  # a wire uint64, but SQLite stores int64
            raise errors.PresetStale("execution preset generation is above 2^63-1")
    if not os.path.isabs(workspace) or not os.path.isdir(workspace):
        raise errors.InvalidCwd("tool workspace must be an existing absolute directory")
    if live is not None:
        raise errors.ToolAlreadyOpen()
    return grants.insert_tool(
        conn,
        runner_id=rconn.runner_id,
        connection_id=rconn.id,
        engine_instance_id=instance_id,
        run_id=run_id,
        conversation_id=begin.conversation_id,
        tool_call_id=tool_call_id,
        extension_id=extension_id,
        workspace=os.path.realpath(workspace),
        presets=presets,
        depth=parent_depth + 1,
        now=now,
        policy=policy,
    )


def close_tool(conn: Connection, now: float, grant_id: str) -> list[int]:
    return close_tools(conn, [grant_id], now, TOOL_ENDED)


@dataclass(frozen=True, slots=True)
class RunEnded:
    """What ``finish_run`` did: the children whose cancellation it requested, and the
    child whose own run this was (cancelled on failure), if any."""

    affected: list[int]
    own_child: int | None = None


def finish_run(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    run_id: str,
    succeeded: bool,
    rconn: RunnerConnection | None,
) -> RunEnded:
    """A run ended: its tools end; on failure its leases are dropped as well, and if it
    is a child's own run, that child is cancelled (the Go original's ``CancelChildTurn``).

    Given ``rconn`` (a runner over serve), only that runner's grants, leases and
    children are touched, and the call must come on its current connection.
    """
    authority.require_ids(run_id=run_id)
    runner_id: str | None = None
    if rconn is not None:
        authority.check_connection(runners.get_runner(conn, rconn.runner_id), rconn)
        runner_id = rconn.runner_id
    affected = close_tools(conn, grants.tools_of_run(conn, run_id, runner_id), now, TOOL_ENDED)
    if succeeded:
        return RunEnded(affected)
    leases = grants.leases_of_run(conn, run_id, runner_id)
    affected += _revoke(conn, cfg, leases, now, "parent run failed", PARENT_FAILED)
    child = children.by_run(conn, run_id)
    if child is None or child.terminal or runner_id not in (None, child.runner_id):
        return RunEnded(affected)
    affected += children.request_cancel(conn, [child.id], now, RUN_FAILED)
    return RunEnded(affected, child.id)


def exact(conn: Connection, conversation_id: str, run_id: str | None) -> ChildRecord:
    """One execution by its ids, for the host's own calls (no grant involved)."""
    authority.require_ids(conversation_id=conversation_id, **({"run_id": run_id} if run_id else {}))
    child = children.find(conn, conversation_id, run_id)
    if child is None:
        if children.was_purged(conn, None, conversation_id, run_id):
            raise errors.ChildPurged()
        raise errors.ChildNotFound(f"child not found: {conversation_id}")
    return child


def cancel_exact(
    conn: Connection, now: float, conversation_id: str, run_id: str | None, reason: str
) -> ChildRecord:
    """The host's own cancel of one execution, whatever its grant (design §9): the newest
    execution of the conversation, or the one ``run_id`` names. A finished child is
    returned unchanged.

    Raises:
        errors.InvalidId: an id is not a valid ID.
        errors.ChildPurged, errors.ChildNotFound: there is no such child (any more).
    """
    child = exact(conn, conversation_id, run_id)
    if not child.terminal:
        children.request_cancel(conn, [child.id], now, reason)
        child = children.get(conn, child.id) or child
    return child


def close_tools(conn: Connection, tool_ids: Sequence[str], now: float, reason: str) -> list[int]:
    """End tool grants: cancel their foreground children, and the children they
    authorized under a lease that has not admitted anyone yet."""
    closed = grants.close_tools(conn, tool_ids, now)
    if not closed:
        return []
    foreground = children.active_of_grants(conn, closed)
    affected = children.request_cancel(conn, foreground, now, reason)
    pending = children.pending_first_admissions(conn, closed)
    return affected + children.request_cancel(conn, pending, now, ORIGIN_TOOL_ENDED)


def _revoke(
    conn: Connection,
    cfg: EngineConfig,
    lease_ids: Sequence[str],
    now: float,
    why: str,
    reason: str,
) -> list[int]:
    """Revoke leases (they become tombstones) and request cancellation of their children."""
    grants.revoke_leases(conn, lease_ids, now, why)
    affected = children.request_cancel(
        conn, children.active_of_grants(conn, lease_ids), now, reason
    )
    owners = grants.owners_of(conn, lease_ids)
    grants.trim_tombstones(conn, owners, cfg.max_tombstones_per_extension)
    return affected


# --- the host instance ----------------------------------------------------------------

HOST_CLOSED = "cancelled: host closed"


def boot(conn: Connection, instance_id: str, now: float, version: str | None = None) -> None:
    """Record this engine's host instance, and the runner version it runs."""
    runners.insert_instance(conn, instance_id, now, version)


def shutdown(conn: Connection, now: float, instance_id: str) -> list[int]:
    """Graceful close: this instance's connections and tool grants end (their tools are
    gone, so their foreground children are cancelled); leases and leased children stay."""
    connections = runners.open_connections(conn, instance_id)
    tools = grants.tools_of_connections(conn, connections)
    affected = close_tools(conn, tools, now, HOST_CLOSED)
    for connection_id in connections:
        runners.disconnect(conn, connection_id, now)
    return affected


def close_instance(conn: Connection, now: float, instance_id: str) -> None:
    runners.close_instance(conn, instance_id, now)
