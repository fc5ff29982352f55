"""``child.follow`` over ``delegation serve``: a child's events pushed as they commit.

A follow is a request answered only when it ends (:class:`~delegation.protocol.Followed`);
until then each page of new events goes out as one ``child.events`` notification
(:data:`~delegation.protocol.EVENTS`). The pages are :meth:`Engine.follow_read
<delegation.engine.Engine.follow_read>`'s: ``child.read`` with its authority and page
bound, read again as the child's commits land.

Bounded like every answer: each page is read once room for it is reserved in the
stream's :class:`~delegation.backlog.Backlog` (16 MiB of answers not yet taken), and
its notification counts there until the peer has read it, so while the backlog is full
the follow waits before its next read, holding nothing more. A follow holds one of the
stream's in-flight slots until it is answered, and a stream holds at most
:func:`follow_limit` of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from delegation import errors, protocol, rpc
from delegation.backlog import Answer
from delegation.codec import decode
from delegation.engine import Engine
from delegation.host.serve_io import Outbox
from delegation.records import RunnerConnection
from delegation.wire import Params, Result

log = logging.getLogger("delegation.serve")

MAX_FOLLOWS = 16


def follow_limit(max_inflight: int) -> int:
    """The follows one stream may run at once: at most :data:`MAX_FOLLOWS`, and one
    in-flight slot always left for other calls (a ``child.follow.stop`` among them)."""
    return max(0, min(MAX_FOLLOWS, max_inflight - 1))


class Follows:
    """The follows of one stream, by their request's id."""

    def __init__(self, engine: Engine, outbox: Outbox, limit: int) -> None:
        self._engine = engine
        self._outbox = outbox
        self._limit = limit
        self._stops: dict[int | str, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._stops)

    async def follow(
        self, conn: RunnerConnection, request_id: object, raw: bytes
    ) -> protocol.Followed:
        """Serve one ``child.follow`` until the child ended and every event was given
        (``done``), or until it is stopped (not ``done``).

        Raises:
            errors.InvalidRpcRequest: the request has no id (a notification, or null),
                or the id of a follow of this stream still running.
            errors.FollowLimit: this stream already runs :func:`follow_limit` follows.
            errors.DelegationError: what ``child.read`` refuses, on any page.
        """
        if not isinstance(request_id, int | str):
            raise errors.InvalidRpcRequest("invalid request: child.follow needs an id")
        params = decode(raw, Params, providers=self._engine.config.providers)
        if request_id in self._stops:
            raise errors.InvalidRpcRequest("invalid request: id of a follow still running")
        if len(self._stops) >= self._limit:
            limit = f"at most {self._limit}; stop one first"
            raise errors.FollowLimit(f"too many follows on this connection ({limit})")
        stop = self._stops[request_id] = asyncio.Event()
        room = Answer(self._outbox.backlog)  # each page's, given back once it is sent
        try:
            pages = self._engine.follow_read(conn, params, room=room)
            pushing = asyncio.create_task(self._push(request_id, pages, room))
            stopped = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({pushing, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # stopped, ended, or the host closing: nothing of it runs on
                pushing.cancel()
                stopped.cancel()
                await asyncio.gather(pushing, stopped, return_exceptions=True)
        finally:
            del self._stops[request_id]
            room.release()
        done = not pushing.cancelled() and pushing.result()  # a refusal raises here
        extra = {"action": "child_follow_ended", "follow": request_id, "done": done}
        log.debug("follow ended", extra=extra)
        return protocol.Followed(done=done)

    async def stop(self, raw: bytes) -> protocol.Empty:
        """``child.follow.stop``: end that follow (answered ``done: false``); one that
        already ended, or never ran, is no error."""
        params = rpc.decode_params(raw, protocol.FOLLOW_STOP.params)
        stop = self._stops.get(params.follow)
        if stop is not None:
            stop.set()
        return protocol.Empty()

    def stop_all(self) -> None:
        """The stream's input ended: no stop can arrive any more, so stop them all."""
        for stop in self._stops.values():
            stop.set()

    async def _push(
        self, request_id: int | str, pages: AsyncGenerator[Result], room: Answer
    ) -> bool:
        """Each page's events as one notification, each sent before the next page is
        read (and its room reserved); True once the page that found the child terminal
        was sent."""
        done = False
        async with contextlib.aclosing(pages):
            async for page in pages:
                room.release()  # the notification counts instead, until the peer reads it
                done = page.done
                if page.events:
                    events = protocol.FollowEvents(request_id, page.events)
                    self._outbox.send(rpc.notification_frame(protocol.EVENTS.name, events))
        return done
