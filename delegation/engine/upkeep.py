"""What the timers wake (:mod:`delegation.engine.timers`): lease expiry (design §7) and the
retention sweep. A database busy or away puts either off, never drops it (design §19)."""

from __future__ import annotations

import logging

from delegation import errors
from delegation.engine.runtime import OWED_PAUSE_MAX_S, Runtime, Use
from delegation.engine.supervisor import Supervisor
from delegation.engine.timers import Timers
from delegation.usecases import maintenance

log = logging.getLogger("delegation.engine")


class Upkeep:
    """Lease expiry and retention for one engine."""

    def __init__(self, rt: Runtime, supervisor: Supervisor, timers: Timers) -> None:
        self._rt = rt
        self._supervisor = supervisor
        self._timers = timers

    async def expire_due(self) -> None:
        """Expire every lease past its deadline now, then re-arm at the next deadline.

        The timer calls this; calling it again is harmless (the database is the truth).
        """
        affected, deadline = await self._rt.write(Use(maintenance.expire_due))
        if affected:
            log.info("leases expired", extra={"action": "lease_expired", "children": len(affected)})
        await self._supervisor.stop(affected)
        self._timers.arm(deadline)

    async def expire_on_time(self) -> None:
        """The lease timer: a database busy or away puts the expiry off, never drops it
        (the one-shot timer is armed again; design §19)."""
        try:
            await self.expire_due()
        except (errors.DatabaseBusy, errors.StoreUnavailable) as exc:
            log.warning("leases not expired yet: %s", exc, extra={"action": "expiry_delayed"})
            self._timers.arm(self._rt.clock.now() + OWED_PAUSE_MAX_S)

    async def purge(self) -> int:
        """Purge everything past ``retention_s`` now; returns how many children went."""
        total = 0
        while True:
            count = await self._rt.write(Use(maintenance.purge, self._rt.config.retention_s))
            total += count
            if count < 1000:
                return total

    async def sweep(self) -> None:
        """The retention timer: the next sweep purges what this one could not."""
        try:
            purged = await self.purge()
        except (errors.DatabaseBusy, errors.StoreUnavailable, errors.HostFenced) as exc:
            # The next sweep purges it: retention is late, never lost.
            log.warning("retention sweep put off: %s", exc, extra={"action": "sweep_delayed"})
            return
        if purged:
            log.info("children purged", extra={"action": "retention_purged", "children": purged})
