"""What a caller of a child method is answered, and when (design §4, §22, §32): a
child's Result once its admission is decided, on whichever host runs it.

An ok answer to ``child.start`` (and a read's ``done: false``) is an admitted child: a
run here is waited for until it is admitted or ends; a child only reserved by another
host (or waiting its turn, for a start) is looked for in the database, for at most
``start_wait_s``.
"""

from __future__ import annotations

import asyncio

from delegation import errors
from delegation.backlog import UNBOUNDED, Room
from delegation.engine.local_run import LocalRun, LocalRuns
from delegation.engine.runtime import Runtime
from delegation.machine import State
from delegation.usecases import queries
from delegation.wire import Result

_UNDECIDED_LOOK_S = 0.1  # a child not decided yet elsewhere is looked at this often


class Answers:
    """The answers of one engine's child methods (see the module's docstring)."""

    def __init__(self, rt: Runtime, runs: LocalRuns) -> None:
        self._rt = rt
        self._runs = runs

    async def answer(
        self, child_id: int, after: int, room: Room = UNBOUNDED, *, turn: bool = False
    ) -> Result:
        """Wait until admission is decided (without cancelling anything if the caller
        goes away), then answer the child's Result (see :meth:`page`): an ok answer is
        an admitted child (design §4, §32), on whichever host runs it.

        A run here is waited for until it is admitted or ends. A child no run here
        prepares is looked for in the database (:meth:`_decided_elsewhere`), and so is one
        waiting its turn when ``turn`` (a start's answer, design §22)."""
        local = self._runs.get(child_id)
        if local is None:
            local = await self._decided_elsewhere(child_id, turn)
        if local is not None:
            await local.decided.wait()
            if local.suspended:
                raise errors.HostClosing()
        return await self.page(child_id, after, room)

    async def _decided_elsewhere(self, child_id: int, turn: bool) -> LocalRun | None:
        """Wait, for at most ``start_wait_s``, while the child is only reserved
        (``prepared``: another host prepares it, or died doing so and a takeover will end
        it) or, given ``turn``, waits its turn (``queued``; then it is answered as it is,
        ``queued: true``). Woken by this host's notices (and another host's, through the
        database's), and looking again every ``_UNDECIDED_LOOK_S``. Returns the run here
        that took it meanwhile, if one did.

        Raises:
            errors.AdmissionPending: still only reserved (a retryable refusal: the
                requestId replayed later gets the outcome).
        """
        rt = self._rt
        loop = asyncio.get_running_loop()
        until = loop.time() + rt.config.start_wait_s
        undecided = {State.PREPARED, State.QUEUED} if turn else {State.PREPARED}
        with rt.notices.following(child_id):
            while (local := self._runs.get(child_id)) is None:
                seen = rt.notices.version(child_id)
                child = await rt.db.read(lambda c: queries.child_by_id(c, child_id))
                if child is None or child.state not in undecided:
                    return None
                left = until - loop.time()
                if left <= 0:
                    if child.state == State.PREPARED:
                        raise errors.AdmissionPending()
                    return None
                try:
                    async with asyncio.timeout(min(left, _UNDECIDED_LOOK_S)):
                        await rt.notices.moved(child_id, seen)
                except TimeoutError:
                    continue
        return local

    def deciding(self, child_id: int) -> bool:
        """Whether the child runs here and its admission is not decided yet."""
        local = self._runs.get(child_id)
        return local is not None and not local.is_decided()

    async def page(
        self, child_id: int, after: int, room: Room = UNBOUNDED, *, strict: bool = True
    ) -> Result:
        """The child's Result with its page after ``after``, read once ``room`` holds
        ``max_page_bytes`` for it (``strict``: see :func:`queries.result_of`)."""
        limit, max_bytes = self._rt.config.events_per_read, self._rt.config.max_page_bytes
        await room.reserve(max_bytes)
        page = await self._rt.db.read(
            lambda c: queries.page(c, child_id, after, limit, max_bytes, strict=strict)
        )
        return page.result
