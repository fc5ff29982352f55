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
import functools
import logging

from delegation import errors
from delegation.engine.runtime import Runtime, Use
from delegation.engine.supervisor import Supervisor
from delegation.usecases import orphans

log = logging.getLogger("delegation.engine")

ADOPT_TRIES, ADOPT_PAUSE_S = 5, 1.0  # an adoption the database refused is tried again


class Adoption:
    """The children of one engine that a lost commit answer left with no run here."""

    def __init__(self, rt: Runtime, supervisor: Supervisor) -> None:
        self._rt = rt
        self._supervisor = supervisor
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
        rt, supervisor = self._rt, self._supervisor
        again, tries = True, 0
        while again:
            self._again = False
            me = rt.instance_id
            try:
                held = await rt.db.read(functools.partial(orphans.held, instance_id=me))
                unrun = supervisor.unrun(held)
                if unrun:
                    supervisor.adopt(await rt.write(Use(orphans.adopt, me, unrun)))
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
