"""The five child methods of design §5, as :class:`~delegation.engine.api.Engine` serves
them by wire name (``Engine.call``) and as its typed methods.

Each call is decoded strictly (:class:`Params`, its JSON or a dict of wire names), runs
in a span named by its wire name when traced, and checks authority inside the
transaction that acts on it (:mod:`delegation.usecases.service`); what must follow a commit
(stopping a run, delivering a steer) happens here, after it. A page is read once the
caller's ``room`` (serve: the stream's unread bytes) holds ``max_page_bytes`` for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import msgspec

from delegation import errors
from delegation.backlog import Room
from delegation.codec import checked, decode
from delegation.engine.runtime import Runtime, Use
from delegation.engine.starting import Starting
from delegation.engine.supervisor import Supervisor
from delegation.machine import State
from delegation.records import RunnerConnection
from delegation.store.sql import Connection
from delegation.usecases import queries, service, waiting
from delegation.wire import (
    CANCEL_METHOD,
    INPUT_METHOD,
    READ_METHOD,
    RELEASE_METHOD,
    SEND_METHOD,
    START_METHOD,
    STEER_METHOD,
    Params,
    ParamsLike,
    Result,
    SteerResult,
)

T = TypeVar("T")
# What the child methods take: Params, the JSON of them, or a dict of wire names.
ChildHandler = Callable[[RunnerConnection, Params, Room], Awaitable[T]]
_json = msgspec.json.Encoder()


class ChildMethods:
    """``child.start``, ``child.read``, ``child.cancel``, ``child.steer`` and
    ``child.lease.release`` (and ``child.input``, design §21) on the runtime, the
    starts and the supervisor of one engine."""

    def __init__(self, rt: Runtime, supervisor: Supervisor, starting: Starting) -> None:
        self._rt = rt
        self._supervisor = supervisor
        self._starting = starting
        # The one method table: each wire name to the body that serves it (what
        # ``engine.call`` and ``serve`` dispatch through).
        self._by_wire: dict[str, ChildHandler[Result | SteerResult]] = {
            START_METHOD: self.start,
            READ_METHOD: self.read,
            CANCEL_METHOD: self.cancel,
            STEER_METHOD: self.steer,
            RELEASE_METHOD: self.release,
            INPUT_METHOD: self.input,
            SEND_METHOD: self.send,
        }
        # An answer committed (design §21): its run here reads again, or its child wakes.
        self.on_delivered: Callable[[waiting.Delivered], None] = lambda _: None

    def handler(self, method: str) -> ChildHandler[Result | SteerResult]:
        """The method a wire name names (the typed method's own body: one await less)."""
        handler = self._by_wire.get(method)
        if handler is None:
            raise errors.MethodNotFound(f"method not found: {method}")
        return handler

    def answer(
        self,
        method: str,
        handler: ChildHandler[T],
        conn: RunnerConnection,
        params: ParamsLike,
        room: Room,
    ) -> Awaitable[T]:
        """``handler``'s answer to ``params``, decoded; in a span named ``method`` when
        traced (decoding included: a malformed call is a call too)."""
        tel = self._rt.telemetry
        if tel is None:
            return handler(conn, self.params(params), room)
        return tel.method(
            method, lambda: self.params(params), lambda decoded: handler(conn, decoded, room)
        )

    def params(self, params: ParamsLike) -> Params:
        """``Params`` from Params, its JSON, or a dict of wire names (strictly decoded;
        typed Params are checked as their JSON would be: msgspec checks no type)."""
        if isinstance(params, Params):
            return checked(params, Params, providers=self._rt.config.providers)
        if isinstance(params, Mapping):
            try:
                params = _json.encode(dict(params))
            except (TypeError, msgspec.EncodeError) as exc:
                raise errors.MalformedInput(f"malformed child input: {exc}") from None
        if not isinstance(params, bytes | bytearray | memoryview | str):
            raise errors.MalformedInput("child params must be Params, JSON or a dict")
        return decode(params, Params, providers=self._rt.config.providers)

    # --- the five methods -------------------------------------------------------------

    def start(self, conn: RunnerConnection, params: Params, room: Room) -> Awaitable[Result]:
        return self._starting.start(conn, params, room)

    async def read(self, conn: RunnerConnection, params: Params, room: Room) -> Result:
        rt, supervisor = self._rt, self._supervisor
        now = rt.clock.now()
        limit, max_bytes = rt.config.events_per_read, rt.config.max_page_bytes
        await room.reserve(max_bytes)

        def locate_and_page(c: Connection) -> tuple[int, Result | None]:
            child = service.locate_child(c, conn, params, now)
            if supervisor.answers.deciding(child.id) or child.state == State.PREPARED:
                # Admission still pending, here or on another host (design §32): wait,
                # then read again; never answered as if admitted.
                return child.id, None
            return child.id, queries.page_of(c, child, params.after, limit, max_bytes).result

        child_id, result = await rt.db.read_now(locate_and_page)
        if result is not None:
            return result
        return await supervisor.answers.answer(child_id, params.after, room)

    async def cancel(self, conn: RunnerConnection, params: Params, room: Room) -> Result:
        child = await self._rt.write(Use(service.cancel, conn, params))
        if not child.terminal:
            await self._supervisor.stop([child.id])
        return await self._supervisor.answers.page(child.id, params.after, room)

    async def steer(self, conn: RunnerConnection, params: Params, room: Room) -> SteerResult:
        outcome = await self._rt.write(Use(service.steer, self._rt.config, conn, params))
        self.deliver_steer(outcome)
        return outcome.result

    async def release(self, conn: RunnerConnection, params: Params, room: Room) -> Result:
        rt, supervisor = self._rt, self._supervisor
        affected = await rt.write(Use(service.release, rt.config, conn, params))
        await supervisor.drain(await supervisor.stop(affected), rt.config.release_drain_s)
        remaining = await rt.db.read(
            lambda c: queries.active_under_lease(c, conn.runner_id, params.lease_id)
        )
        if remaining:
            raise errors.ReleaseUnconfirmed()
        return Result(done=True)

    async def input(self, conn: RunnerConnection, params: Params, room: Room) -> Result:
        """``child.input`` (design §21): answer the child's input request ``inputId``."""
        delivered = await self._rt.write(Use(waiting.answer, self._rt.config, conn, params))
        self.on_delivered(delivered)
        return await self._supervisor.answers.page(delivered.child_id, params.after, room)

    async def send(self, conn: RunnerConnection, params: Params, room: Room) -> Result:
        """``child.send`` (design §33): the event ``key`` with ``data`` for the child's
        conversation, once per ``requestId``; the child's Result."""
        delivered = await self._rt.write(Use(waiting.send, self._rt.config, conn, params))
        self.on_delivered(delivered)
        return await self._supervisor.answers.page(delivered.child_id, params.after, room)

    # --- what follows a commit --------------------------------------------------------

    def deliver_steer(self, outcome: service.SteerOutcome) -> None:
        """A committed steer queued for a child: to its run, if it runs here."""
        if outcome.queued is not None:
            self._supervisor.deliver(outcome.child_id, *outcome.queued)

    async def confirm_cancelled(self, child_id: int, waits: list[asyncio.Event]) -> None:
        """Wait for a cancelled child's run to stop, up to ``release_drain_s``.

        Raises:
            errors.CancelUnconfirmed: it is not terminal by then.
        """
        await self._supervisor.drain(waits, self._rt.config.release_drain_s)
        child = await self._rt.db.read(lambda c: queries.child_by_id(c, child_id))
        if child is not None and not child.terminal:
            raise errors.CancelUnconfirmed()
