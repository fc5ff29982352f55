"""delegation: durable, credential-free child runs for agent hosts.

The wire contract (SPEC §2) lives in :mod:`delegation.wire`,
:mod:`delegation.options` and :mod:`delegation.codec`; every refusal is a
:class:`DelegationError` (see :mod:`delegation.errors`).
"""

from __future__ import annotations

from delegation.codec import decode, encode
from delegation.errors import DelegationError
from delegation.options import ExecutionOptions
from delegation.wire import (
    CANCEL_METHOD,
    READ_METHOD,
    RELEASE_METHOD,
    START_METHOD,
    STEER_METHOD,
    Event,
    Identity,
    Params,
    Preset,
    Profile,
    Request,
    Result,
    SteerResult,
    valid_id,
)

__all__ = [
    "CANCEL_METHOD",
    "READ_METHOD",
    "RELEASE_METHOD",
    "START_METHOD",
    "STEER_METHOD",
    "DelegationError",
    "Event",
    "ExecutionOptions",
    "Identity",
    "Params",
    "Preset",
    "Profile",
    "Request",
    "Result",
    "SteerResult",
    "decode",
    "encode",
    "valid_id",
]
