"""Being told that something committed, instead of asking again and again (design §11).

* :class:`Notices`: in-process wake-ups. The store announces the children whose events
  a batch committed, and the engine the children that ended; a follower waits for its
  child's version to move. Nothing polls: a follower sleeps until the commit itself
  wakes it.
* Across processes, each store has its watch (:class:`delegation.store.watch.Watch`).
* :func:`keep_running`: what loops on a watch (the engine's control watcher, the web
  page's) is run again after a pause when it fails, never left dead (design §18).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator

from delegation import errors

log = logging.getLogger("delegation.watch")

RESTART_PAUSE_S = 0.1  # the first pause before a failed loop runs again
RESTART_PAUSE_MAX_S = 5.0  # doubling up to this while it keeps failing


async def keep_running(
    name: str, loop: Callable[[], Awaitable[None]], *, pause: float = RESTART_PAUSE_S
) -> None:
    """Run ``loop()`` until it returns, and again whenever it raises (cancelling this
    is the way to stop it): each failure is logged with its traceback
    (``watch_loop_restarted``, with the loop's ``name``) and the loop runs again after a
    pause: ``pause`` at first, doubling up to ``RESTART_PAUSE_MAX_S`` while each run
    fails within that long."""
    wait = pause
    while True:
        began = asyncio.get_running_loop().time()
        try:
            await loop()
            return
        except Exception:
            log.error(
                "%s failed; running it again in %.1f s",
                name,
                wait,
                exc_info=True,
                extra={"action": "watch_loop_restarted", "loop": name},
            )
        ran = asyncio.get_running_loop().time() - began
        wait = pause if ran > RESTART_PAUSE_MAX_S else wait
        await asyncio.sleep(wait)
        wait = min(wait * 2, RESTART_PAUSE_MAX_S)


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
