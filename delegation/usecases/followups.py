"""A follow-up continues its task frozen as it was first given (design §14).

The first execution of a conversation fixes the task: its preset (name, system prompt),
its effective options as they were at that start, and its cwd. A follow-up is prepared
from that snapshot, never from the preset as registered now; its own options may only
narrow the snapshot, and what picks the model or the place may not change at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from delegation import authority, errors
from delegation.options import ExecutionOptions, effective_options
from delegation.records import ChildRecord, GrantRecord, RunnerConnection
from delegation.store import children
from delegation.store.sql import Connection
from delegation.usecases import stored
from delegation.wire import Preset, Request

# What picks the model: a follow-up that names another value than the snapshot's is a
# different task, not a narrower one.
_FIXED = ("provider", "model", "reasoning_effort", "use_weak_model")


@dataclass(frozen=True, slots=True)
class Frozen:
    """What a follow-up runs with."""

    preset: Preset  # the first execution's, as it was stored
    options: ExecutionOptions  # effective: the snapshot narrowed by this follow-up
    cwd: str  # the saved one
    system_prompt: str  # the saved one (the first request's, else the preset's)
    previous_run_id: str  # the execution this one continues


def owned_executions(
    conn: Connection, grant: GrantRecord, rconn: RunnerConnection, request: Request
) -> list[ChildRecord]:
    """The executions of the conversation a follow-up names, oldest first, if the caller
    may continue it: started by the same parent conversation, extension, runner, host
    instance and preset (design §3.6, §14). Raises ``ResumeMismatch`` otherwise."""
    executions = children.executions(conn, request.resume)
    if not executions or not all(
        e.parent_conversation_id == grant.conversation_id
        and e.extension_id == grant.extension_id
        and e.runner_id == rconn.runner_id
        and e.runner_host_instance_id == rconn.host_instance_id
        and e.profile == request.profile
        for e in executions
    ):
        raise errors.ResumeMismatch()
    return executions


def freeze(
    executions: list[ChildRecord],
    request: Request,
    policy: ExecutionOptions | None,
    workspace: str,
) -> Frozen:
    """The follow-up ``request`` of the conversation ``executions`` (oldest first),
    under the new tool call's ``policy``.

    Raises:
        errors.ResumeMismatch: another cwd, system prompt, provider, model, reasoning
            effort or weak-model choice than the snapshot's.
        errors.OptionsWidened: the subclass naming how the request widens the snapshot,
            or how what it asks widens the new call's policy.
        errors.ChildUnreadable: the first execution's stored snapshot no longer decodes.
    """
    first, last = executions[0], executions[-1]
    first_stored = stored.of(first)
    preset, first_request = first_stored.preset, first_stored.request
    snapshot = (
        first_stored.options
        if first_stored.options is not None
        else effective_options(None, preset, first_request)
    )
    system_prompt = first_request.system_prompt or preset.system_prompt
    if request.system_prompt and request.system_prompt != system_prompt:
        raise errors.ResumeMismatch()
    cwd = authority.resolve_cwd(workspace, "", first.cwd)  # still there, still inside
    if request.cwd and authority.resolve_cwd(workspace, request.cwd) != cwd:
        raise errors.ResumeMismatch()
    if request.options is not msgspec.UNSET:
        for name in _FIXED:
            given = getattr(request.options, name)
            if given is not msgspec.UNSET and given != getattr(snapshot, name):
                raise errors.ResumeMismatch()
    # The request narrows the snapshot; what it asks must fit the new call's policy.
    narrowed = effective_options(None, _Snapshot(snapshot), request)
    options = effective_options(policy, _Snapshot(narrowed), _Snapshot(msgspec.UNSET))
    return Frozen(preset, options, cwd, system_prompt, last.run_id)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    options: ExecutionOptions | msgspec.UnsetType
