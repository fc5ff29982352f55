"""Admission's pump (design §22): the queue admitted in order as slots free.

At open, the policies of ``EngineConfig.admission`` are stored (replacing those of the
same scope). Then every ``LOOK_S`` the host reads which scopes have a policy (a
change another process stored, ``set_admission`` or ``delegation admission``, applies
here within that), and when anything is queued or due, runs the pump: one write that
ends what timed out or passed its deadline and admits the queue's head while slots
and tokens last (:func:`delegation.usecases.admission.dequeue`), under this host; the
fresh children it admitted are spawned here (their ``prepare`` runs only now), those
woken before resume. A run here that ends or waits gives its slots back: the pump runs
at once. Any host may admit any queued child: the start that waits for it on another
host sees it move (its notices, or its look every 0.1 s).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from delegation import errors
from delegation.engine.notices import keep_running
from delegation.engine.resuming import Resuming
from delegation.engine.runtime import Runtime, Use, refused, unreadable
from delegation.engine.supervisor import Supervisor
from delegation.store import admission as store
from delegation.store.sql import Connection
from delegation.usecases import admission, reservation, versions

log = logging.getLogger("delegation.engine")

LOOK_S = 0.5  # how often a host reads the policies and looks at the queue
BATCH = 256  # children admitted in one transaction at most


class Admitting:
    """The admission pump of one engine (see the module)."""

    def __init__(self, rt: Runtime, supervisor: Supervisor, resuming: Resuming) -> None:
        self._rt = rt
        self._supervisor = supervisor
        self._resuming = resuming
        self._pumping: asyncio.Task[None] | None = None
        self._again = False
        self._timer: asyncio.TimerHandle | None = None
        supervisor.on_slot_freed = self.soon

    async def boot(self) -> None:
        """Store the configured policies; read which scopes have one."""
        configured = dict(self._rt.config.admission)
        if configured:
            await self._rt.write(Use(_store_all, configured))
        await self.refresh()

    async def refresh(self) -> frozenset[str]:
        known = await self._rt.db.read(store.scopes)
        self._supervisor.known = known
        return known

    def start(self) -> None:
        self._rt.background(keep_running("admission", self._looking))

    async def _looking(self) -> None:
        rt = self._rt
        while True:
            await asyncio.sleep(LOOK_S)
            try:
                await self.refresh()
                if await rt.db.read(_has_work(rt.clock.now())):
                    self.soon()
            except (errors.DatabaseBusy, errors.StoreUnavailable):
                continue  # looked at again next time
            except (errors.HostClosing, errors.HostFenced):
                return

    def soon(self) -> None:
        """Run the pump now (again once the running one ends, if one runs)."""
        if self._pumping is not None and not self._pumping.done():
            self._again = True
            return
        self._pumping = self._rt.background(self._pump())

    async def _pump(self) -> None:
        rt = self._rt
        try:
            while True:
                self._again = False
                host = versions.HostVersion.of(rt.config)
                turn = await rt.write(Use(admission.dequeue, rt.instance_id, BATCH, host))
                refused(turn.refused)
                self._spawn(turn)
                for at in (turn.next_token_at, turn.next_due):
                    if at is not None:
                        self._at(at)
                if not (turn.more or self._again):
                    return
        except (errors.DatabaseBusy, errors.StoreUnavailable) as exc:
            log.warning("admission delayed: %s", exc, extra={"action": "admission_delayed"})
        except (errors.HostClosing, errors.HostFenced):
            return

    def _spawn(self, turn: admission.Dequeued) -> None:
        if self._supervisor.closing:  # admitted here: the takeover after the close settles them
            return
        unreadable(turn.unreadable)
        supervisor = self._supervisor
        for child, policy in turn.fresh:
            plan = reservation.plan_of(child, policy)
            plan = reservation.StartPlan(
                child,
                False,
                plan.request,
                plan.preset,
                plan.identity,
                lease_pending=bool(child.lease_id),
                slotted=True,
            )
            supervisor.spawn(child, plan, None)
        self._resuming.wake(turn.resumable)
        moved = [child.id for child, _ in turn.fresh] + [r.child.id for r in turn.resumable]
        if moved or turn.ended:
            self._rt.notices.bump(moved + turn.ended)

    def _at(self, when: float) -> None:
        """Pump again at ``when`` (a rate's next token, a queue timeout, a deadline of
        what nothing runs), unless an earlier turn is due already: one timer, at the
        earliest; the 0.5 s look catches any a later host's commit moved."""
        loop = asyncio.get_running_loop()
        delay = max(0.0, when - self._rt.clock.now()) + 0.001
        if self._timer is not None and not self._timer.cancelled():
            if self._timer.when() <= loop.time() + delay and self._timer.when() > loop.time():
                return
            self._timer.cancel()
        self._timer = loop.call_later(min(delay, 3600.0), self.soon)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _has_work(now: float) -> Callable[[Connection], bool]:
    return lambda conn: admission.has_work(conn, now)


def _store_all(conn: Connection, now: float, policies: Mapping[str, object]) -> None:
    for scope, policy in policies.items():
        admission.stored_policy(conn, now, scope, policy)
