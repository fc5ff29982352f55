"""Being told that something committed, instead of asking again and again (SPEC §11).

* :class:`Notices`: in-process wake-ups. The store announces the children whose events
  a batch committed, and the engine the children that ended; a follower waits for its
  child's version to move. Nothing polls: a follower sleeps until the commit itself
  wakes it.
* Across processes, each store has its watch (:class:`delegation.store.watch.Watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator

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
