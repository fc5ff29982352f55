"""What SQLite's failures mean: busy (another connection holds the lock), a refusal."""

from __future__ import annotations

import sqlite3

_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6  # primary result codes: another connection has the lock


def owns(cause: BaseException) -> bool:
    """Whether ``cause`` is the sqlite3 driver's."""
    return isinstance(cause, sqlite3.Error)


def is_busy(exc: BaseException) -> bool:
    """Another connection holds the lock: the same work may succeed a moment later."""
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in (_SQLITE_BUSY, _SQLITE_LOCKED)


def refused(cause: BaseException) -> bool:
    """A constraint's refusal (the same statement would fail again)."""
    return isinstance(cause, sqlite3.IntegrityError)
