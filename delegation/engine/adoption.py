"""Adoption (design §32): once the database is back after an outage, this host runs the
children it holds that no run of it runs, which a commit whose answer was lost left
behind (see :mod:`delegation.usecases.orphans`).

Every spawn of this host happens on the loop, at a commit it saw (a reservation, the
pump's turn, a wake-up, a takeover): so a child this host holds with no run here, as
seen on the loop after the database answered, is one whose commit it never saw. The
store tells the engine when a batch commits after the server was away (``on_back``);
one adoption runs at a time, and again if told meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Sequence

from delegation import errors, machine
from delegation.engine.resuming import Resuming
from delegation.engine.runtime import Runtime, Use, unreadable
from delegation.engine.supervisor import Supervisor
from delegation.usecases import orphans, reservation

log = logging.getLogger("delegation.engine")

ADOPT_TRIES, ADOPT_PAUSE_S = 5, 1.0  # an adoption the database refused is tried again


class Adoption:
    """The children of one engine that a lost commit answer left with no run here."""

    def __init__(self, rt: Runtime, supervisor: Supervisor, resuming: Resuming) -> None:
        self._rt = rt
        self._supervisor = supervisor
        self._resuming = resuming
        self._adopting: asyncio.Task[None] | None = None
        self._again = False

    def back(self) -> None:
        """The store's ``on_back``: look for such children now (again once the running
        look ends, if one runs)."""
        if self._adopting is not None and not self._adopting.done():
            self._again = True
            return
        self._adopting = self._rt.background(self._adopt())

    async def _adopt(self) -> None:
        rt = self._rt
        again, tries = True, 0
        while again:
            self._again = False
            me = rt.instance_id
            try:
                held = await rt.db.read(functools.partial(orphans.held, instance_id=me))
                unrun = self.unrun(held)
                if unrun:
                    self._run(await rt.write(Use(orphans.adopt, me, unrun)))
            except (errors.DatabaseBusy, errors.StoreUnavailable) as exc:
                # Busy, or away again (whose end tells the store's on_back anew): looked
                # at again a few times, a second apart.
                tries += 1
                log.warning("children not adopted yet: %s", exc, extra={"action": "adopt_delayed"})
                if tries >= ADOPT_TRIES:
                    return
                await asyncio.sleep(ADOPT_PAUSE_S)
                continue
            except (errors.HostClosing, errors.HostFenced):
                return
            again = self._again

    def unrun(self, child_ids: Sequence[int]) -> list[int]:
        """Those of ``child_ids`` that no run here runs, none is about to (a takeover's),
        and this host is not closing, cut off or rejoining: a lost commit answer's
        children (design §32). A cut-off stopped runs that nothing runs now, and the
        rejoin after it resumes their children as a new instance: adopted first, each
        would run twice, under the old instance and then the new."""
        if not self._adopts():
            return []
        supervisor = self._supervisor
        return [
            i for i in child_ids if supervisor.runs.get(i) is None and i not in supervisor.to_resume
        ]

    def _adopts(self) -> bool:
        """Whether this host adopts now: it is not closing, cut off or rejoining."""
        return not (self._supervisor.closing or self._rt.cut_off or self._rt.rejoining)

    def _run(self, adopted: orphans.Adopted) -> None:
        """Run the children :func:`orphans.adopt` committed here: each once (a start's
        commit, or the pump's, that spawned one since was answered by it). None if this
        host closes, was cut off or went on as another instance meanwhile: what the
        adoption wrote is the old instance's, which the rejoin's hand-over (or the next
        boot) takes."""
        if not self._adopts() or self._rt.instance_id != adopted.instance_id:
            return
        supervisor = self._supervisor
        if adopted.ended:
            supervisor.ended({machine.Outcome.CANCELLED: len(adopted.ended)})
        unreadable(adopted.unreadable)
        for child, policy in adopted.fresh:
            if not self.unrun([child.id]):
                continue
            plan = dataclasses.replace(
                reservation.plan_of(child, policy),
                replay=False,
                lease_pending=bool(child.lease_id),
                slotted=child.state == machine.State.ADMITTED,  # the queue's turn admitted it
            )
            supervisor.spawn(child, plan, None)
            log.warning(
                "child held here with no run (a commit whose answer was lost): run now",
                extra={"action": "child_adopted", "run_id": child.run_id},
            )
        self._resuming.wake([item for item in adopted.resumable if self.unrun([item.child.id])])
