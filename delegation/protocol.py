"""The host protocol of ``delegation serve`` (SPEC §8), declared once: each method's wire
name, the type its params decode into and the type of its answer. :mod:`delegation.serve`
serves this table and :mod:`delegation.client` calls through it; neither spells a method
again.

* **Lifecycle methods** (``runner.register``, ``tool.begin``, ``tool.end``,
  ``run.finish``) take effect in the order they arrived, before anything sent after
  them; their params decode strictly into the types below.
* **Child methods** (``child.start`` … ``child.lease.release``, :data:`~delegation.wire.
  CHILD_METHODS`) run concurrently; their params are :class:`~delegation.wire.Params`,
  decoded with the host's providers, and they answer a :class:`~delegation.wire.Result`
  (``child.steer``: a :class:`~delegation.wire.SteerResult`).
* **Notifications**: a request without an id is served and never answered; the host
  sends none of its own.
* **Errors**: every refusal is one JSON-RPC error with the
  :class:`~delegation.errors.DelegationError`'s ``rpc_code`` and ``data.reason``;
  :func:`delegation.rpc.error_frame` writes it and :func:`delegation.rpc.error_from_wire`
  reads it back into the same class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from delegation._struct import Uint64, WireStruct
from delegation.options import ExecutionOptions
from delegation.wire import (
    CANCEL_METHOD,
    READ_METHOD,
    RELEASE_METHOD,
    START_METHOD,
    STEER_METHOD,
    Params,
    Preset,
    Result,
    SteerResult,
)

P = TypeVar("P")
R = TypeVar("R")


class Register(WireStruct, frozen=True):
    runner_id: str
    host_instance_id: str


class Registration(WireStruct, frozen=True):
    """The answer to ``runner.register``: this connection's id and generation."""

    connection_id: str
    generation: Uint64


class ToolBegin(WireStruct, frozen=True):
    run_id: str
    conversation_id: str
    tool_call_id: str
    extension_id: str
    presets: list[Preset]
    workspace: str
    # The parent run's own effective options: the ceiling of its children (SPEC §9).
    policy: ExecutionOptions | msgspec.UnsetType = msgspec.UNSET


class ToolEnd(WireStruct, frozen=True):
    run_id: str
    tool_call_id: str


class RunFinish(WireStruct, frozen=True):
    run_id: str
    succeeded: bool


class Empty(WireStruct, frozen=True):
    """The ``{}`` answer of the lifecycle methods but ``runner.register``."""


@dataclass(frozen=True)
class Method(Generic[P, R]):
    """One method: its wire name, what its params decode into, what it answers."""

    name: str
    params: type[P]
    result: type[R]
    lifecycle: bool = False


REGISTER = Method("runner.register", Register, Registration, lifecycle=True)
TOOL_BEGIN = Method("tool.begin", ToolBegin, Empty, lifecycle=True)
TOOL_END = Method("tool.end", ToolEnd, Empty, lifecycle=True)
RUN_FINISH = Method("run.finish", RunFinish, Empty, lifecycle=True)

START = Method(START_METHOD, Params, Result)
READ = Method(READ_METHOD, Params, Result)
CANCEL = Method(CANCEL_METHOD, Params, Result)
STEER = Method(STEER_METHOD, Params, SteerResult)
RELEASE = Method(RELEASE_METHOD, Params, Result)

LIFECYCLE: tuple[Method[Any, Any], ...] = (REGISTER, TOOL_BEGIN, TOOL_END, RUN_FINISH)
CHILD: tuple[Method[Params, Any], ...] = (START, READ, CANCEL, STEER, RELEASE)
METHODS: dict[str, Method[Any, Any]] = {m.name: m for m in (*LIFECYCLE, *CHILD)}
