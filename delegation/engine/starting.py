"""``child.start`` on this host: a start reserved, spawned and answered.

:meth:`Starting.start` reserves the child, the reservation's commit spawns its run (on
the :class:`~delegation.engine.supervisor.Supervisor`), and the run's admission resolves
the run's ``first`` future with the first page, which answers the caller that started it
(see :mod:`delegation.engine.local_run` for one run's lifecycle).
"""

from __future__ import annotations

import asyncio

from delegation import errors
from delegation.backlog import UNBOUNDED, Room
from delegation.engine.local_run import LocalRun
from delegation.engine.runtime import Runtime, Use
from delegation.engine.supervisor import Supervisor
from delegation.engine.timers import Timers
from delegation.records import RunnerConnection
from delegation.usecases import reservation
from delegation.wire import Params, Result


class Starting:
    """The starts of one engine (see the module): reserved here, run by ``supervisor``."""

    def __init__(self, rt: Runtime, supervisor: Supervisor, timers: Timers) -> None:
        self._rt = rt
        self._supervisor = supervisor
        self._timers = timers
        # On a server a statement costs a round trip: a start under a tool grant found
        # open before reserves without reading it first (reservation.reserve_start).
        self._seen_tools = reservation.SeenTools() if rt.db.shared else None

    async def start(self, conn: RunnerConnection, params: Params, room: Room = UNBOUNDED) -> Result:
        """Reserve the child; its commit spawns the run; answer once it is admitted.

        The reservation is nobody's answer yet: the admission commit that answers the
        caller syncs it to disk too (design §4: committed before ``prepare``). A caller
        that goes away must not strand a committed reservation unrun: the commit itself
        spawns the run, and the caller only waits for it. Without a leaseId its one
        write is the reservation's INSERT, after every check.

        The caller awaits one future, woken once: the run's ``first`` (the page read in
        the admission transaction, handed over as it commits), which the reservation's
        commit gives the run it spawns; a replay's commit resolves it at once, and a
        reservation that fails passes its error on. Only this caller awaits it: if it
        goes away, nothing else is cancelled."""
        rt, supervisor = self._rt, self._supervisor
        tel = rt.telemetry
        use = Use(
            reservation.reserve_start,
            rt.config,
            conn,
            params,
            rt.instance_id,
            trace_context=tel.trace_context() if tel is not None else None,
            seen=self._seen_tools,
            known=supervisor.known,
        )
        # A start that may enter admission (design §22) writes more than its INSERT, under
        # the policies' lock: one transaction, never a lone statement.
        alone = not params.lease_id and not supervisor.known
        return await self._started(use, params.after, room, alone=alone)

    async def rewind(self, to: reservation.RewindTo) -> Result:
        """The host's or an operator's rewind (design §35), reserved under the
        conversation's live lease and answered as a start is, once admitted."""
        rt = self._rt
        tel = rt.telemetry
        use = Use(
            reservation.reserve_rewind,
            rt.config,
            rt.instance_id,
            to,
            known=self._supervisor.known,
            trace_context=tel.trace_context() if tel is not None else None,
        )
        return await self._started(use, 0, UNBOUNDED, alone=False)

    async def _started(
        self, use: Use[reservation.StartPlan], after: int, room: Room, *, alone: bool
    ) -> Result:
        """Reserve by ``use`` (``alone``: its one write is the reservation's INSERT) and
        answer as :meth:`start` does, from ``after``."""
        rt, supervisor = self._rt, self._supervisor
        first: asyncio.Future[Result | None] = asyncio.get_running_loop().create_future()

        def failed(written: asyncio.Future[reservation.StartPlan]) -> None:
            if written.cancelled():
                first.cancel()
            elif (exc := written.exception()) is not None and not first.done():
                first.set_exception(exc)

        def committed(plan: reservation.StartPlan) -> None:
            reserved.append(plan)
            try:
                runs.append(self._reserved(plan, first))
            except BaseException:
                if not first.done():  # answered by a read of the child
                    first.set_result(None)
                raise
            written.remove_done_callback(failed)  # answered through ``first`` alone

        reserved: list[reservation.StartPlan] = []
        runs: list[LocalRun | None] = []
        written = rt.write(use, durable=False, committed=committed, one_write=alone)
        written.add_done_callback(failed)
        page = await first
        plan = reserved[0]
        answers = supervisor.answers
        try:
            if plan.queued or plan.replay:
                return await answers.answer(plan.child.id, after, room, turn=True)
            local = runs[0] if runs else None
            if local is not None and local.suspended:
                raise errors.HostClosing()
            if page is None:
                return await answers.answer(plan.child.id, after, room)
            if after:
                return await answers.page(plan.child.id, after, room)
            return page
        except errors.ChildPurged:
            if plan.replay:
                raise
            # Its reservation was lost with the server (an unflushed commit a failover
            # did not carry over): nothing was started, and a replay starts it anew.
            raise errors.StoreUnavailable() from None

    def _reserved(
        self, plan: reservation.StartPlan, first: asyncio.Future[Result | None]
    ) -> LocalRun | None:
        """At the reservation's commit, whether or not its caller still waits: a new
        child's run is spawned with the caller's ``first``; a replay answers it now."""
        if plan.new_lease_deadline is not None:
            self._timers.arm_earlier(plan.new_lease_deadline)
        supervisor, child_id = self._supervisor, plan.child.id
        already = supervisor.runs.get(child_id) is not None
        if plan.replay and not already and child_id not in supervisor.to_resume:
            plan = reservation.unspawned(plan, self._rt.instance_id) or plan
        if plan.replay or plan.queued or already:  # a queued child runs once the pump admits it
            if not first.done():
                first.set_result(None)  # the caller waits for the run here (answer)
            return None
        return supervisor.spawn(plan.child, plan, None, first=first)
