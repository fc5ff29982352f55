"""The streams one socket serves, and the connections each runner holds of them
(design §23, SPEC §31), apart from how a stream is served (:mod:`delegation.host.serve`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol


class Stream(Protocol):
    """A stream as the socket sees it: one that can be told the host stops."""

    def stop(self) -> None: ...


class Streams:
    """The streams one host serves, so that a shutdown can stop them all and wait
    until each has answered (a stream task the event loop would cancel at exit
    instead makes asyncio log a traceback)."""

    def __init__(self) -> None:
        self.sessions: set[Stream] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stopping = False

    def track(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def stop(self) -> None:
        self.stopping = True
        for session in self.sessions:
            session.stop()

    async def wait(self) -> None:
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await asyncio.sleep(0)  # a connection accepted just before the stop


class Runners:
    """The connections each runner holds on one socket, at most ``most`` each: one
    runner's connections cannot lock out another's (SPEC §31)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._held: dict[Stream, str] = {}
        self._counts: dict[str, int] = {}

    def claim(self, session: Stream, runner_id: str) -> bool:
        """Count ``session`` as ``runner_id``'s (a new registration of it moves it);
        False when that runner holds ``most`` connections already."""
        if self._held.get(session) == runner_id:
            return True
        if self._counts.get(runner_id, 0) >= self.most:
            return False
        self.release(session)
        self._held[session] = runner_id
        self._counts[runner_id] = self._counts.get(runner_id, 0) + 1
        return True

    def others(self, session: Stream, runner_id: str) -> list[Stream]:
        """The other connections counted as ``runner_id``'s."""
        return [
            held for held, rid in self._held.items() if rid == runner_id and held is not session
        ]

    def release(self, session: Stream) -> None:
        runner_id = self._held.pop(session, None)
        if runner_id is not None:
            left = self._counts[runner_id] - 1
            if left:
                self._counts[runner_id] = left
            else:
                del self._counts[runner_id]
