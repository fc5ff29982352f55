"""What SQLite's failures mean: busy (another connection holds the lock), a refusal. A
file is never away nor read-only the way a server is."""

from __future__ import annotations

import sqlite3

_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6  # primary result codes: another connection has the lock


def owns(cause: BaseException) -> bool:
    """Whether ``cause`` is the sqlite3 driver's."""
    return isinstance(cause, sqlite3.Error)


def is_busy(cause: BaseException) -> bool:
    """Another connection holds the lock: the same work may succeed a moment later."""
    return (getattr(cause, "sqlite_errorcode", 0) & 0xFF) in (_SQLITE_BUSY, _SQLITE_LOCKED)


def away(cause: BaseException) -> bool:
    """Never: there is no server to lose."""
    return False


def read_only_server(cause: BaseException) -> bool:
    """Never: there is no server to turn read-only."""
    return False


def refused(cause: BaseException) -> bool:
    """A constraint's refusal (the same statement would fail again)."""
    return isinstance(cause, sqlite3.IntegrityError)
