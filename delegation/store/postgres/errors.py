"""What PostgreSQL's failures mean (psycopg's exceptions, SQLSTATEs): busy, a server
away, a refusal. Nothing here imports psycopg: its exceptions are told by module."""

from __future__ import annotations

# Serialization failure, deadlock, lock not available, a lock or statement timeout.
_BUSY = frozenset({"40001", "40P01", "55P03", "57014"})
# The server went away or cannot take us now: shut down (57P01-3), out of connections
# (53300), a primary that turned read-only while it hands over to another (25006: but
# on a reader, whose transactions are read-only, that is the read's own fault), this
# session ended for idling in its transaction (25P03: a host paused inside one); class
# 08 below.
READ_ONLY_SERVER = "25006"
_GONE = frozenset({"57P01", "57P02", "57P03", "53300", "25P03", READ_ONLY_SERVER})
_CONNECTION_ERRORS = frozenset({"OperationalError", "InterfaceError"})
# What a server says when it refuses who connects, not that it is away (libpq's words).
_CONNECT_REFUSALS = (
    "authentication failed",
    "no password supplied",
    "does not exist",
    "permission denied",
    "pg_hba.conf",
    "invalid",
    "not supported",
)
_REFUSALS = frozenset(
    {
        "IntegrityError",
        "UniqueViolation",
        "ForeignKeyViolation",
        "CheckViolation",
        "NotNullViolation",
        "ExclusionViolation",
        "RestrictViolation",
    }
)


def owns(cause: BaseException) -> bool:
    """Whether ``cause`` is psycopg's."""
    return type(cause).__module__.startswith("psycopg") and isinstance(cause, Exception)


def is_busy(cause: BaseException) -> bool:
    return getattr(cause, "sqlstate", None) in _BUSY


def read_only_server(cause: BaseException) -> bool:
    return getattr(cause, "sqlstate", None) == READ_ONLY_SERVER


def away(cause: BaseException) -> bool:
    """Whether psycopg's ``cause`` says the server cannot be reached or cannot take
    writes now (a restart, a failover, a killed backend, a cut network)."""
    if not type(cause).__module__.startswith("psycopg"):
        return False
    state = getattr(cause, "sqlstate", None)
    if state is None:  # libpq's own: no connection, lost, closed, timed out; but a
        # refusal at connect (a wrong password, no such database) is no outage
        if not any(kind.__name__ in _CONNECTION_ERRORS for kind in type(cause).__mro__):
            return False
        return any(not any(word in said for word in _CONNECT_REFUSALS) for said in _attempts(cause))
    return state.startswith("08") or state in _GONE


def _attempts(cause: BaseException) -> list[str]:
    """What libpq said of each server it tried. Through several hosts one may refuse
    who connects (a standby the database has not reached yet: "does not exist") while
    another is only away (restarting, read-only): that is an outage, the same URL
    works once a writable server is back. Only when every one refuses is it none."""
    said = str(cause).lower()
    return said.split("\n- host:")[1:] or [said]


def refused(cause: BaseException) -> bool:
    return type(cause).__name__ in _REFUSALS and type(cause).__module__.startswith("psycopg")
