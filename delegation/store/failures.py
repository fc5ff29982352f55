"""The store's one boundary for failures: SQLAlchemy's and the drivers' exceptions as
domain errors. What each driver's codes mean is its dialect's (``sqlite/errors.py``,
``postgres/errors.py``), carried by its record; this module only asks them, through
:func:`delegation.store.registry.drivers`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from delegation import errors
from delegation.store import registry
from delegation.store.sql import dbapi


def closed() -> errors.StoreError:
    """The refusal of a store used after its close (reads, writes, the host's lock)."""
    return errors.StoreError("child store is closed")


def _cause(exc: BaseException) -> BaseException:
    # SQLAlchemy wraps the driver's errors, but not those raised in its event hooks:
    # a busy BEGIN IMMEDIATE arrives as sqlite3's own error.
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    return cause if cause is not None else exc


def translate(exc: BaseException, *, reading: bool = False) -> errors.DelegationError:
    """SQLAlchemy and driver failures as domain errors; ``reading``: in a read-only
    transaction of ours (a read-only server is then the read's own fault)."""
    if isinstance(exc, errors.DelegationError):
        return exc
    cause = _cause(exc)
    drivers = registry.drivers()
    own = reading and any(driver.read_only_server(cause) for driver in drivers)
    if unavailable(exc) and not own:
        return errors.StoreUnavailable()
    driver = next((d for d in drivers if d.owns(cause)), None)
    if driver is None:
        return errors.InternalError()
    if driver.is_busy(cause):
        return errors.DatabaseBusy(f"child store is busy; retry ({cause})")
    return errors.StoreError(f"child store failed: {cause}")


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server cannot be reached or cannot take writes now: the
    same work may succeed once it is back. A store already closed is not that."""
    if isinstance(exc, errors.StoreUnavailable):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    cause = _cause(exc)
    return any(driver.away(cause) for driver in registry.drivers())


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a constraint's refusal (the same statement would fail again)."""
    cause = getattr(exc, "orig", exc)
    return any(driver.refused(cause) for driver in registry.drivers())


@contextlib.contextmanager
def translated(*, reading: bool = False) -> Iterator[None]:
    """Driver and SQLAlchemy failures inside the block as domain errors (``translate``)."""
    try:
        yield
    except errors.DelegationError:
        raise
    except Exception as exc:
        raise translate(exc, reading=reading) from exc


_waits = threading.local()  # .briefly: statements on this thread wait a lock only briefly


@contextlib.contextmanager
def waiting_briefly() -> Iterator[None]:
    """The block's statements wait for another transaction's lock only briefly (a
    commit on the loop's thread, which the writer runs again if one was busy)."""
    _waits.briefly = True
    try:
        yield
    finally:
        _waits.briefly = False


def waits_briefly() -> bool:
    """Whether this thread's statements now wait for a lock only briefly: a busy
    failure is then the writer's to wait out, not a reason to give up."""
    return bool(getattr(_waits, "briefly", False))


@contextlib.contextmanager
def undone_if_busy(conn: Connection) -> Iterator[None]:
    """The block in a savepoint of ``conn``'s open transaction: if it fails, its writes
    are undone and the transaction goes on; a failure on a row another transaction
    holds (a lock timeout, a deadlock) is raised as :class:`errors.DatabaseBusy`, any
    other as it came."""
    raw = dbapi(conn)
    raw.execute("SAVEPOINT part")
    try:
        yield
    except Exception as exc:
        raw.execute("ROLLBACK TO SAVEPOINT part")
        failure = translate(exc)
        if isinstance(failure, errors.DatabaseBusy):
            raise failure from exc
        raise
    raw.execute("RELEASE SAVEPOINT part")
