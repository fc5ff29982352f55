"""Errors of the tree (see :mod:`delegation.errors`): caps."""

from __future__ import annotations

from delegation.errors.base import DelegationError


class LimitError(DelegationError):
    """child limit exceeded"""

    reason = "limit_exceeded"


class StepTooLarge(LimitError):
    """child step result exceeds its limit"""

    reason = "step_too_large"


class StepLimit(LimitError):
    """child step limit exceeded"""

    reason = "step_limit"


class ConnectionLimit(LimitError):
    """too many connections: the host serves no more at once; try again later"""

    reason = "connection_limit"


class SubmissionLimit(LimitError):
    """child submission limit exceeded"""

    reason = "submission_limit"


class LeaseCapacity(LimitError):
    """child lease capacity exceeded"""

    reason = "lease_capacity"


class SteerLimit(LimitError):
    """child steer request limit exceeded"""

    reason = "steer_limit"


class PresetLimit(LimitError):
    """execution preset limit exceeded"""

    reason = "preset_limit"


class NestingLimit(LimitError):
    """child nesting limit exceeded"""

    reason = "nesting_limit"


class FollowLimit(LimitError):
    """too many follows on this connection"""

    reason = "follow_limit"


class QueueFull(LimitError):
    """child admission queue is full"""

    reason = "queue_full"
