"""Use cases: each function is one write (or read) transaction over the store.

They run inside the store's writer thread (or a reader), take ``now`` as an
argument, check authority first and raise before writing anything, so a refused
call has no effect (the store rolls back the job's savepoint). What must happen
after commit (cancelling tasks, waking waiters) is left to the engine, which acts
on what these functions return.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from msgspec import UNSET

from delegation import authority, errors
from delegation._struct import I64_MAX, blank
from delegation.codec import encode
from delegation.config import EngineConfig
from delegation.machine import State, Trigger
from delegation.options import ExecutionOptions, effective_options
from delegation.records import ChildRecord, GrantRecord, RunnerConnection, RunnerRecord
from delegation.store import Connection, children, controls, grants, processes, steers
from delegation.store import registrations as runners
from delegation.wire import (
    STEER_INJECTED,
    STEER_NO_RUNNING_TURN,
    STEER_PROMPT_REQUIRED,
    Identity,
    Params,
    Preset,
    Request,
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


@dataclass(frozen=True, slots=True)
class StartPlan:
    """What ``reserve_start`` decided: a new reservation, or a replay of an old one."""

    child: ChildRecord
    replay: bool
    request: Request
    preset: Preset
    identity: Identity
    new_lease_deadline: float | None = None
    lease_pending: bool = False  # under a lease that has admitted no one yet


def identity_of(child: ChildRecord) -> Identity:
    return Identity(**child.identity_fields())


# --- authority over stored records ----------------------------------------------------


def authorize(
    conn: Connection, rconn: RunnerConnection, params: Params, now: float, *, steer: bool = False
) -> tuple[GrantRecord, GrantRecord | None]:
    """SPEC §3.1-3.3: the current connection, then the selected grant, owned by the caller.

    Returns the selected grant and the live tool grant of the call (if any).
    """
    authority.check_ids(params)
    runner, tool = grants.runner_and_tool(conn, rconn.runner_id, params.run_id, params.tool_call_id)
    return _authorized(conn, runner, tool, rconn, params, now, steer=steer), tool


def _authorized(
    conn: Connection,
    runner: RunnerRecord | None,
    tool: GrantRecord | None,
    rconn: RunnerConnection,
    params: Params,
    now: float,
    *,
    steer: bool,
) -> GrantRecord:
    authority.check_connection(runner, rconn)
    lease = grants.get_lease(conn, rconn.runner_id, params.lease_id)
    grant = authority.select_grant(tool, lease, params)
    return authority.require_owner(grant, rconn, params, now, steer=steer)


def locate_child(
    conn: Connection, rconn: RunnerConnection, params: Params, now: float, *, steer: bool = False
) -> ChildRecord:
    """Authorize the call and find the one child its handle names (SPEC §3.7).

    The runner, the tool grant and the conversation's executions are read in one
    statement; the checks then run in the same order as :func:`authorize`.
    """
    authority.check_ids(params)
    runner, tool, executions = grants.runner_tool_and_executions(
        conn, rconn.runner_id, params.run_id, params.tool_call_id, params.child_id
    )
    grant = _authorized(conn, runner, tool, rconn, params, now, steer=steer)
    found = [child for child in executions if child.grant_id == grant.id]
    if not found and children.was_purged(conn, grant.id, params.child_id, params.child_run_id):
        raise errors.ChildPurged()
    return authority.locate(found, params.child_id, params.child_run_id)


# --- child.start ----------------------------------------------------------------------


class SeenTools:
    """The tool grants this host's starts lately found open, by runner and tool call:
    a later start under one of them reads nothing first (see :func:`reserve_start`).

    Bounded in number (the oldest goes first) and in age: an entry read more than
    ``max_age_s`` ago is read again, so a row version it compares is that recent (a
    transaction id, part of one, recurs only after 2**32 transactions of the server).
    Shared by the loop's thread and the writer's.
    """

    def __init__(self, size: int = 1024, max_age_s: float = 60.0) -> None:
        self._size = size
        self._max_age_s = max_age_s
        self._seen: dict[tuple[str, str, str], tuple[float, grants.SeenTool]] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, str]) -> grants.SeenTool | None:
        entry = self._seen.get(key)
        if entry is None or time.monotonic() - entry[0] > self._max_age_s:
            return None
        return entry[1]

    def put(self, key: tuple[str, str, str], seen: grants.SeenTool) -> None:
        with self._lock:
            self._seen.pop(key, None)
            self._seen[key] = (time.monotonic(), seen)
            while len(self._seen) > self._size:
                del self._seen[next(iter(self._seen))]

    def drop(self, key: tuple[str, str, str]) -> None:
        with self._lock:
            self._seen.pop(key, None)


def reserve_start(
    conn: Connection,
    cfg: EngineConfig,
    rconn: RunnerConnection,
    params: Params,
    instance_id: str,
    now: float,
    *,
    trace_context: str | None = None,
    seen: SeenTools | None = None,
) -> StartPlan:
    """Check a start in the order of SPEC §5 and reserve the child as ``prepared``,
    owned by the host instance ``instance_id`` (which runs it). ``trace_context`` (the
    start's W3C traceparent, when traced) is kept with the child for its executions.

    With ``seen`` (a store where a statement costs a round trip), a start under a tool
    grant an earlier start found open is checked against the runner and grant as then
    read, and reserved by one statement that inserts only if both rows are still
    exactly so (and the requestId is new, and the grant under its cap): then every
    check had the outcome it has on the rows now. Otherwise, or if a check refuses on
    the rows as seen, the start reads them again and is checked as if none was seen.

    Raises the first refusal that applies; nothing is written then.
    """
    authority.check_ids(params)
    request = params.request if params.request is not UNSET else Request()
    key = (rconn.runner_id, params.run_id, params.tool_call_id)
    last = seen.get(key) if seen is not None and not (params.lease_id or request.resume) else None
    args = (conn, cfg, rconn, params, request, instance_id, now, trace_context)
    if seen is not None and last is not None:
        try:
            plan = _reserve(*args, last)
        except errors.DelegationError:
            plan = None  # refused on the rows as seen: decided on the rows as they are
        if plan is not None:
            return plan
        seen.drop(key)
    plan = _reserve(*args, None, seen)
    assert plan is not None  # only a start on the rows as seen finds them changed
    return plan


def _reserve(
    conn: Connection,
    cfg: EngineConfig,
    rconn: RunnerConnection,
    params: Params,
    request: Request,
    instance_id: str,
    now: float,
    trace_context: str | None,
    last: grants.SeenTool | None,
    seen: SeenTools | None = None,
) -> StartPlan | None:
    """:func:`reserve_start` on the rows read now, or (``last``) on the rows as last seen:
    None then if they changed, or the requestId is taken, or the grant is full."""
    known: grants.StartReads | None = None
    runner: RunnerRecord | None
    tool: GrantRecord | None
    if last is not None:
        runner, tool = last.runner, last.tool
    elif params.lease_id:  # the grant may be the lease: read it, then under it
        runner, tool = grants.runner_and_tool(
            conn, rconn.runner_id, params.run_id, params.tool_call_id
        )
    else:  # the grant is the call's tool grant: one statement reads all a start needs
        known = grants.runner_tool_and_request(
            conn, rconn.runner_id, params.run_id, params.tool_call_id, request.request_id
        )
        runner, tool = known.runner, known.tool
    grant = _authorized(conn, runner, tool, rconn, params, now, steer=False)
    request.validate(cfg.providers)
    preset = authority.find_preset(grant, request.profile, params.generation)
    effective = effective_options(grant.policy, preset, request)
    if request.lease_id != params.lease_id:
        raise errors.LeaseMismatch()
    executions = _owned_executions(conn, grant, rconn, request) if request.resume else []
    saved_cwd = executions[-1].cwd if executions else None
    cwd = authority.resolve_cwd(grant.workspace or "", request.cwd, saved_cwd)
    wire_request = encode(request)
    run_request = with_options(request, effective)
    if last is None:
        tool_grant = tool is not None and grant.id == tool.id
        if known is not None and tool_grant:
            existing, count = known.existing, known.count
            if seen is not None and known.seen is not None and not request.resume:
                seen.put((rconn.runner_id, params.run_id, params.tool_call_id), known.seen)
        else:
            existing, count = children.by_request_and_count(conn, grant.id, request.request_id)
        if existing is not None:
            if existing.request != wire_request or existing.cwd != cwd:
                raise errors.RequestIdReused()
            return StartPlan(existing, True, run_request, preset, identity_of(existing))
    tool_owned = tool is not None and authority.owns(tool, rconn, params, now)
    if params.lease_id and grant.activated_at is None and not tool_owned:
        raise errors.LeaseNotActivated()
    if request.context_mode == "fork" and not tool_owned:
        raise errors.ForkRequiresTool()
    if any(not e.terminal for e in executions):
        raise errors.ActiveSubmission()
    new_lease: float | None = None
    if params.lease_id and not grant.is_lease:
        if grants.count_leases(conn, rconn.runner_id) >= cfg.max_leases_per_runner:
            raise errors.LeaseCapacity()
        grant = grants.insert_lease(conn, grant, params.lease_id, now, cfg.lease_lifetime_s)
        new_lease, count = grant.expires_at, 0  # a new grant: no child yet
    if last is None and count >= cfg.max_children_per_grant:
        raise errors.SubmissionLimit()
    if grant.depth > cfg.max_depth:
        raise errors.NestingLimit()
    values = {
        "conversation_id": request.resume or f"c-{secrets.token_hex(16)}",
        "run_id": f"r-{secrets.token_hex(16)}",
        "grant_id": grant.id,
        "lease_id": grant.lease_id,
        "request_id": request.request_id,
        "runner_id": rconn.runner_id,
        "runner_host_instance_id": rconn.host_instance_id,  # current: checked above
        "parent_conversation_id": grant.conversation_id,
        "parent_run_id": grant.run_id,
        "extension_id": grant.extension_id,
        "profile": request.profile,
        "generation": params.generation,
        "request": wire_request,
        "preset": encode(preset),
        "cwd": cwd,
        "depth": grant.depth,
        "followup": 1 if request.resume else 0,
        "origin_grant_id": tool.id if tool is not None and tool_owned else None,
        "engine_instance_id": instance_id,
        "created_at": now,
        "trace_context": trace_context,
    }
    child = (
        children.insert_child(conn, **values)
        if last is None
        else grants.insert_child_as_seen(conn, last, cfg.max_children_per_grant, **values)
    )
    if child is None:
        return None  # the rows as seen changed, or the requestId or the cap: nothing written
    pending = grant.is_lease and grant.activated_at is None
    return StartPlan(child, False, run_request, preset, identity_of(child), new_lease, pending)


def with_options(request: Request, effective: ExecutionOptions) -> Request:
    """The request a run is prepared with: the stored one, with the effective options
    (the request is stored as sent; ``prepare`` sees what the child may do)."""
    current = request.options if request.options is not UNSET else ExecutionOptions()
    if current == effective:
        return request
    return msgspec.structs.replace(request, options=effective)


def plan_of(child: ChildRecord, policy: ExecutionOptions | None = None) -> StartPlan:
    """The plan to run a stored child again (after a restart), under its grant's policy.

    The stored request and preset were validated (and their options checked against
    the policy) when the child was reserved; they are read back without validating.
    """
    request = _stored_request.decode(child.request)
    preset = _stored_preset.decode(child.preset)
    effective = effective_options(policy, preset, request)
    return StartPlan(child, True, with_options(request, effective), preset, identity_of(child))


_stored_request = msgspec.json.Decoder(Request)
_stored_preset = msgspec.json.Decoder(Preset)


def _owned_executions(
    conn: Connection, grant: GrantRecord, rconn: RunnerConnection, request: Request
) -> list[ChildRecord]:
    """The executions of the conversation a resume names, if the caller may resume it:
    started by the same parent conversation, extension, runner and preset (SPEC §3.6)."""
    executions = children.executions(conn, request.resume)
    same_owner = bool(executions) and all(
        e.parent_conversation_id == grant.conversation_id
        and e.extension_id == grant.extension_id
        and e.runner_id == rconn.runner_id
        and e.profile == request.profile
        for e in executions
    )
    if not same_owner:
        raise errors.ResumeMismatch()
    return executions


# --- the run's own transitions ----------------------------------------------------------


_ADMISSION = (Trigger.ADMIT, Trigger.RUN)


def admit(
    conn: Connection, child_id: int, instance_id: str, lease_pending: bool, now: float
) -> ChildRecord:
    """prepared → admitted → running in one guarded UPDATE, after re-checking
    cancellation and the origin tool; returns the child's record.

    ``lease_pending`` says the child's lease had admitted no one when it was reserved,
    so this may be the lease's first admission and its authorizing tool must be live.

    Raises:
        errors.AdmissionFailed: cancellation was requested first (the run must stop).
        errors.LeaseNotActivated: a first admission under a lease whose tool has ended.
    """
    if not lease_pending:
        admitted = try_admit(conn, child_id, instance_id, now)
        if admitted is not None:
            return admitted
    child = children.get(conn, child_id)
    if child is None:
        raise errors.ChildPurged()
    if child.state in (State.DONE.value, State.CANCELLED.value):
        raise errors.AdmissionFailed(child.error or child.cancel_reason)
    if child.state != State.PREPARED.value:
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
    running = {"admitted_at": now, "engine_instance_id": instance_id}
    admitted = children.advance(conn, child_id, _ADMISSION, now, running)
    if admitted is None:  # prepared, read in this very transaction: never expected
        raise errors.IllegalTransition(f"child state transition admit is not allowed ({child_id})")
    return admitted


def try_admit(conn: Connection, child_id: int, instance_id: str, now: float) -> ChildRecord | None:
    """The usual admission, one guarded UPDATE: a prepared child no one asked to cancel
    becomes running. None: it did not match and nothing was written (:func:`admit`
    then learns why). Not for a child whose lease may still need activating."""
    running = {"admitted_at": now, "engine_instance_id": instance_id}
    return children.advance(conn, child_id, _ADMISSION, now, running, unless_cancelled=True)


def finish(conn: Connection, child_id: int, error: str, tracked: bool, now: float) -> ChildRecord:
    """End a run: ``cancelled`` if cancellation was requested, else ``done``; a process
    it recorded (``tracked``) is forgotten, since the run reaped it. A child ended
    already is left as it is (the finish is retried until it commits)."""
    if tracked:
        processes.forget(conn, child_id)
    children.lock(conn, child_id)  # a cancel from another host waits, or is seen here
    child = children.get(conn, child_id)
    if child is None:
        raise errors.ChildPurged()
    if child.state in (State.DONE.value, State.CANCELLED.value):
        # Ended already: this finish committed once and its answer was lost with the
        # connection, and it is tried again (SPEC §19); nothing more to record.
        return child
    if child.cancel_requested_at is not None:
        children.transition(conn, child_id, Trigger.STOP, now, error=child.cancel_reason or "")
    else:
        if child.admitted_at is None and not error:
            error = NOT_ADMITTED
        children.transition(conn, child_id, Trigger.FINISH, now, error=error)
    ended = children.get(conn, child_id)
    assert ended is not None
    return ended


def stop_unowned(
    conn: Connection, instance_id: str, child_ids: Sequence[int], now: float
) -> tuple[list[int], int]:
    """Finish cancelled children that no local task is running (nothing left to stop),
    unless another live host runs them (several hosts on one database): that host is
    asked to stop them with a control request. Returns the children asked of others,
    and how many children were finished here."""
    elsewhere: list[int] = []
    stopped = 0
    for child_id in child_ids:
        child = children.get(conn, child_id)
        if child is None or child.terminal or child.cancel_requested_at is None:
            continue
        owner = child.engine_instance_id
        if owner not in (None, instance_id) and runners.instance_is_live(conn, owner):
            controls.submit(
                conn, child.conversation_id, child.run_id, "cancel", "", "", now, notify=True
            )
            elsewhere.append(child_id)
            continue
        children.transition(conn, child_id, Trigger.STOP, now, error=child.cancel_reason or "")
        stopped += 1
    return elsewhere, stopped


# --- child.cancel, child.steer, child.lease.release ------------------------------------


def cancel(conn: Connection, rconn: RunnerConnection, params: Params, now: float) -> ChildRecord:
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
    conn: Connection, cfg: EngineConfig, rconn: RunnerConnection, params: Params, now: float
) -> SteerOutcome:
    """Record a steer receipt, idempotently, and queue it for a running child."""
    child = locate_child(conn, rconn, params, now, steer=True)
    return _record_steer(conn, cfg, child, params.request_id, params.message, now)


def steer_exact(
    conn: Connection,
    cfg: EngineConfig,
    conversation_id: str,
    run_id: str | None,
    request_id: str,
    message: str,
    now: float,
) -> SteerOutcome:
    """The host's own steer of one execution, whatever its grant (an operator's):
    idempotent per requestId like ``child.steer``."""
    return _record_steer(conn, cfg, _exact(conn, conversation_id, run_id), request_id, message, now)


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
        controls.wake(conn)  # the host running the child may be another (SPEC §12)
    return SteerOutcome(result, child.id, (steer_id, message) if live else None)


def release(
    conn: Connection, cfg: EngineConfig, rconn: RunnerConnection, params: Params, now: float
) -> list[int]:
    """Revoke a lease (a durable tombstone) and request cancellation of its children.

    Returns the unfinished children under the lease. Releasing an unknown lease
    leaves a tombstone too, so a later start with that leaseId is fenced (the newest
    ``max_tombstones_per_runner`` tombstones of a runner are kept).
    """
    authority.check_connection(runners.get_runner(conn, rconn.runner_id), rconn)
    lease = grants.get_lease(conn, rconn.runner_id, params.lease_id)
    authority.check_release_owner(lease, params)
    if lease is None:
        # Tombstones are outside the lease capacity and trimmed to the newest few, so
        # releases of unknown leases can neither lock the runner out nor grow the file.
        grants.insert_tombstone(
            conn, rconn.runner_id, params.lease_id, params.extension_id, params.generation, now
        )
        grants.trim_tombstones(conn, [rconn.runner_id], cfg.max_tombstones_per_runner)
        return []
    return _revoke(conn, cfg, [lease.id], now, "released", LEASE_RELEASED)


# --- lifecycle of connections, tools and runs --------------------------------------------


def connect(
    conn: Connection,
    cfg: EngineConfig,
    instance_id: str,
    runner_id: str,
    host_instance_id: str,
    now: float,
) -> tuple[RunnerConnection, list[int]]:
    """Register a runner connection; returns it and the children whose cancellation it requested.

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
    return handle, affected


def disconnect(conn: Connection, rconn: RunnerConnection, now: float) -> list[int]:
    affected = close_tools(
        conn, grants.tools_of_connections(conn, [rconn.id]), now, RUNNER_DISCONNECTED
    )
    runners.disconnect(conn, rconn.id, now)
    return affected


def open_tool(
    conn: Connection,
    cfg: EngineConfig,
    instance_id: str,
    rconn: RunnerConnection,
    *,
    run_id: str,
    conversation_id: str,
    tool_call_id: str,
    extension_id: str,
    presets: Sequence[Preset],
    workspace: str,
    now: float,
    policy: ExecutionOptions | None = None,
) -> GrantRecord:
    """Open the tool grant of one extension tool call; ``policy`` is the parent run's
    effective options, the ceiling of every child started under it (None: none).
    Its reads are one statement, its one write the grant's ``INSERT``."""
    runner, live, parent_depth = grants.runner_tool_and_depth(
        conn, rconn.runner_id, run_id, tool_call_id
    )
    authority.check_connection(runner, rconn)
    if not all(valid_id(v) for v in (run_id, conversation_id, tool_call_id, extension_id)):
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
        conversation_id=conversation_id,
        tool_call_id=tool_call_id,
        extension_id=extension_id,
        workspace=os.path.realpath(workspace),
        presets=presets,
        depth=parent_depth + 1,
        now=now,
        policy=policy,
    )


def close_tool(conn: Connection, grant_id: str, now: float) -> list[int]:
    return close_tools(conn, [grant_id], now, TOOL_ENDED)


@dataclass(frozen=True, slots=True)
class RunEnded:
    """What ``finish_run`` did: the children whose cancellation it requested, and the
    child whose own run this was (cancelled on failure), if any."""

    affected: list[int]
    own_child: int | None = None


def finish_run(
    conn: Connection,
    cfg: EngineConfig,
    run_id: str,
    succeeded: bool,
    rconn: RunnerConnection | None,
    now: float,
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


def _exact(conn: Connection, conversation_id: str, run_id: str | None) -> ChildRecord:
    """One execution by its ids, for the host's own calls (no grant involved)."""
    authority.require_ids(conversation_id=conversation_id, **({"run_id": run_id} if run_id else {}))
    child = children.find(conn, conversation_id, run_id)
    if child is None:
        if children.was_purged(conn, None, conversation_id, run_id):
            raise errors.ChildPurged()
        raise errors.ChildNotFound(f"child not found: {conversation_id}")
    return child


def cancel_exact(
    conn: Connection, conversation_id: str, run_id: str | None, reason: str, now: float
) -> ChildRecord:
    """The host's own cancel of one execution, whatever its grant (SPEC §9): the newest
    execution of the conversation, or the one ``run_id`` names. A finished child is
    returned unchanged.

    Raises:
        errors.InvalidId: an id is not a valid ID.
        errors.ChildPurged, errors.ChildNotFound: there is no such child (any more).
    """
    child = _exact(conn, conversation_id, run_id)
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
    grants.trim_tombstones(conn, grants.runners_of(conn, lease_ids), cfg.max_tombstones_per_runner)
    return affected


# --- the host instance ----------------------------------------------------------------

HOST_CLOSED = "cancelled: host closed"


def boot(conn: Connection, instance_id: str, now: float) -> None:
    """Record this engine's host instance."""
    runners.insert_instance(conn, instance_id, now)


def shutdown(conn: Connection, instance_id: str, now: float) -> list[int]:
    """Graceful close: this instance's connections and tool grants end (their tools are
    gone, so their foreground children are cancelled); leases and leased children stay."""
    connections = runners.open_connections(conn, instance_id)
    tools = grants.tools_of_connections(conn, connections)
    affected = close_tools(conn, tools, now, HOST_CLOSED)
    for connection_id in connections:
        runners.disconnect(conn, connection_id, now)
    return affected


def close_instance(conn: Connection, instance_id: str, now: float) -> None:
    runners.close_instance(conn, instance_id, now)
