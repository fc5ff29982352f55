"""Following a child through the engine: the host's own view of any child
(:meth:`Engine.follow <delegation.engine.Engine.follow>`, :func:`any_pages`) and
``child.follow``, ``child.read`` pushed for a runner over ``delegation serve``
(:func:`owned_pages`).

The host's own view reads every page of the store as it is. A runner follows only what
it may read, so there every page is a ``child.read`` (its authority, its wait for
admission, its page bound and its refusals), read again each time the child's commits
move its version (the engine's notices, as :meth:`Engine.follow` is woken). The loop is
:func:`delegation.usecases.follow.pages`.

A ``Result`` does not say whether its page was cut (by count, or by bytes where reads
are bounded so), so a page that held events counts as cut: the follower reads again at
once, and only an empty page lets it sleep. One read more per wake is the price of
never taking a cut page for the last one.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import msgspec

from delegation import errors
from delegation.engine.notices import Notices
from delegation.records import ChildRecord
from delegation.store.interface import Store
from delegation.usecases import follow, queries
from delegation.wire import Event, Params, Result


def any_pages(
    db: Store, notices: Notices, child_id: int, max_bytes: int
) -> Callable[[int, int], AsyncIterator[Event]]:
    """``events(after, limit)``: every committed event of child ``child_id`` after
    ``after``, each once and in order, woken by its commits (the engine's notices),
    until its execution is terminal; ``limit`` events a page, within ``max_bytes``
    (a page cut by bytes says ``more``: it is read on at once)."""

    async def read(after: int, limit: int) -> queries.PagedResult:
        return await db.read(
            lambda c: queries.page(c, child_id, after, limit, max_bytes, strict=False)
        )

    async def events(after: int, limit: int) -> AsyncIterator[Event]:
        with notices.following(child_id):
            wake = follow.ChildWake(notices, child_id)
            async for event in follow.events(read, wake, after, limit):
                yield event

    return events


async def owned_pages(
    read: Callable[[Params], Awaitable[Result]],
    locate: Callable[[str, str], Awaitable[ChildRecord | None]],
    notices: Notices,
    params: Params,
    limit: int,
) -> AsyncGenerator[Result, None]:
    """Every page ``read`` (``child.read`` with the caller's authority) gives from
    ``params.after`` on, each after the last event of the one before, until a page that
    finds the child terminal has given its last event.

    ``locate(conversation_id, run_id)`` names the child the first page read, whose
    commits wake the follower; ``limit`` is the most events ``read`` puts in a page.

    Raises:
        errors.DelegationError: whatever ``child.read`` refuses, on any page (a lease
            released or a connection superseded meanwhile ends the follow so).
        errors.HostClosing: the engine closed while following.
    """
    first = await read(params)  # the authority, and the wait for the admission
    yield first
    child = await locate(first.conversation_id, first.run_id)
    if child is None:
        raise errors.ChildPurged()
    after = first.events[-1].sequence if first.events else params.after

    async def page(after: int, _limit: int) -> queries.PagedResult:
        result = await read(msgspec.structs.replace(params, after=after))
        return queries.PagedResult(result, more=bool(result.events))  # perhaps cut: read on

    # Watched before the next read: a commit since the first one is read, not slept past.
    with notices.following(child.id):
        wake = follow.ChildWake(notices, child.id)
        async for cut in follow.pages(page, wake, after, limit):
            yield cut.result
