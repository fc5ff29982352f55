"""PostgreSQL's watch: ``LISTEN delegation``, with a slow poll as a fallback."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from delegation.store.failures import unavailable
from delegation.store.postgres.admin import CHANNEL
from delegation.store.postgres.connect import connect_error, libpq
from delegation.store.watch import Watch

_WATCH_RETRY_S = 0.25


class PostgresWatch(Watch):
    """Notices of commits by other connections: ``LISTEN delegation``, with a poll.

    Only writes that send ``NOTIFY delegation`` are seen at once (events, control
    requests); anything else within ``fallback`` seconds, when :meth:`changed` says
    so anyway and the watcher reads its tables again.
    """

    def __init__(self, url: str, interval: float = 0.05, fallback: float = 1.0) -> None:
        import psycopg

        self.interval = interval
        self._fallback = fallback
        self._lock = threading.Lock()
        self._url = url
        try:
            self._conn = self._listen()
        except psycopg.Error as exc:
            raise connect_error(url, exc) from exc
        self._polled = time.monotonic()
        self._retry_at = 0.0  # while the server is away: when to connect again
        self._moved: set[int] | None = set()

    def _listen(self) -> Any:
        import psycopg

        conn = psycopg.connect(
            libpq(self._url), autocommit=True, application_name="delegation-watch"
        )
        conn.execute(f"LISTEN {CHANNEL}")
        return conn

    def changed(self) -> bool:
        """Whether a notice came since the last call (or the fallback poll is due).

        A lost connection is opened again (and LISTENs again) at most every
        ``_WATCH_RETRY_S``; once it is, everything counts as moved: notices sent
        meanwhile were lost."""
        with self._lock:
            moved = False
            try:
                for notice in self._conn.notifies(timeout=0):
                    moved = True
                    self._note(notice.payload)
            except Exception as exc:
                if not unavailable(exc):
                    raise
                return self._again()
            now = time.monotonic()
            if moved or now - self._polled >= self._fallback:
                self._polled = now
                return True
            return False

    def _again(self) -> bool:
        """Connect and LISTEN again (under ``_lock``); whether it worked."""
        now = time.monotonic()
        if now < self._retry_at:
            return False
        self._retry_at = now + _WATCH_RETRY_S
        with contextlib.suppress(Exception):
            self._conn.close()
        try:
            self._conn = self._listen()
        except Exception as exc:
            if not unavailable(exc):
                raise
            return False
        self._moved, self._polled = None, now
        return True

    def _note(self, payload: str) -> None:
        if payload == "c":  # a control request or a steer: no child's events
            return
        if not payload or self._moved is None:
            self._moved = None  # too many to name: any child may have moved
            return
        self._moved.update(int(i) for i in payload.split(",") if i.isdigit())

    def moved(self) -> set[int] | None:
        with self._lock:
            moved, self._moved = self._moved, set()
        return moved

    def close(self) -> None:
        with self._lock:
            self._conn.close()
