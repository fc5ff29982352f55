"""``delegation web``'s event streams, bounded in bytes per client (design §18).

A stream's frames go through an :class:`Unsent`: what follows the child puts frames in
it, a sender hands them to the connection ``CHUNK`` bytes at a time, and ``unsent``
counts the bytes put and not yet taken by the connection.

* **A child's history goes at the client's pace.** While a stream is behind (its last
  read was a full page: more is committed already) it reads the next page only once the
  connection has taken everything it holds. A slow client slows its own stream; one that
  stopped reading holds at most one page (``inspector.PAGE_BYTES``, or one event).
* **What commits is owed.** Once a stream has caught up with its child, it reads as
  soon as the database moves, whatever its client took; and while it waits for its
  client, what the child commits counts (by its stored size, no body read) with what it
  holds. A client whose unsent bytes, so counted, would exceed ``MAX_UNSENT_BYTES`` is
  dropped: its frames are freed and its place among the ``MAX_STREAMS`` is given back.
  A browser's EventSource comes back after ``retry`` and resumes after the last event
  it got (``Last-Event-ID``), so a drop loses nothing.

What a dropped connection keeps until its client reads or leaves: the server's write
buffer (uvicorn's 64 KiB high-water mark and one ``CHUNK``) and the response's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from delegation import errors

log = logging.getLogger(__name__)

MAX_STREAMS = 64  # open event streams at once; more are refused (503)
MAX_UNSENT_BYTES = 2 * 1024 * 1024  # a stream's frames its connection has not taken
CHUNK = 64 * 1024  # bytes handed to the connection at a time
RETRY = b"retry: 2000\n\n"  # a browser reconnects this many ms after a stream ends
_END: Message = {"type": "http.response.body", "body": b"", "more_body": False}


class Dropped(Exception):
    """The client is to be dropped: raised by :class:`Pace` inside a stream's frames and
    caught by :class:`EventStream`, never further."""


class Moves(Protocol):
    """The database's commits as a version (``web.Commits``)."""

    stopped: bool

    def version(self) -> int: ...

    async def wait(self, seen: int, timeout: float) -> bool: ...


class Unsent:
    """The frames of one stream that its connection has not taken yet."""

    def __init__(self, limit: int = MAX_UNSENT_BYTES) -> None:
        self.limit = limit
        self.unsent = 0  # bytes put and not yet taken by the connection
        self.closed = False
        self._frames: deque[bytes] = deque()
        self._moved = asyncio.Event()

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes keep it within its limit (an empty outbox takes
        any one frame)."""
        return not self.unsent or self.unsent + size <= self.limit

    def put(self, frame: bytes) -> None:
        self._frames.append(frame)
        self.unsent += len(frame)
        self._poke()

    def close(self) -> None:
        """Nothing more will be put: the sender ends the response once it is empty."""
        self.closed = True
        self._poke()

    def clear(self) -> None:
        self._frames.clear()
        self.unsent = 0
        self._poke()

    def taken(self, size: int) -> None:
        """The connection took ``size`` bytes of what was put."""
        self.unsent -= size
        self._poke()

    async def drained(self) -> None:
        """Wait until the connection has taken everything put."""
        while self.unsent:
            await self._changed()

    async def next(self) -> bytes | None:
        """The oldest frame not yet handed over; None once closed and empty."""
        while not self._frames:
            if self.closed:
                return None
            await self._changed()
        return self._frames.popleft()

    def _poke(self) -> None:
        self._moved.set()
        self._moved = asyncio.Event()

    async def _changed(self) -> None:
        await self._moved.wait()


class Pace:
    """When a stream that is behind its child reads its next page: once its connection
    took everything it holds (:meth:`room`)."""

    def __init__(
        self,
        outbox: Unsent,
        moves: Moves,
        sizes: Callable[[int], Awaitable[list[tuple[int, int]]]],
        timeout: float,
    ) -> None:
        self.caught_up = False  # a page once came back short: the stream is live
        self._outbox, self._moves, self._sizes, self._timeout = outbox, moves, sizes, timeout
        self._after = self._through = -1
        self._owed = 0  # stored bytes committed past ``after``, counted through ``_through``

    def read(self, full: bool) -> None:
        """A page was read; ``full``: more was committed already."""
        self.caught_up = self.caught_up or not full

    async def room(self, after: int) -> None:
        """Wait until the connection took everything the stream holds, ``after`` the
        last event read. Once the stream has caught up, each time the database moves
        meanwhile the sizes of the events committed since (``sizes(after)``) are counted
        with what it holds.

        Raises:
            Dropped: that count exceeds the outbox's limit.
        """
        if after != self._after:
            self._after, self._through, self._owed = after, after, 0
        while self._outbox.unsent and not self._moves.stopped:
            seen = self._moves.version()
            await _first(self._outbox.drained(), self._moves.wait(seen, self._timeout))
            if not self._outbox.unsent or not self.caught_up or self._moves.version() == seen:
                continue
            for sequence, size in await self._sizes(self._through):
                self._through, self._owed = sequence, self._owed + size
            if not self._outbox.fits(self._owed):
                raise Dropped


class StreamCount:
    """How many event streams are open, of at most ``limit``."""

    def __init__(self, limit: int = MAX_STREAMS) -> None:
        self.limit = limit
        self.open = 0

    def full(self) -> bool:
        return self.open >= self.limit


class EventStream(Response):
    """A Server-Sent Events answer: the frames ``frames(outbox)`` gives, through an
    :class:`Unsent` of ``MAX_UNSENT_BYTES``; it ends when they end, when the client
    leaves, or when ``stopping`` is set (the server stops)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: Callable[[Unsent], AsyncGenerator[str, None]],
        streams: StreamCount,
        stopping: asyncio.Event,
        limit: int = MAX_UNSENT_BYTES,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers()
        self._frames, self._streams, self._stopping, self._limit = frames, streams, stopping, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
        await send(start)
        outbox = Unsent(self._limit)
        outbox.put(RETRY)
        self._streams.open += 1
        counted = True
        producer = asyncio.create_task(self._produce(outbox))
        sender = asyncio.create_task(_deliver(outbox, send))
        gone = asyncio.create_task(_disconnected(receive))
        stopped = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({producer, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                return
            if producer.result():
                outbox.close()  # the sender ends the response once all is taken
                await asyncio.wait({sender, gone}, return_when=asyncio.FIRST_COMPLETED)
            else:
                sender.cancel()
                await asyncio.wait({sender})
                self._drop(outbox)
                counted = False
                # Its end waits for the client to read what its connection holds, or
                # to leave; a server that stops does not wait for it.
                sender = asyncio.ensure_future(send(_END))
                await asyncio.wait({sender, gone, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if counted:
                self._streams.open -= 1
            tasks = (producer, sender, gone, stopped)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _drop(self, outbox: Unsent) -> None:
        """Free what the stream holds and give its place back."""
        outbox.clear()
        self._streams.open -= 1
        log.warning(
            "dropped an event stream whose client fell more than %d bytes behind",
            self._limit,
            extra={"action": "web_stream_dropped"},
        )

    async def _produce(self, outbox: Unsent) -> bool:
        """Put every frame in ``outbox``: True once they ended, False at the first
        that would take it past its limit or once :class:`Pace` says so (the client is
        to be dropped)."""
        try:
            async with contextlib.aclosing(self._frames(outbox)) as frames:
                async for frame in frames:
                    data = frame.encode()
                    if not outbox.fits(len(data)):
                        return False
                    outbox.put(data)
        except Dropped:
            return False
        except errors.StoreError as exc:  # the client's EventSource comes back
            log.warning("stream ended: %s", exc, extra={"action": "web_stream_failed"})
        return True


async def _deliver(outbox: Unsent, send: Send) -> None:
    """Hand ``outbox``'s frames to the connection as it takes them, then end the
    response once the outbox is closed and empty."""
    while (frame := await outbox.next()) is not None:
        for start in range(0, len(frame), CHUNK):
            piece = frame[start : start + CHUNK]
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            outbox.taken(len(piece))
    await send(_END)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Wait until the first of ``waits`` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
