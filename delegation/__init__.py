"""delegation: durable, credential-free child runs for agent hosts.

The wire contract (SPEC §2) lives in :mod:`delegation.wire`,
:mod:`delegation.options` and :mod:`delegation.codec`; every refusal is a
:class:`DelegationError` (see :mod:`delegation.errors`).
"""

from __future__ import annotations

from delegation.codec import decode, encode
from delegation.config import EngineConfig
from delegation.engine import Engine
from delegation.errors import DelegationError
from delegation.options import ExecutionOptions, effective_options
from delegation.records import ChildRecord, LeaseRecord, RunnerConnection, ToolHandle
from delegation.runs import ChildContext, NotResumable, Recovery, Run, Runner, admit
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
    "ChildContext",
    "ChildRecord",
    "DelegationError",
    "Engine",
    "EngineConfig",
    "Event",
    "ExecutionOptions",
    "Identity",
    "LeaseRecord",
    "NotResumable",
    "Params",
    "Preset",
    "Profile",
    "Recovery",
    "Request",
    "Result",
    "Run",
    "Runner",
    "RunnerConnection",
    "SteerResult",
    "ToolHandle",
    "admit",
    "decode",
    "effective_options",
    "encode",
    "valid_id",
]
