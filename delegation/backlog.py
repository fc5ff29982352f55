"""Answers a peer has not taken yet, counted in bytes (design §18).

``delegation serve`` bounds what one stream's answers may hold in memory: the room
reserved for the answers being computed and the answers written and not yet read
count together against the stream's :class:`Backlog` (16 MiB). The engine asks for
room through a :class:`Room` before it reads a page for a call, so that an answer no
one reads is never computed past the bound: once the backlog is full, the next page
is read only when the peer has taken enough.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

MAX_BACKLOG = 16 * 1024 * 1024


class Room(Protocol):
    """Room for one call's answer, in the budget of whoever waits for it."""

    async def reserve(self, size: int) -> None:
        """Return once ``size`` bytes are held for the answer (waiting while the
        budget is full). Holding room for one answer: a second call holds no more
        than the larger of the two sizes."""
        ...


class _Unbounded:
    async def reserve(self, size: int) -> None:
        return None


UNBOUNDED: Room = _Unbounded()
"""The room of a caller in the same process, which holds its answers itself."""


class Backlog:
    """The bytes of one stream's answers its peer has not taken yet: room held for
    answers being computed, and answers handed to the stream and not yet read.

    ``reserve`` waits while the bound would be passed, except when nothing is held:
    one answer larger than the bound is still served, alone.
    """

    def __init__(self, limit: int = MAX_BACKLOG) -> None:
        self.limit = limit
        self.used = 0
        self._freed = asyncio.Event()

    async def reserve(self, size: int) -> None:
        """Wait until ``size`` more bytes fit, then hold them."""
        while self.used and self.used + size > self.limit:
            await self._freed.wait()
        self.used += size

    def hold(self, size: int) -> None:
        """Hold ``size`` bytes at once: an answer that exists already."""
        self.used += size

    def free(self, size: int) -> None:
        """``size`` bytes were taken by the peer (or are no longer owed)."""
        self.used -= size
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()  # every waiter looks again; a new wait waits for the next free

    async def room(self) -> None:
        """Return once no more than the bound is held."""
        while self.used > self.limit:
            await self._freed.wait()


class Answer:
    """The :class:`Room` of one call on a stream: what it holds in the stream's
    backlog until its answer exists (:meth:`release`); the stream's outbox then holds
    the answer's own bytes until the peer has read them."""

    def __init__(self, backlog: Backlog) -> None:
        self._backlog = backlog
        self._held = 0

    async def reserve(self, size: int) -> None:
        if size > self._held:
            await self._backlog.reserve(size - self._held)
            self._held = size

    def release(self) -> None:
        """The answer exists (or none will): give back the room held for it."""
        self._backlog.free(self._held)
        self._held = 0
