"""Errors of the tree (see :mod:`delegation.errors`): authority."""

from __future__ import annotations

from delegation.errors.base import DelegationError


class AuthorityError(DelegationError):
    """child requires active tool ownership or an unexpired retained lease"""

    reason = "not_authorized"


class RunnerNotFound(AuthorityError):
    """runner not found"""

    reason = "runner_not_found"


class StaleConnection(AuthorityError):
    """runner connection generation is stale"""

    reason = "stale_connection"


class NotOwned(AuthorityError):
    """child requires active tool ownership or an unexpired retained lease"""

    reason = "not_owned"


class SteerNotOwned(AuthorityError):
    """child steering requires current owned authority"""

    reason = "steer_not_owned"


class PresetStale(AuthorityError):
    """execution preset absent or stale"""

    reason = "preset_absent_or_stale"


class LeaseMismatch(AuthorityError):
    """child lease mismatch"""

    reason = "lease_mismatch"


class LeaseOwnerMismatch(AuthorityError):
    """child lease owner mismatch"""

    reason = "lease_owner_mismatch"


class InvalidCwd(AuthorityError):
    """invalid child working directory"""

    reason = "invalid_cwd"


class CwdOutsideWorkspace(AuthorityError):
    """child working directory exceeds parent workspace"""

    reason = "cwd_outside_workspace"


class LeaseNotActivated(AuthorityError):
    """child retained authority requires successful initial admission from an active tool"""

    reason = "lease_not_activated"


class ForkRequiresTool(AuthorityError):
    """child fork requires the current active parent tool"""

    reason = "fork_requires_tool"


class ResumeMismatch(AuthorityError):
    """the child task cannot resume with a different parent, host or execution preset"""

    reason = "resume_mismatch"


class ChildNotOwned(AuthorityError):
    """child run is not owned by this capability"""

    reason = "child_not_owned"


class AmbiguousChild(AuthorityError):
    """childRunId is required for an ambiguous child handle"""

    reason = "ambiguous_child"


class FollowupRequiresRunId(AuthorityError):
    """childRunId is required after a child followup"""

    reason = "followup_requires_run_id"
