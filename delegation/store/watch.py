"""Notices of commits by other connections, other processes too (SPEC §11): the waiting
every store's watch shares. Each dialect answers :meth:`Watch.changed` its own way
(SQLite: :class:`delegation.store.sqlite.watch.FileWatch`; PostgreSQL:
:class:`delegation.store.postgres.watch.PostgresWatch`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class Watch:
    """Notices of commits by other connections (other processes too): a store's own
    kind answers :meth:`changed`, and the waiting is the same for every store."""

    interval: float = 0.05  # seconds between two questions to :meth:`changed`

    def changed(self) -> bool:
        """Whether another connection committed since the last call (or since open)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def moved(self) -> set[int] | None:
        """The children whose events other processes committed since the last call,
        when the store tells (PostgreSQL); None: not known, any may have moved."""
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
