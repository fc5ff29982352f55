"""Errors of the tree (see :mod:`delegation.errors`): a rewind (design §35).

A follow-up that carries ``rewind`` (and the host's or an operator's rewind) is refused
with one of these before anything is written: a rewind outside a follow-up, a source
that is not an ended execution of the conversation, a step the source never recorded,
and an operator's rewind of a conversation that holds no live lease.
"""

from __future__ import annotations

from delegation.errors.authority import AuthorityError
from delegation.errors.input import InputError


class RewindRequiresResume(InputError):
    """child rewind requires resume"""

    reason = "rewind_requires_resume"


class RewindRunUnknown(InputError):
    """child rewind run is not an execution of this conversation"""

    # Not of this conversation, never was, or purged after retention.
    reason = "rewind_run_unknown"


class RewindStepUnknown(InputError):
    """child rewind step was not recorded by that execution"""

    reason = "rewind_step_unknown"


class RewindNoAuthority(AuthorityError):
    """child rewind requires a live lease"""

    # An operator (no tool call of its own) acts under the conversation's lease only.
    reason = "rewind_no_authority"
