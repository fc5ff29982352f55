"""Being told that something committed, instead of asking again and again (SPEC §11).

* :class:`Notices`: in-process wake-ups. The store announces the children whose events
  a batch committed, and the engine the children that ended; a follower waits for its
  child's version to move. Nothing polls: a follower sleeps until the commit itself
  wakes it.
* :class:`Watch`: across processes, for any store (PostgreSQL's is
  :class:`delegation.store.postgres.PostgresWatch`, ``LISTEN``/``NOTIFY``).
  :class:`FileWatch` is SQLite's. ``PRAGMA data_version`` on one open
  read-only connection changes whenever another connection commits to the file; asking
  it is a few microseconds and reads no table, so a watcher asks it every
  ``interval`` seconds and reads tables only when it moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from delegation import errors


class _Watch:
    __slots__ = ("changed", "count", "version")

    def __init__(self) -> None:
        self.version = 0
        self.count = 0
        self.changed = asyncio.Event()


class Notices:
    """Versions of the children someone follows, bumped on each commit that concerns them."""

    def __init__(self, listen: Callable[[bool], None] | None = None) -> None:
        self._watches: dict[int, _Watch] = {}
        self._closed = False
        # Told True when the first child is followed and False when the last one no
        # longer is: nobody following, nothing need be announced (the commit path).
        self._listen = listen

    def version(self, child_id: int) -> int:
        watch = self._watches.get(child_id)
        return 0 if watch is None else watch.version

    def bump_all(self) -> None:
        """Something of any child may have committed (another host's, unnamed)."""
        self.bump(list(self._watches))

    def bump(self, child_ids: Iterable[int]) -> None:
        """Something of these children committed (only followed ones are kept)."""
        for child_id in child_ids:
            watch = self._watches.get(child_id)
            if watch is not None:
                watch.version += 1
                watch.changed.set()

    def close(self) -> None:
        """The engine closes: every follower wakes (and finds the store closed)."""
        self._closed = True
        for watch in self._watches.values():
            watch.changed.set()

    @contextlib.contextmanager
    def following(self, child_id: int) -> Iterator[None]:
        """Keep ``child_id``'s version while the block runs."""
        if not self._watches and self._listen is not None:
            self._listen(True)
        watch = self._watches.setdefault(child_id, _Watch())
        watch.count += 1
        try:
            yield
        finally:
            watch.count -= 1
            if not watch.count:
                del self._watches[child_id]
                if not self._watches and self._listen is not None:
                    self._listen(False)

    async def moved(self, child_id: int, since: int) -> None:
        """Return once ``child_id``'s version differs from ``since``.

        Raises:
            errors.HostClosing: the engine closed meanwhile.
        """
        watch = self._watches[child_id]
        while watch.version == since:
            if self._closed:
                raise errors.HostClosing("the host closed while following the child")
            watch.changed.clear()
            await watch.changed.wait()
        if self._closed:
            raise errors.HostClosing("the host closed while following the child")


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


class FileWatch(Watch):
    """Commits to a SQLite file, seen through ``PRAGMA data_version``."""

    def __init__(self, path: Path | str, interval: float = 0.05) -> None:
        self.interval = interval
        uri = Path(path).resolve().as_uri() + "?mode=ro"
        self._conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        self._version = self._read()

    def _read(self) -> int:
        (version,) = self._conn.execute("PRAGMA data_version").fetchone()
        return int(version)

    def changed(self) -> bool:
        version = self._read()
        moved, self._version = version != self._version, version
        return moved

    def close(self) -> None:
        self._conn.close()
