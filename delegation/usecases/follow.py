"""Following a child's events as they commit: the one loop behind ``Engine.follow``,
``Inspector.follow`` (``delegation events --follow``) and the web page's event stream.

A follower reads a page of the child's events after the last sequence it gave, gives
them, and reads again at once while pages come back full (or say ``more``: a page cut
at a byte bound before its count). Once a page is not full it
ends if the child was terminal when that page was read (the state is read with the
events, and a terminal state commits after the run's last event, so nothing is left
behind), else it sleeps until its :class:`Wake` says something committed. The version
is taken *before* each read: a commit that lands during the read moves it, so the
follower reads again instead of sleeping past it.

What reads the pages and what wakes the follower is the caller's: the engine reads
through its store and is woken by its own commits (:class:`ChildWake` over its
notices); the inspector and the web page read through an :class:`Inspector` and are
woken by a database watch (:class:`WatchWake`).

Nothing lost or failed can hang a follower or end it early (design §18): without a wake-up
for ``RECHECK_S`` it reads again anyway, so a lost notice (or a state change that sent
none) only delays its end; a read that fails because the database is busy or away is
logged once (``follow_read_failed``) and tried again, with pauses growing to
``READ_PAUSE_MAX_S``. Any other failure of a read ends the follow with it (a purged
child's :class:`errors.ChildPurged`, a closed store).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Protocol, TypeVar

from delegation import errors
from delegation.wire import Event

log = logging.getLogger("delegation.follow")

RECHECK_S = 1.0  # with no wake-up for this long, a follower reads its child again
READ_PAUSE_S = 0.1  # after a read the database could not answer: the first pause
READ_PAUSE_MAX_S = 2.0  # doubling up to this while reads keep failing
# What a read may meet that another read may not: retried, never the follow's end.
PASSING = (errors.StoreUnavailable, errors.DatabaseBusy)


class Reading(Protocol):
    """One read: up to a page of events, and whether the child was terminal then."""

    @property
    def events(self) -> Sequence[Event]: ...

    @property
    def done(self) -> bool: ...


P = TypeVar("P", bound=Reading)
E = TypeVar("E")


class Wake(Protocol):
    """Tells a follower that something may have committed."""

    def version(self) -> int:
        """A number that moves whenever something may have committed."""
        ...

    async def moved(self, since: int) -> bool:
        """Return once the version is no longer ``since`` (or whenever reading again is
        worth it): True to read again, False to stop following."""
        ...


async def pages(
    read: Callable[[int, int], Awaitable[P]],
    wake: Wake,
    after: int,
    limit: int,
    *,
    recheck: float = RECHECK_S,
) -> AsyncIterator[P]:
    """Every page ``read(after, limit)`` gives, each ``after`` the last event of the one
    before, until a page that is not full finds the child terminal (or ``wake`` says
    stop). ``read`` returns at most ``limit`` events, oldest first. Without a wake-up
    for ``recheck`` seconds it reads again anyway; a read the database could not answer
    (:data:`PASSING`) is logged once and tried again."""
    pause = 0.0  # > 0: reads are failing (and this was the last pause)
    while True:
        seen = wake.version()
        try:
            page = await read(after, limit)
        except PASSING as exc:
            if not pause:
                log.warning(
                    "following a child: a read failed, trying again: %s",
                    exc,
                    extra={"action": "follow_read_failed"},
                )
            pause = min(max(pause * 2, READ_PAUSE_S), READ_PAUSE_MAX_S)
            await asyncio.sleep(pause)
            continue
        pause = 0.0
        yield page
        if page.events:
            after = page.events[-1].sequence
        if len(page.events) >= limit or getattr(page, "more", False):
            continue  # more are committed already
        if page.done or not await _moved(wake, seen, recheck):
            return


async def _moved(wake: Wake, since: int, timeout: float) -> bool:
    """``wake.moved(since)``, or True (read again) once ``timeout`` passed without it.

    ``asyncio.timeout``, not ``wait_for``: on Python 3.11, a cancellation that comes in
    the turn the wake-up does (a follow stopped as its child commits) is swallowed by
    ``wait_for``, which returns the wake-up instead, and the follow runs on.
    """
    try:
        async with asyncio.timeout(timeout):
            return await wake.moved(since)
    except TimeoutError:
        return True


async def events(
    read: Callable[[int, int], Awaitable[P]], wake: Wake, after: int, limit: int
) -> AsyncIterator[Event]:
    """Every event after ``after``, each once, in order, as it commits; ends once the
    child is terminal and its last event was given (see :func:`pages`)."""
    async for page in pages(read, wake, after, limit):
        for event in page.events:
            yield event


class Versions(Protocol):
    """Per-child versions, as the engine's notices keep them."""

    def version(self, child_id: int) -> int: ...

    async def moved(self, child_id: int, since: int) -> None: ...


class ChildWake:
    """A :class:`Wake` over one child's version in ``versions`` (the engine's notices:
    its own commits and other hosts' announce the children they concern)."""

    def __init__(self, versions: Versions, child_id: int) -> None:
        self._versions, self._child_id = versions, child_id

    def version(self) -> int:
        return self._versions.version(self._child_id)

    async def moved(self, since: int) -> bool:
        await self._versions.moved(self._child_id, since)
        return True


class Commits(Protocol):
    """Whether another connection committed since the last question (a store's watch)."""

    def changed(self) -> bool: ...

    async def wait(self, timeout: float | None = None) -> bool: ...


class WatchWake:
    """A :class:`Wake` over a database watch (another process's commits): the version
    moves each time the watch saw a commit."""

    def __init__(self, watch: Commits) -> None:
        self._watch = watch
        self._version = 0

    def version(self) -> int:
        if self._watch.changed():
            self._version += 1
        return self._version

    async def moved(self, since: int) -> bool:
        if self._version == since:
            await self._watch.wait()
            self._version += 1
        return True


def blocking(follower: AsyncGenerator[E, None]) -> Iterator[E]:
    """``follower`` for synchronous code: each item on an event loop of its own (the
    inspector's reads block, so nothing else runs on it meanwhile)."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(anext(follower))
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(follower.aclose())
        loop.close()
