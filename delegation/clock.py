"""Time as an argument: the engine asks an injected clock, tests move a manual one."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch."""
        ...


class SystemClock:
    """Wall-clock time; lease deadlines are stored as epoch seconds."""

    def now(self) -> float:
        return time.time()


class ServerClock:
    """Wall-clock time corrected to the database server's (several hosts on one
    database, design §12): lease deadlines and timestamps are the server's, whatever each
    host's own clock says. The offset is measured at boot and at every heartbeat."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return time.time() + self.offset

    def correct(self, server_now: float, sent: float, answered: float) -> None:
        """``server_now`` was read between local times ``sent`` and ``answered``."""
        self.offset = server_now - (sent + answered) / 2


class ManualClock:
    """A clock that only moves when told to: for exact boundary tests."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        self._now += seconds
        return self._now

    def set(self, value: float) -> None:
        self._now = value
