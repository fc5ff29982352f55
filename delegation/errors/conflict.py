"""Errors of the tree (see :mod:`delegation.errors`): conflicts with stored state."""

from __future__ import annotations

from delegation.errors.base import DelegationError


class ConflictError(DelegationError):
    """child request conflicts with stored state"""

    reason = "conflict"


class ActiveSubmission(ConflictError):
    """child conversation already has an active submission"""

    reason = "active_submission"


class RequestIdReused(ConflictError):
    """requestId was already used with different child input"""

    reason = "request_id_reused"


class SteerRequestIdReused(ConflictError):
    """steer requestId already used with different input"""

    reason = "steer_request_id_reused"


class ChildEnded(ConflictError):
    """child has already ended"""

    # An operator's cancel, steer or answer given for an execution that is terminal
    # (design §33): refused when given, nothing recorded.
    reason = "child_ended"


class NotPinned(ConflictError):
    """child is not pinned"""

    # ``delegation unpin`` of a child no version policy pinned (design §34).
    reason = "not_pinned"


class AdmissionFailed(ConflictError):
    """child admission failed"""

    reason = "admission_failed"

    def __init__(self, error: str | None = None) -> None:
        base = self.default_message()
        super().__init__(f"{base}: {error}" if error else base)


class AdmissionPending(ConflictError):
    """child admission is not decided yet; replay the requestId"""

    # A start replayed, or a child read, while another host still prepares it (design
    # §32): never answered as if admitted.
    reason = "admission_pending"


class ReleaseUnconfirmed(ConflictError):
    """child lease revoked but cleanup is not yet confirmed; retry release"""

    reason = "release_unconfirmed"


class CancelUnconfirmed(ConflictError):
    """child cancellation cleanup is unconfirmed"""

    reason = "cancel_unconfirmed"


class ToolAlreadyOpen(ConflictError):
    """tool call is already open"""

    reason = "tool_already_open"


class IllegalTransition(ConflictError):
    """child state transition is not allowed"""

    reason = "illegal_transition"
