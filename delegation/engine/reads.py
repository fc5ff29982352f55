"""The engine's read models (design §6), beside :class:`~delegation.engine.api.Engine`,
whose base this is: a child's records, its events, a follow of them as they commit,
the leases. Each is one read transaction, or a follow's reads."""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from delegation import errors
from delegation.backlog import UNBOUNDED, Room
from delegation.config import EngineConfig
from delegation.engine import following
from delegation.engine.methods import ChildMethods
from delegation.engine.runtime import Runtime
from delegation.records import ChildFilter, ChildRecord, LeaseRecord, RunnerConnection
from delegation.store.interface import Store
from delegation.usecases import queries
from delegation.wire import Event, ParamsLike, Result


class EngineReads:
    """What an engine reads (see the module); its parts are the engine's."""

    config: EngineConfig
    _db: Store
    _rt: Runtime
    _methods: ChildMethods
    _require_open: Callable[[], None]

    async def get_child(
        self, conversation_id: str, run_id: str | None = None
    ) -> ChildRecord | None:
        """The newest execution of a conversation (or the one ``run_id`` names), or None."""
        return await self._db.read(lambda c: queries.find_child(c, conversation_id, run_id))

    async def list_children(
        self,
        *,
        state: str | None = None,
        lease_id: str | None = None,
        parent_run_id: str | None = None,
        parent_conversation_id: str | None = None,
        limit: int = 100,
    ) -> list[ChildRecord]:
        """Child records, newest first, filtered by state, lease and parent."""
        wanted = ChildFilter(state, lease_id, parent_run_id, parent_conversation_id, limit)
        return await self._db.read(lambda c: queries.list_children(c, wanted))

    async def events(
        self,
        conversation_id: str,
        run_id: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[Event]:
        """Committed events of an execution with ``sequence > after``, oldest first."""
        size = limit or self.config.events_per_read
        return await self._db.read(
            lambda c: queries.child_events(c, conversation_id, run_id, after, size)
        )

    def _announced(self, wanted: bool) -> None:
        """The store announces committed events only while a child is followed: a
        batch then wakes the loop once more, which no one should pay for unasked."""
        self._db.on_events = self._rt.notices.bump if wanted else None

    async def follow(
        self, conversation_id: str, run_id: str | None = None, after: int = 0
    ) -> AsyncIterator[Event]:
        """Every committed event of an execution after ``after``, each once, in order,
        as it commits; the iterator ends once the execution is terminal and its last
        event was given, whoever ended it (this host, another one, a takeover). Woken by
        the commit itself (another host's by its ``NOTIFY``); with no wake-up for a
        second it reads again anyway, so a lost notice only delays the end. A read the
        database could not answer is tried again (see :mod:`delegation.usecases.follow`).

        Raises:
            errors.ChildNotFound: no such execution.
            errors.ChildPurged: the execution was purged before its end was read.
            errors.HostClosing: the engine closed while following.
        """
        self._require_open()
        child = await self.get_child(conversation_id, run_id)
        if child is None:
            raise errors.ChildNotFound(f"child not found: {conversation_id}")
        max_bytes = self.config.max_page_bytes
        pages = following.any_pages(self._db, self._rt.notices, child.id, max_bytes)
        async for event in pages(after, self.config.events_per_read):
            yield event

    def follow_read(
        self, conn: RunnerConnection, params: ParamsLike, *, room: Room = UNBOUNDED
    ) -> AsyncGenerator[Result]:
        """``child.follow``: the pages ``child.read`` answers from ``params.after`` on,
        each read as the child's commits land, until the one that finds it terminal.
        Every page is a read: its authority and refusals (see ``owned_pages``), and its
        room reserved in ``room`` (see :meth:`call`)."""
        self._require_open()
        methods = self._methods
        read = functools.partial(methods.read, conn, room=room)
        limit = self.config.events_per_read  # the most events a read puts in a page
        notices, owned = self._rt.notices, methods.params(params)
        return following.owned_pages(read, self.get_child, notices, owned, limit)

    async def leases(self, runner_id: str | None = None) -> list[LeaseRecord]:
        """Leases and tombstones, newest first."""
        return await self._db.read(lambda c: queries.leases(c, runner_id))
