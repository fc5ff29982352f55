"""The host protocol of ``delegation serve`` (design §8), declared once: each method's wire
name, the type its params decode into and the type of its answer. :mod:`delegation.host.serve`
serves this table and :mod:`delegation.client.api` calls through it; neither spells a method
again.

* **Lifecycle methods** (``runner.register``, ``tool.begin``, ``tool.end``,
  ``run.finish``) take effect in the order they arrived, before anything sent after
  them; their params decode strictly into the types below.
* **Child methods** (``child.start`` … ``child.lease.release``, :data:`~delegation.wire.
  CHILD_METHODS`, ``child.input`` of design §21 and ``child.send`` of §33) run
  concurrently; their params are :class:`~delegation.wire.Params`,
  decoded with the host's providers, and they answer a :class:`~delegation.wire.Result`
  (``child.steer``: a :class:`~delegation.wire.SteerResult`).
* **Follows** (``child.follow``, :data:`FOLLOW`): ``child.read`` pushed. Its params are
  a :class:`~delegation.wire.Params`, checked like a read's on every page it reads (the
  same refusals); it is answered only when it ends, with :class:`Followed`: ``done``
  true once the child is terminal and every event after ``after`` was given, false when
  the client stopped it. Until then the host sends :data:`EVENTS` notifications, one
  per page of new events (``{follow: <the request's id>, events: [...]}``, each event
  once, in order, a page bounded like a read's). A follow holds one of the stream's
  in-flight slots while it runs, at most :data:`~delegation.host.serve_follow.MAX_FOLLOWS`
  per stream (one slot always stays free for other calls; past it: ``follow_limit``),
  and waits, like every answer, while the stream's unread answers are over their bound.
  The client ends one early with :data:`FOLLOW_STOP` (``{follow: <id>}``); the end of
  the stream's input ends them all.
* **Notifications**: a request without an id is served and never answered (a follow
  without an id is refused: its events would name nothing); the host's own are the
  :data:`EVENTS` of a follow.
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
    INPUT_METHOD,
    READ_METHOD,
    RELEASE_METHOD,
    SEND_METHOD,
    START_METHOD,
    STEER_METHOD,
    Event,
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
    # The parent run's own effective options: the ceiling of its children (design §9).
    policy: ExecutionOptions | msgspec.UnsetType = msgspec.UNSET


class ToolEnd(WireStruct, frozen=True):
    run_id: str
    tool_call_id: str


class RunFinish(WireStruct, frozen=True):
    run_id: str
    succeeded: bool


class Empty(WireStruct, frozen=True):
    """The ``{}`` answer of the lifecycle methods but ``runner.register``."""


class Followed(WireStruct, frozen=True):
    """The answer to ``child.follow``: true once the child ended and every event was
    given, false when the client stopped the follow first."""

    done: bool


class FollowEvents(WireStruct, frozen=True):
    """A ``child.events`` notification: the next events of the follow whose request id
    is ``follow``, oldest first."""

    follow: int | str
    events: list[Event]


class FollowStop(WireStruct, frozen=True):
    """``child.follow.stop``: end the follow whose request id is ``follow`` (one that
    already ended is no error)."""

    follow: int | str


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
INPUT = Method(INPUT_METHOD, Params, Result)  # design §21
SEND = Method(SEND_METHOD, Params, Result)  # design §33

FOLLOW = Method("child.follow", Params, Followed)
FOLLOW_STOP = Method("child.follow.stop", FollowStop, Empty)
# Sent by the host, never to it: a follow's next page of events.
EVENTS = Method("child.events", FollowEvents, Empty)

LIFECYCLE: tuple[Method[Any, Any], ...] = (REGISTER, TOOL_BEGIN, TOOL_END, RUN_FINISH)
CHILD: tuple[Method[Params, Any], ...] = (START, READ, CANCEL, STEER, RELEASE, INPUT, SEND)
