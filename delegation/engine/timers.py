"""Timers, and the only importer of APScheduler (3.x).

The database is the truth; a timer is only a hint to look at it. One job sits at the
earliest lease deadline and calls back the engine, which expires everything due in
one statement and re-arms at the next deadline. A lost or late timer can delay an
expiry, never lose it: the next wake-up, or the next boot, expires whatever is due.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from delegation.clock import Clock

LEASE_JOB = "delegation-lease-expiry"
RETENTION_JOB = "delegation-retention"


class Timers:
    """A lease wake-up at the earliest deadline and a periodic retention sweep."""

    def __init__(
        self,
        clock: Clock,
        expire: Callable[[], Awaitable[None]],
        purge: Callable[[], Awaitable[None]],
        retention_every_s: float,
    ) -> None:
        self._clock = clock
        self._expire = expire
        self._purge = purge
        self._retention_every_s = retention_every_s
        self._scheduler: AsyncIOScheduler | None = None
        self._deadline: float | None = None

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

    def arm(self, deadline: float | None) -> None:
        """Wake the engine just after ``deadline`` (clock seconds); None disarms."""
        scheduler = self._scheduler
        if scheduler is None:
            return
        self._deadline = deadline
        if deadline is None:
            if scheduler.get_job(LEASE_JOB) is not None:
                scheduler.remove_job(LEASE_JOB)
            return
        # A lease is live at exactly its deadline, so wake a little after it; a deadline
        # that is now (or past, by a clock that does not move) is looked at again soon.
        gap = deadline - self._clock.now()
        delay = gap + 0.001 if gap > 0 else 0.05
        scheduler.add_job(
            self._expire,
            "date",
            run_date=datetime.now(UTC) + timedelta(seconds=delay),
            id=LEASE_JOB,
            replace_existing=True,
            coalesce=True,
            max_instances=1,
            misfire_grace_time=None,
        )

    def arm_earlier(self, deadline: float) -> None:
        """Arm for ``deadline`` unless an earlier wake-up is already armed."""
        if self._deadline is None or deadline < self._deadline:
            self.arm(deadline)

    def armed_at(self) -> datetime | None:
        """When the lease wake-up will run, if one is armed (for tests and inspection)."""
        job = self._scheduler.get_job(LEASE_JOB) if self._scheduler else None
        return None if job is None else job.next_run_time

    def stop(self) -> None:
        self._deadline = None
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None
