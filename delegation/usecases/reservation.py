"""``child.start``'s use case: the checks of design §5 and the child's reservation.

A start is checked on the rows it reads and reserves the child as ``prepared``, owned
by the host instance that runs it, in one write transaction: reads, checks, one
``INSERT``. A store where a statement costs a round trip (``SeenTools``) may skip the
reads for a tool grant an earlier start found open (see :func:`reserve_start`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET

from delegation import authority, errors
from delegation.codec import encode
from delegation.config import EngineConfig
from delegation.machine import State
from delegation.options import ExecutionOptions, effective_options
from delegation.records import ChildRecord, GrantRecord, RunnerConnection, RunnerRecord
from delegation.store import children, grants
from delegation.store.sql import Connection
from delegation.usecases import admission, followups, rewinding, stored
from delegation.usecases.service import authorized, identity_of
from delegation.wire import Identity, Params, Preset, Request, Rewind, priority_of

log = logging.getLogger("delegation.engine")


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
    previous_run_id: str | None = None  # the execution a follow-up continues (design §15)
    # Admission (design §22): it holds its slots already (its run fires only RUN), or
    # it waits its turn (no run is spawned: the pump admits it).
    slotted: bool = False
    queued: bool = False


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


@dataclass(slots=True)
class _Start:
    """One start's inputs, as every step of its checks needs them."""

    conn: Connection
    now: float
    cfg: EngineConfig
    rconn: RunnerConnection
    params: Params
    request: Request
    instance_id: str
    trace_context: str | None
    known: frozenset[str] = frozenset()


@dataclass(slots=True)
class _Checked:
    """What the checks common to every start found (design §5, steps 1-4)."""

    grant: GrantRecord
    tool: GrantRecord | None
    preset: Preset
    executions: list[ChildRecord]
    cwd: str
    wire_request: bytes
    run_request: Request
    options: ExecutionOptions  # effective, as stored with the child (design §14)
    previous_run_id: str | None = None  # a follow-up's: the execution it continues
    rewind: rewinding.Source | None = None  # a rewind's source (design §35)


def reserve_start(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    rconn: RunnerConnection,
    params: Params,
    instance_id: str,
    *,
    trace_context: str | None = None,
    seen: SeenTools | None = None,
    known: frozenset[str] = frozenset(),
) -> StartPlan:
    """Check a start in the order of design §5 and reserve the child as ``prepared``,
    owned by the host instance ``instance_id`` (which runs it). ``trace_context`` (the
    start's W3C traceparent, when traced) is kept with the child for its executions.

    With ``seen`` (a store where a statement costs a round trip), a start under a tool
    grant an earlier start found open is checked against the runner and grant as then
    read, and reserved by one statement that inserts only if both rows are still
    exactly so (and the requestId is new, and the grant under its cap): then every
    check had the outcome it has on the rows now. Otherwise, or if a check refuses on
    the rows as seen, the start reads them again and is checked as if none was seen.

    ``known``: the scopes this host last saw a policy for (design §22). A child in one
    of them enters admission in this transaction: it takes its slots now, or is queued
    (``queue_full`` when its queue is full).

    Raises the first refusal that applies; nothing is written then.
    """
    authority.check_ids(params)
    request = params.request if params.request is not UNSET else Request()
    start = _Start(conn, now, cfg, rconn, params, request, instance_id, trace_context, known)
    if seen is not None and not (params.lease_id or request.resume or known):
        key = (rconn.runner_id, params.run_id, params.tool_call_id)
        last = seen.get(key)
        if last is not None:
            plan = _reserve_as_seen(start, last)
            if plan is not None:
                return plan
            seen.drop(key)
    return _reserve(start, seen)


def _reserve_as_seen(start: _Start, last: grants.SeenTool) -> StartPlan | None:
    """The start on the rows as ``last`` saw them: None if they changed since, or the
    requestId is taken, or the grant is full, or a check refuses on them (nothing was
    written: the start is decided on the rows as they are)."""
    try:
        checked = _check(start, last.runner, last.tool)
        tool_owned = _check_admissible(start, checked)
        _check_depth(start, checked.grant)
        values = _child_values(start, checked, tool_owned)
        cap = start.cfg.max_children_per_grant
        child = grants.insert_child_as_seen(start.conn, last, cap, **values)
    except errors.DelegationError:
        return None
    return None if child is None else _plan(checked, child)


def _reserve(start: _Start, seen: SeenTools | None) -> StartPlan:
    """The start on the rows read now."""
    conn, rconn, params, request = start.conn, start.rconn, start.params, start.request
    known: grants.StartReads | None = None
    if params.lease_id:  # the grant may be the lease: read it, then under it
        runner, tool = grants.runner_and_tool(
            conn, rconn.runner_id, params.run_id, params.tool_call_id
        )
    else:  # the grant is the call's tool grant: one statement reads all a start needs
        known = grants.runner_tool_and_request(
            conn, rconn.runner_id, params.run_id, params.tool_call_id, request.request_id
        )
        runner, tool = known.runner, known.tool
    checked = _check(start, runner, tool)
    if known is not None and checked.tool is not None and checked.grant.id == checked.tool.id:
        existing, count = known.existing, known.count
        if seen is not None and known.seen is not None and not request.resume:
            seen.put((rconn.runner_id, params.run_id, params.tool_call_id), known.seen)
    else:
        existing, count = children.by_request_and_count(conn, checked.grant.id, request.request_id)
    return _reserve_checked(start, checked, existing, count)


def _reserve_checked(
    start: _Start, checked: _Checked, existing: ChildRecord | None, count: int
) -> StartPlan:
    """The start checked (``existing``: the child its requestId reserved before, if any;
    ``count``: the children of its grant): a replay, or the child reserved."""
    conn, params = start.conn, start.params
    if existing is not None:
        return _replay(checked, existing)
    tool_owned = _check_admissible(start, checked)
    at = None if checked.rewind is None else rewinding.point_of(conn, checked.rewind)
    new_lease: float | None = None
    if params.lease_id and not checked.grant.is_lease:
        checked.grant = _new_lease(start, checked.grant)
        new_lease, count = checked.grant.expires_at, 0  # a new grant: no child yet
    if count >= start.cfg.max_children_per_grant:
        raise errors.SubmissionLimit()
    _check_depth(start, checked.grant)
    child = children.insert_child(conn, **_child_values(start, checked, tool_owned))
    if checked.rewind is not None and at is not None:
        rewinding.seed(conn, start.now, start.cfg, child, checked.rewind, at)
    if start.known and not start.known.isdisjoint(admission.child_scopes(child)):
        seconds = admission.deadline_seconds(checked.options)
        entered = admission.enter(conn, start.now, start.instance_id, child, seconds)
        if entered is not None:
            plan = _plan(checked, entered.child, new_lease)
            return dataclasses.replace(plan, slotted=not entered.queued, queued=entered.queued)
    return _plan(checked, child, new_lease)


@dataclass(frozen=True, slots=True)
class RewindTo:
    """A rewind the host or an operator asks for: of the conversation, from its ended
    execution ``run_id``, before ``step`` (None: after its last step)."""

    conversation_id: str
    run_id: str
    step: str | None
    request_id: str


def reserve_rewind(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    instance_id: str,
    to: RewindTo,
    *,
    known: frozenset[str] = frozenset(),
    trace_context: str | None = None,
) -> StartPlan:
    """The host's or an operator's rewind of a conversation (design §35): a follow-up
    under the lease its newest execution holds, asking what the source asked, reserved
    as :func:`reserve_start` reserves one (idempotent by ``to.request_id``).

    Raises:
        errors.ChildNotFound: no such conversation.
        errors.RequestIdReused: the request id made a rewind from another point.
        errors.RewindNoAuthority: its newest execution holds no live lease.
        errors.RewindRunUnknown, errors.ActiveSubmission, errors.RewindStepUnknown: as
            a follow-up that carries the rewind.
    """
    newest = children.find(conn, to.conversation_id)
    if newest is None:
        raise errors.ChildNotFound()
    # Every host applies an operator's rewind of an ended conversation: the second of
    # two at once waits here, then finds the first one's execution (its request id).
    children.lock(conn, newest.id)
    executions = children.executions(conn, to.conversation_id)
    wire = Rewind(run_id=to.run_id, step=UNSET if to.step is None else to.step)
    # Asked again (a host that died before recording the control's outcome, a second
    # host): the execution it made, whatever the lease has become since.
    again = rewinding.made_before(executions, to.request_id, wire)
    if again is not None:
        return plan_of(again)
    last, lease = executions[-1], rewinding.lease_of(conn, now, executions)
    wire.validate()
    asked = stored.of(rewinding.source_of(executions, wire).child).request
    request = Request(
        resume=to.conversation_id,
        request_id=to.request_id,
        profile=last.profile,
        message=asked.message,
        lease_id=last.lease_id or "",
        rewind=wire,
    )
    request.validate(cfg.providers)
    rconn = RunnerConnection("", last.runner_id, last.runner_host_instance_id, last.generation)
    params = Params(
        run_id=lease.run_id or "",
        extension_id=last.extension_id,
        generation=last.generation,
        lease_id=request.lease_id,
        request=request,
    )
    start = _Start(conn, now, cfg, rconn, params, request, instance_id, trace_context, known)
    checked = _followup(lease, None, executions, request)
    existing, count = children.by_request_and_count(conn, lease.id, request.request_id)
    return _reserve_checked(start, checked, existing, count)


def _check(start: _Start, runner: RunnerRecord | None, tool: GrantRecord | None) -> _Checked:
    """The checks every start passes, in the order of design §5: the connection and the
    grant, the request, the preset, the lease it names, a resume's conversation, the
    working directory."""
    rconn, params, request = start.rconn, start.params, start.request
    grant = authorized(start.conn, runner, tool, rconn, params, start.now, steer=False)
    request.validate(start.cfg.providers)
    preset = authority.find_preset(grant, request.profile, params.generation)
    if not request.resume:
        effective = effective_options(grant.policy, preset, request)
        if request.lease_id != params.lease_id:
            raise errors.LeaseMismatch()
        cwd = authority.resolve_cwd(grant.workspace or "", request.cwd)
        run_request = with_options(request, effective)
        return _Checked(grant, tool, preset, [], cwd, encode(request), run_request, effective)
    # A follow-up: the first execution's snapshot, never the preset as registered now.
    if request.lease_id != params.lease_id:
        raise errors.LeaseMismatch()
    executions = followups.owned_executions(start.conn, grant, rconn, request)
    return _followup(grant, tool, executions, request)


def _followup(
    grant: GrantRecord, tool: GrantRecord | None, executions: list[ChildRecord], request: Request
) -> _Checked:
    """A follow-up of the conversation ``executions`` under ``grant``, checked."""
    rewind = None if request.rewind is UNSET else rewinding.source_of(executions, request.rewind)
    frozen = followups.freeze(executions, request, grant.policy, grant.workspace or "")
    run_request = with_options(request, frozen.options)
    if run_request.system_prompt != frozen.system_prompt:
        run_request = msgspec.structs.replace(run_request, system_prompt=frozen.system_prompt)
    return _Checked(
        grant,
        tool,
        frozen.preset,
        executions,
        frozen.cwd,
        encode(request),
        run_request,
        frozen.options,
        frozen.previous_run_id,
        rewind,
    )


def _replay(checked: _Checked, existing: ChildRecord) -> StartPlan:
    """The requestId names a child reserved before: the same start again, or a refusal."""
    if existing.request != checked.wire_request or existing.cwd != checked.cwd:
        raise errors.RequestIdReused()
    return StartPlan(
        existing,
        True,
        checked.run_request,
        checked.preset,
        identity_of(existing),
        previous_run_id=checked.previous_run_id,
    )


def unspawned(plan: StartPlan, instance_id: str) -> StartPlan | None:
    """A replay of ``instance_id``'s own reservation, never admitted, that no run of it
    runs (the caller knows): the plan to run it now, else None.

    A reservation whose commit the server made while the connection was lost is
    committed but never spawned: its writer ran the start again, which found it, and
    so does the caller's own retry. A child reserved and never admitted belongs to the
    host that reserved it while that host lives (a takeover ends it), so it runs it."""
    child = plan.child
    if child.state != State.PREPARED or child.engine_instance_id != instance_id:
        return None
    log.warning(
        "child reserved by a commit whose answer was lost: run now",
        extra={"action": "child_unspawned", "run_id": child.run_id},
    )
    return dataclasses.replace(plan, replay=False, lease_pending=bool(child.lease_id))


def _check_admissible(start: _Start, checked: _Checked) -> bool:
    """The checks of a new child under the grant; returns whether the caller owns the
    call's tool grant (the child's origin)."""
    tool, grant = checked.tool, checked.grant
    tool_owned = tool is not None and authority.owns(tool, start.rconn, start.params, start.now)
    if start.params.lease_id and grant.activated_at is None and not tool_owned:
        raise errors.LeaseNotActivated()
    if start.request.context_mode == "fork" and not tool_owned:
        raise errors.ForkRequiresTool()
    if any(not e.terminal for e in checked.executions):
        raise errors.ActiveSubmission()
    return tool_owned


def _new_lease(start: _Start, grant: GrantRecord) -> GrantRecord:
    """The lease the start names, made from the call's tool grant (within the cap)."""
    cfg = start.cfg
    if grants.count_leases(start.conn, start.rconn.runner_id) >= cfg.max_leases_per_runner:
        raise errors.LeaseCapacity()
    lease_id = start.params.lease_id
    return grants.insert_lease(start.conn, grant, lease_id, start.now, cfg.lease_lifetime_s)


def _check_depth(start: _Start, grant: GrantRecord) -> None:
    if grant.depth > start.cfg.max_depth:
        raise errors.NestingLimit()


def _child_values(start: _Start, checked: _Checked, tool_owned: bool) -> dict[str, Any]:
    """The new child's row."""
    request, rconn, grant, tool = start.request, start.rconn, checked.grant, checked.tool
    return {
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
        "generation": start.params.generation,
        "request": checked.wire_request,
        "preset": encode(checked.preset),
        "cwd": checked.cwd,
        "depth": grant.depth,
        "followup": 1 if request.resume else 0,
        "origin_grant_id": tool.id if tool is not None and tool_owned else None,
        "engine_instance_id": start.instance_id,
        "created_at": start.now,
        "trace_context": start.trace_context,
        "options": encode(checked.options),
        "priority": priority_of(request, checked.preset),
        "version": start.cfg.runner_version,  # design §34: the version that prepared it
        "attempt_version": start.cfg.runner_version,
        **rewinding.lineage(checked.rewind),
    }


def _plan(checked: _Checked, child: ChildRecord, new_lease: float | None = None) -> StartPlan:
    grant = checked.grant
    pending = grant.is_lease and grant.activated_at is None
    identity = identity_of(child)
    return StartPlan(
        child,
        False,
        checked.run_request,
        checked.preset,
        identity,
        new_lease,
        pending,
        checked.previous_run_id,
    )


def with_options(request: Request, effective: ExecutionOptions) -> Request:
    """The request a run is prepared with: the stored one, with the effective options
    (the request is stored as sent; ``prepare`` sees what the child may do)."""
    current = request.options if request.options is not UNSET else ExecutionOptions()
    if current == effective:
        return request
    return msgspec.structs.replace(request, options=effective)


def plan_of(child: ChildRecord, policy: bytes | None = None) -> StartPlan:
    """The plan to run a stored child again (after a restart), under its grant's policy
    (as stored; see :func:`delegation.usecases.stored.for_run`).

    The stored request and preset were validated (and their options checked against
    the policy) when the child was reserved; they are read back without validating.

    Raises:
        errors.ChildUnreadable: what it stored no longer decodes.
    """
    request, preset, effective = stored.for_run(child.request, child.preset, child.options, policy)
    return StartPlan(child, True, with_options(request, effective), preset, identity_of(child))
