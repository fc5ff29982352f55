"""Errors of the tree (see :mod:`delegation.errors`): a child that waits (design §21).

The four refusals of ``child.input`` (and of the host's ``answer_input``), the two
timeouts a resumed ``ctx.ask`` or ``ctx.wait_event`` raises, and the bounds of what
waits: open requests per execution, events buffered per conversation, their payloads.
"""

from __future__ import annotations

from delegation.errors.conflict import ConflictError
from delegation.errors.limits import LimitError


class InputUnknown(ConflictError):
    """child input request not found"""

    reason = "input_unknown"


class InputAnswered(ConflictError):
    """child input was already answered"""

    reason = "input_answered"


class InputInvalid(ConflictError):
    """child input decision is not one of its options"""

    reason = "input_invalid"


class InputClosed(ConflictError):
    """child is not waiting for input"""

    reason = "input_closed"


class EventClosed(ConflictError):
    """child conversation has no live execution"""

    # An event sent to a conversation whose newest execution has ended: nothing stored
    # (design §33); a follow-up waits for events sent after it started.
    reason = "event_closed"


class InputTimeout(ConflictError):
    """child input request timed out"""

    reason = "input_timeout"


class EventTimeout(ConflictError):
    """child event wait timed out"""

    reason = "event_timeout"


class InputLimit(LimitError):
    """child has too many open input requests"""

    reason = "input_limit"


class EventBufferFull(LimitError):
    """child event buffer is full"""

    reason = "event_buffer_full"


class EventTooLarge(LimitError):
    """child event payload exceeds its limit"""

    reason = "event_too_large"


class StepTimeout(ConflictError):
    """child step timed out"""

    reason = "step_timeout"
