"""Timers, and the only importer of APScheduler (3.x).

The database is the truth; a timer is only a hint to look at it. One job sits at the
earliest lease deadline and calls back the engine, which expires everything due in
one statement and re-arms at the next deadline; another at the earliest time one of
this host's waiting children wakes (design §21), the same way. A lost or late timer can
delay an expiry or a wake, never lose it: the next wake-up, the host's once-a-second
look, or the next boot acts on whatever is due.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from delegation.clock import Clock

LEASE_JOB = "delegation-lease-expiry"
WAKE_JOB = "delegation-wake"
RETENTION_JOB = "delegation-retention"


class Timers:
    """A lease wake-up at the earliest deadline, a wake-up of waiting children, and a
    periodic retention sweep."""

    def __init__(
        self,
        clock: Clock,
        expire: Callable[[], Awaitable[None]],
        purge: Callable[[], Awaitable[None]],
        retention_every_s: float,
        wake: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._clock = clock
        self._jobs: dict[str, Callable[[], Awaitable[None]]] = {LEASE_JOB: expire}
        if wake is not None:
            self._jobs[WAKE_JOB] = wake
        self._purge = purge
        self._retention_every_s = retention_every_s
        self._scheduler: AsyncIOScheduler | None = None
        self._deadlines: dict[str, float | None] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduler = AsyncIOScheduler(event_loop=loop, timezone=UTC)
        self._scheduler.start()
        self._scheduler.add_job(
            self._purge,
            "interval",
            seconds=self._retention_every_s,
            id=RETENTION_JOB,
            coalesce=True,
            max_instances=1,
            misfire_grace_time=None,
        )

    def arm(self, deadline: float | None, job: str = LEASE_JOB) -> None:
        """Wake the engine just after ``deadline`` (clock seconds) for ``job``; None
        disarms it."""
        scheduler = self._scheduler
        if scheduler is None:
            return
        self._deadlines[job] = deadline
        if deadline is None:
            if scheduler.get_job(job) is not None:
                scheduler.remove_job(job)
            return
        # A lease is live at exactly its deadline, so wake a little after it; a deadline
        # that is now (or past, by a clock that does not move) is looked at again soon.
        gap = deadline - self._clock.now()
        delay = gap + 0.001 if gap > 0 else 0.05
        scheduler.add_job(
            self._jobs[job],
            "date",
            run_date=datetime.now(UTC) + timedelta(seconds=delay),
            id=job,
            replace_existing=True,
            coalesce=True,
            max_instances=1,
            misfire_grace_time=None,
        )

    def arm_earlier(self, deadline: float, job: str = LEASE_JOB) -> None:
        """Arm ``job`` for ``deadline`` unless an earlier wake-up is already armed."""
        armed = self._deadlines.get(job)
        if armed is None or deadline < armed:
            self.arm(deadline, job)

    def armed_at(self, job: str = LEASE_JOB) -> datetime | None:
        """When ``job`` will run, if it is armed (for tests and inspection)."""
        found = self._scheduler.get_job(job) if self._scheduler else None
        return None if found is None else found.next_run_time

    def stop(self) -> None:
        self._deadlines.clear()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None
