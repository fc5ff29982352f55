"""Notices of commits by other connections, other processes too (design §11): the waiting
every store's watch shares. Each dialect answers :meth:`Watch.ask` its own way
(SQLite: :class:`delegation.store.sqlite.watch.FileWatch`; PostgreSQL:
:class:`delegation.store.postgres.watch.PostgresWatch`).

Nothing a watch meets stops the loops that wait on it (design §18): a question that fails
is logged once (until one succeeds again) and answered "something may have moved" once
every ``GUESS_S`` seconds meanwhile, so the watcher reads its tables (which say what is
true) as a slow poll would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("delegation.store")

GUESS_S = 1.0  # while questions fail: how often "something may have moved" is answered


class Watch:
    """Notices of commits by other connections (other processes too): a store's own
    kind answers :meth:`ask`, and the waiting is the same for every store."""

    interval: float = 0.05  # seconds between two questions to :meth:`changed`
    _failing = False  # the last question failed (and that was logged)
    _guessed = 0.0  # time.monotonic() of the last answer given for a failed question

    def changed(self) -> bool:
        """Whether another connection committed since the last call (or since open).

        Never raises: a failed question is logged (the first of a run of failures,
        ``watch_read_failed``) and answered True at most every ``GUESS_S`` (anything
        may have moved meanwhile), False otherwise: never a tight loop of reads."""
        try:
            moved = self.ask()
        except Exception as exc:
            if not self._failing:
                self._failing = True
                log.warning(
                    "database watch failed; reading the tables every %g s instead: %s",
                    GUESS_S,
                    exc,
                    extra={"action": "watch_read_failed"},
                )
            now = time.monotonic()
            if now - self._guessed < GUESS_S:
                return False
            self._guessed = now
            return True
        self._failing = False
        return moved

    def ask(self) -> bool:
        """The store's own answer to :meth:`changed` (it may raise)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def moved(self) -> set[int] | None:
        """The children whose events or end other processes committed since the last
        call, when the store tells (PostgreSQL); None: not known, any may have moved."""
        return None

    def wait_sync(self, timeout: float | None = None) -> bool:
        """Like :meth:`wait`, blocking (for the synchronous inspection tools)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.changed():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self.interval)
        return True

    def until(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Ask ``done`` now and after each commit until it says so (True), or until
        ``timeout`` passes (False): tables are read only when something committed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.wait_sync(left)
        return True

    async def wait(self, timeout: float | None = None) -> bool:
        """Sleep until a commit happened (True) or ``timeout`` passed (False)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self.changed():
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(self.interval)
        return True
