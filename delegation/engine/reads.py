"""The engine's read models (design §6): a child's records, its events, a follow of them
as they commit, the leases. Each is one read transaction, or a follow's reads.

:class:`EngineReads` is a part of :class:`~delegation.engine.api.Engine`, whose public
reads (``get_child``, ``list_children``, ``events``, ``follow``, ``follow_read``,
``leases``) hand over to it and say what each answers.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable

from delegation import errors
from delegation.backlog import Room
from delegation.engine import following
from delegation.engine.methods import ChildMethods
from delegation.engine.runtime import Runtime
from delegation.records import ChildFilter, ChildRecord, LeaseRecord, RunnerConnection
from delegation.usecases import queries
from delegation.wire import Event, ParamsLike, Result


class EngineReads:
    """What one engine reads (see the module), through the parts it is given."""

    def __init__(
        self, rt: Runtime, methods: ChildMethods, require_open: Callable[[], None]
    ) -> None:
        self._rt = rt
        self._methods = methods
        self._require_open = require_open  # raises StoreError unless the engine is open

    async def get_child(self, conversation_id: str, run_id: str | None) -> ChildRecord | None:
        return await self._rt.db.read(lambda c: queries.find_child(c, conversation_id, run_id))

    async def list_children(self, wanted: ChildFilter) -> list[ChildRecord]:
        return await self._rt.db.read(lambda c: queries.list_children(c, wanted))

    async def events(
        self, conversation_id: str, run_id: str | None, after: int, limit: int | None
    ) -> list[Event]:
        size = limit or self._rt.config.events_per_read
        return await self._rt.db.read(
            lambda c: queries.child_events(c, conversation_id, run_id, after, size)
        )

    async def follow(
        self, conversation_id: str, run_id: str | None, after: int
    ) -> AsyncGenerator[Event]:
        self._require_open()
        child = await self.get_child(conversation_id, run_id)
        if child is None:
            raise errors.ChildNotFound(f"child not found: {conversation_id}")
        rt = self._rt
        pages = following.any_pages(rt.db, rt.notices, child.id, rt.config.max_page_bytes)
        async for event in pages(after, rt.config.events_per_read):
            yield event

    def follow_read(
        self, conn: RunnerConnection, params: ParamsLike, room: Room
    ) -> AsyncGenerator[Result]:
        self._require_open()
        methods = self._methods
        read = functools.partial(methods.read, conn, room=room)
        limit = self._rt.config.events_per_read  # the most events a read puts in a page
        notices, owned = self._rt.notices, methods.params(params)
        return following.owned_pages(read, self.get_child, notices, owned, limit)

    async def leases(self, runner_id: str | None) -> list[LeaseRecord]:
        return await self._rt.db.read(lambda c: queries.leases(c, runner_id))
