"""Who may do what (design §3): pure checks over records, in the spec's order.

Nothing here reads or writes the database; the service hands in the records it
loaded inside the same transaction that will act on the answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from delegation import errors
from delegation.options import wire_name
from delegation.records import ChildRecord, GrantRecord, RunnerConnection, RunnerRecord
from delegation.wire import Params, Preset, Request, valid_id

_PARAM_IDS = ("run_id", "tool_call_id", "extension_id", "child_id", "child_run_id", "lease_id")


def check_ids(params: Params) -> None:
    """Every id a call carries is a valid ID (design §9): at most 128 bytes, printable,
    no path separators. An empty optional id is absent and passes.

    Raises:
        errors.InvalidId: naming the first field that is not.
    """
    for name in _PARAM_IDS:
        value = getattr(params, name)
        if value and not valid_id(value):
            if name == "lease_id":
                raise errors.BadLeaseId()
            raise errors.InvalidId(f"child {wire_name(name)} must be a valid ID")
    request = params.request
    if not isinstance(request, Request):  # UNSET: no request
        return
    request_id = request.request_id.strip()
    if request_id and not valid_id(request_id):
        raise errors.InvalidId("child requestId must be a valid ID")
    if request.lease_id and not valid_id(request.lease_id):
        raise errors.BadLeaseId()


def require_ids(**ids: str) -> None:
    """Check the ids of a host call (a tool, a run, a registration); all are required.

    Raises:
        errors.InvalidId: naming the first that is not a valid ID.
    """
    for name, value in ids.items():
        if not valid_id(value):
            raise errors.InvalidId(f"{wire_name(name)} must be a valid ID")


def check_connection(runner: RunnerRecord | None, conn: RunnerConnection) -> None:
    """The call must arrive on the runner's current connection (design §3.1)."""
    if runner is None or runner.runner_id != conn.runner_id or runner.connection_id is None:
        raise errors.RunnerNotFound()
    if runner.connection_id != conn.id or runner.generation != conn.generation:
        raise errors.StaleConnection()


def grant_live(grant: GrantRecord, now: float) -> bool:
    """A tool grant until its tool call ends; a lease until revoked or past its deadline.

    A lease is still live at exactly ``expires_at`` and expired one tick after.
    """
    if not grant.is_lease:
        return grant.closed_at is None
    return grant.revoked_at is None and grant.expires_at is not None and now <= grant.expires_at


def select_grant(
    tool: GrantRecord | None, lease: GrantRecord | None, params: Params
) -> GrantRecord | None:
    """The lease grant when ``leaseId`` names an existing one, else the tool grant."""
    if params.lease_id and lease is not None:
        return lease
    return tool


def owns(grant: GrantRecord, conn: RunnerConnection, params: Params, now: float) -> bool:
    """Whether the caller owns ``grant`` right now (design §3.3)."""
    if grant.runner_id != conn.runner_id or not grant_live(grant, now):
        return False
    if not grant.is_lease and grant.connection_id != conn.id:
        return False
    return (
        params.run_id == grant.run_id
        and params.extension_id == grant.extension_id
        and params.generation != 0
        and params.generation in grant.generations
    )


def require_owner(
    grant: GrantRecord | None,
    conn: RunnerConnection,
    params: Params,
    now: float,
    *,
    steer: bool = False,
) -> GrantRecord:
    """The selected grant, if the caller owns it; else the refusal of design §3.3, its
    detail saying what is missing (the message is the contract's, the same for all)."""
    if grant is None or not owns(grant, conn, params, now):
        refusal = errors.SteerNotOwned() if steer else errors.NotOwned()
        raise refusal.explain(missing(grant, conn, params, now))
    return grant


def missing(grant: GrantRecord | None, conn: RunnerConnection, params: Params, now: float) -> str:
    """What the caller lacks to own ``grant``, in words (for a refusal's detail)."""
    if grant is None:
        if params.lease_id:
            return (
                f"no tool call {params.run_id!r}/{params.tool_call_id!r} is open on this"
                f" connection, and runner {conn.runner_id!r} has no lease {params.lease_id!r}"
            )
        return (
            f"no tool call {params.run_id!r}/{params.tool_call_id!r} is open on this"
            " connection (open_tool, or tool.begin over serve, first)"
        )
    kind = "lease" if grant.is_lease else "tool call"
    if grant.runner_id != conn.runner_id:
        return f"the {kind} belongs to another runner"
    if not grant_live(grant, now):
        return f"the {kind} has ended" if not grant.is_lease else "the lease was revoked or expired"
    if not grant.is_lease and grant.connection_id != conn.id:
        return "the tool call was opened on another connection of this runner"
    if params.run_id != grant.run_id:
        return f"runId {params.run_id!r} is not the {kind}'s run {grant.run_id!r}"
    if params.extension_id != grant.extension_id:
        return f"extensionId {params.extension_id!r} is not the {kind}'s {grant.extension_id!r}"
    known = ", ".join(str(g) for g in sorted(grant.generations)) or "none"
    return f"generation {params.generation} is not one of the {kind}'s presets' ({known} expected)"


def find_preset(grant: GrantRecord, name: str, generation: int) -> Preset:
    """The named preset of the grant at exactly that generation (design §3.4)."""
    for preset in grant.presets:
        if preset.name == name and preset.generation == generation:
            return preset
    raise errors.PresetStale()


def resolve_cwd(workspace: str, cwd: str, default: str | None = None) -> str:
    """Resolve a child's working directory inside the workspace, symlinks followed.

    ``workspace`` is the real path the tool stored when it opened; it is not resolved
    again: a workspace swapped for a symlink since then leads outside itself.
    An empty ``cwd`` means ``default`` (the saved cwd on resume) or the workspace
    root. A relative ``cwd`` is taken from the workspace root.

    Raises:
        errors.InvalidCwd: it does not exist or is not a directory.
        errors.CwdOutsideWorkspace: once resolved, it is outside the workspace.
    """
    if not os.path.isabs(workspace):
        raise errors.InvalidCwd()
    real = real_directory(os.path.join(workspace, cwd or default or workspace))
    if not within(real, workspace):
        raise errors.CwdOutsideWorkspace()
    return real


def within(path: str, root: str) -> bool:
    """``path`` is ``root`` or below it (both absolute; ``root`` may end in a separator)."""
    root = root.rstrip(os.sep) or os.sep
    return path == root or path.startswith(root if root == os.sep else root + os.sep)


def confirm_cwd(cwd: str) -> None:
    """Check, right before a run may act, that a reserved cwd is still the directory
    :func:`resolve_cwd` confined: the real path it stored must still resolve to itself.

    Hazard: the workspace is writable, so between the start and the run a directory
    on the path can be swapped for a symlink leading out of it.

    Raises:
        errors.InvalidCwd: it no longer exists or is not a directory.
        errors.CwdOutsideWorkspace: it now resolves elsewhere.
    """
    if real_directory(cwd) != cwd:
        raise errors.CwdOutsideWorkspace()


_OPEN_DIRECTORY = getattr(os, "O_PATH", 0) | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_REMOVED = " (deleted)"


def real_directory(path: str) -> str:
    """The real path of the directory ``path`` names, symlinks followed.

    On Linux the kernel resolves it in one step: the directory is opened (``O_PATH``,
    nothing is read) and its path read back from ``/proc/self/fd``, so the answer is
    the directory one resolution reached, not a walk of lookups a concurrent rename
    could split (and it costs three system calls, not one per component). Elsewhere,
    or without ``/proc``, ``os.path.realpath``.

    Raises:
        errors.InvalidCwd: it does not exist, is not a directory, or was removed.
    """
    try:
        fd = os.open(path, _OPEN_DIRECTORY)
    except (OSError, ValueError):
        raise errors.InvalidCwd() from None
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        real = ""  # no /proc: resolved again below
    finally:
        os.close(fd)
    # A directory removed meanwhile reads "… (deleted)": a name can end so too, so
    # that one case is resolved again below (and fails if it is gone).
    if not real.startswith(os.sep) or real.endswith(_REMOVED):
        try:
            real = os.path.realpath(path, strict=True)
        except (OSError, ValueError):
            raise errors.InvalidCwd() from None
        if not os.path.isdir(real):
            raise errors.InvalidCwd()
    return real


def locate(children: Iterable[ChildRecord], child_id: str, child_run_id: str) -> ChildRecord:
    """The one child of a grant that a handle names (design §3.7)."""
    matches = [
        child
        for child in children
        if child.conversation_id == child_id and (not child_run_id or child.run_id == child_run_id)
    ]
    if not matches:
        raise errors.ChildNotOwned()
    if len(matches) > 1:
        raise errors.AmbiguousChild()
    child = matches[0]
    if child.followup and not child_run_id:
        raise errors.FollowupRequiresRunId()
    return child


def check_release_owner(lease: GrantRecord | None, params: Params) -> None:
    """``child.lease.release`` needs the lease's exact owner (design §5)."""
    if not params.lease_id or not params.extension_id or params.generation == 0:
        raise errors.ReleaseOwnerRequired()
    if not valid_id(params.lease_id):
        raise errors.BadLeaseId()
    check_ids(params)
    if lease is not None and (
        lease.extension_id != params.extension_id or params.generation not in lease.generations
    ):
        raise errors.LeaseOwnerMismatch()
