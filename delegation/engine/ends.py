"""The ends of runs, written together (:class:`Ends`).

Every run that ends joins the next write of ends: one job for up to :data:`BATCH` of
them, a few set-based statements on the server (:func:`service.finish`). A lease expiry
of thousands of children is then a handful of round trips, where one statement per child
made it seconds on PostgreSQL. A run alone is a batch of one, written at once.
"""

from __future__ import annotations

import asyncio

from delegation import errors
from delegation.engine.local_run import LocalRun
from delegation.engine.runtime import Runtime, Use
from delegation.records import ChildRecord
from delegation.usecases import service

BATCH = 1000  # ends in one job (one transaction's share of the writer's batch)

_Pending = tuple[LocalRun, str, "asyncio.Future[ChildRecord | None]"]


class Ends:
    """The runs' ends of one engine, written together."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._pending: list[_Pending] = []
        self._writing: asyncio.Task[None] | None = None

    async def record(self, local: LocalRun, error: str) -> ChildRecord | None:
        """Record the end of ``local``'s run (its error, "" for none) once its turn in a
        write of ends commits: its child's terminal record, or None if it was given up
        (the run was stopped with its host). A busy or absent database delays it, never
        loses it (:meth:`Runtime.owed`); what its end alone would have raised is raised."""
        done: asyncio.Future[ChildRecord | None] = asyncio.get_running_loop().create_future()
        self._pending.append((local, error, done))
        if self._writing is None or self._writing.done():
            self._writing = asyncio.create_task(self._write())
        return await asyncio.shield(done)

    async def _write(self) -> None:
        await asyncio.sleep(0)  # the runs ending in this turn of the loop join
        while self._pending:
            batch, self._pending = self._pending[:BATCH], self._pending[BATCH:]
            try:
                await self._write_one(batch)
            except BaseException as exc:
                failed = exc if isinstance(exc, Exception) else errors.HostClosing()
                for _, _, done in batch + self._pending:
                    if not done.done():
                        done.set_exception(failed)
                raise

    async def _write_one(self, batch: list[_Pending]) -> None:
        runs = [local for local, _, _ in batch]
        use = Use(service.finish, [(lo.child_id, error, lo.tracked) for lo, error, _ in batch])
        try:
            # Given up once every run of it was stopped with its host (closing).
            ended = await self._rt.owed(lambda: all(lo.stopped() for lo in runs), use)
        except Exception as exc:
            for _, _, done in batch:
                if not done.done():
                    done.set_exception(exc)
            return
        for local, _, done in batch:
            if done.done():
                continue
            outcome = None if ended is None else ended[local.child_id]
            if isinstance(outcome, errors.DelegationError):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)
