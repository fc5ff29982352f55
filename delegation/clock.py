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
