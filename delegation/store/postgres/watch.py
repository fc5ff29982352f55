"""PostgreSQL's watch: ``LISTEN delegation``, with a slow poll as a fallback.

Any login that may connect can ``NOTIFY delegation`` with any payload (it needs no
privilege), so a payload is read strictly (design §18): ``c`` (a control request or a
steer), empty (anything may have moved), or child ids, each 1 to 19 ASCII digits,
separated by commas. Anything else counts as "anything may have moved", and is logged
once per watch (``watch_bad_notice``), however many come.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from typing import Any

from delegation import errors
from delegation.store.failures import unavailable
from delegation.store.postgres.admin import CHANNEL
from delegation.store.postgres.connect import connect_error, conninfo
from delegation.store.watch import Watch

log = logging.getLogger("delegation.store")

_WATCH_RETRY_S = 0.25
# What our notices name: child ids, each a positive 64-bit integer (BIGINT's bound).
_IDS = re.compile(r"[0-9]{1,19}(?:,[0-9]{1,19})*")
_MAX_ID = 2**63 - 1


class PostgresWatch(Watch):
    """Notices of commits by other connections: ``LISTEN delegation``, with a poll.

    Only writes that send ``NOTIFY delegation`` are seen at once (events, control
    requests, a child's end); anything else within ``fallback`` seconds, when
    :meth:`changed` says so anyway and the watcher reads its tables again.
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
        self._told = False  # a bad notice was logged (once per watch)
        self._closed = False  # closed: no connection is made again (see ask)

    def _listen(self) -> Any:
        import psycopg

        conn = psycopg.connect(conninfo(self._url, "delegation-watch"), autocommit=True)
        conn.execute(f"LISTEN {CHANNEL}")
        return conn

    def ask(self) -> bool:
        """Whether a notice came since the last call (or the fallback poll is due).

        A lost connection is opened again (and LISTENs again) at most every
        ``_WATCH_RETRY_S``; once it is, everything counts as moved: notices sent
        meanwhile were lost. One that failed otherwise is opened again at once, and
        the failure raised (:meth:`Watch.changed` logs it).

        Raises:
            errors.StoreError: the watch is closed: it connects no more.
        """
        with self._lock:
            if self._closed:  # a late caller must not open a session nobody closes
                raise errors.StoreError("database watch is closed")
            moved = False
            try:
                for notice in self._conn.notifies(timeout=0):
                    moved = True
                    self._note(notice.payload)
            except Exception as exc:
                if unavailable(exc):
                    return self._again()
                # Not an outage (a notice the driver could not decode, say): the
                # connection may be left unusable, so a new one LISTENs, and
                # changed() logs what happened.
                self._retry_at = 0.0
                self._again()
                raise
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
        """Take one notice's payload (see the module for what is read)."""
        if payload == "c":  # a control request or a steer: no child's events
            return
        ids = _ids(payload)
        if ids is None:
            self._bad(payload)
        if not ids or self._moved is None:
            self._moved = None  # too many to name, or not named: any child may have moved
            return
        self._moved.update(ids)

    def _bad(self, payload: str) -> None:
        """Log a notice that is not ours, once per watch: anyone may flood the channel."""
        if not self._told:
            self._told = True
            log.warning(
                "a notice on %s that is not ours, skipped as if any child had moved"
                " (logged once): %r",
                CHANNEL,
                payload[:40],
                extra={"action": "watch_bad_notice"},
            )

    def moved(self) -> set[int] | None:
        with self._lock:
            moved, self._moved = self._moved, set()
        return moved

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.close()


def _ids(payload: str) -> list[int] | None:
    """The child ids a payload names (none for the empty one: look at everything), or
    None when it is not a payload of ours."""
    if not payload:
        return []
    if _IDS.fullmatch(payload) is None:
        return None
    ids = [int(i) for i in payload.split(",")]
    return ids if max(ids) <= _MAX_ID else None
