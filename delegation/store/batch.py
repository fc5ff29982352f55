"""A write batch: the jobs and events the writer commits in one transaction, and how
its jobs' answers reach their callers (see :mod:`delegation.store.database`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from delegation import errors
from delegation.store.dialect import Dialect
from delegation.store.events import EventRow, insert_events
from delegation.store.failures import refused, translate, unavailable
from delegation.store.sql import dbapi

log = logging.getLogger("delegation.store")

Job = Callable[[Connection], Any]


@dataclass(slots=True)
class Pending:
    fn: Job | None
    future: asyncio.Future[Any] | None
    durable: bool = True
    committed: Callable[[Any], None] | None = None  # called with the value on the loop
    one_write: bool = False  # writes with one statement at most (see Database.submit)
    ok: bool = True
    value: Any = None


class Redo(Exception):
    """A job failed after writing: undo the batch and run it with savepoints."""


@dataclass(slots=True)
class Queue:
    jobs: list[Pending] = field(default_factory=list)
    events: list[EventRow] = field(default_factory=list)

    def relaxed(self) -> bool:
        """Whether the batch may commit without waiting for the disk: it holds no event
        and only jobs no one was answered for yet (``durable=False``)."""
        return not (self.events or any(p.durable for p in self.jobs))


def boot_clock() -> float:
    """Seconds on a clock that keeps counting while the process is stopped (SIGSTOP) or
    the machine sleeps: what a host's heartbeat freshness is measured on (the writer
    fences a lone write on it, see ``Database.alive_until``)."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


def report_commit(hook: Callable[[float, int], None] | None, began: float, events: int) -> None:
    """Tell ``hook`` (the store's ``on_commit``, if set) of a transaction that committed;
    a fault of the hook is logged, never taken for the commit's own."""
    if hook is None:
        return
    try:
        hook(time.perf_counter() - began, events)
    except Exception:
        log.exception("commit hook failed", extra={"action": "commit_hook_failed"})


def commit_open(conn: Connection, raw: Any, dialect: Dialect) -> None:
    """Commit the transaction open on ``conn``: through SQLAlchemy if a Core statement
    began it (the dialect's ``begin`` hook), else on ``raw``, the driver's connection
    taken before the work (SQLAlchemy refuses to hand out an invalidated one)."""
    if conn.in_transaction():
        conn.commit()
    elif dialect.in_transaction(raw):
        raw.execute("COMMIT")


def roll_back(conn: Connection, raw: Any, dialect: Dialect) -> None:
    """Roll back whatever transaction is open on ``conn`` (SQLAlchemy's) or ``raw``.

    SQLAlchemy's rollback is called even when ``conn`` reports no transaction: a COMMIT
    that lost the connection leaves one it refuses every later use for until rolled
    back (``PendingRollbackError``); with none, the call does nothing."""
    conn.rollback()
    if not dialect.lost(raw) and dialect.in_transaction(raw):
        raw.execute("ROLLBACK")


def job_failed(pending: Pending, exc: Exception) -> None:
    """``pending``'s job raised ``exc``: its caller gets the domain error; a fault of
    ours (not a refusal) is logged with its traceback."""
    pending.ok, pending.value = False, translate(exc)
    if not isinstance(exc, errors.DelegationError) and not unavailable(exc):
        log.error("write job failed", extra={"action": "write_job_failed"}, exc_info=exc)


def run_batch(
    conn: Connection,
    batch: Queue,
    changes: Callable[[Any], int | None],
    *,
    savepoints: bool,
) -> None:
    """The batch's events, then its jobs, in the open transaction. Without savepoints a
    job that failed after writing (``changes``: rows changed on the driver's connection
    so far, None: not known) raises :class:`Redo`: the caller undoes the batch."""
    raw = dbapi(conn)
    if batch.events and savepoints:
        insert_events_apart(conn, batch)
    elif batch.events:
        insert_events(conn, batch.events)
    for pending in batch.jobs:
        if pending.fn is None:
            continue
        if savepoints:
            raw.execute("SAVEPOINT job")
        before = changes(raw)
        try:
            pending.ok, pending.value = True, pending.fn(conn)
        except Exception as exc:
            job_failed(pending, exc)
            if savepoints:
                raw.execute("ROLLBACK TO SAVEPOINT job")
            elif before is None or changes(raw) != before:
                raise Redo() from exc  # it may have written: undo, use savepoints
        if savepoints:
            raw.execute("RELEASE SAVEPOINT job")


def insert_events_apart(conn: Connection, batch: Queue) -> None:
    """The batch's events in a savepoint; if a constraint refuses them, each in its
    own, the refused ones dropped and logged (they would fail every later batch)."""
    raw = dbapi(conn)
    raw.execute("SAVEPOINT events")
    try:
        insert_events(conn, batch.events)
    except Exception as exc:
        raw.execute("ROLLBACK TO SAVEPOINT events")
        if not refused(exc):
            raise
        kept = []
        for row in batch.events:
            raw.execute("SAVEPOINT event")
            try:
                insert_events(conn, [row])
            except Exception as one:
                raw.execute("ROLLBACK TO SAVEPOINT event")
                if not refused(one):
                    raise
                log.warning(
                    "event refused and dropped: child %d sequence %d",
                    row.child_id,
                    row.sequence,
                    extra={"action": "event_dropped", "child_id": row.child_id},
                )
            else:
                kept.append(row)
            raw.execute("RELEASE SAVEPOINT event")
        batch.events[:] = kept  # what committed: whose followers are told
    raw.execute("RELEASE SAVEPOINT events")


def resolve(batch: list[Pending]) -> None:
    """Answer the jobs of a batch that is over, on the loop's thread."""
    for pending in batch:
        if pending.ok and pending.committed is not None:
            try:
                pending.committed(pending.value)
            except Exception:
                log.exception("commit hook failed", extra={"action": "commit_hook_failed"})
        future = pending.future
        if future is None or future.done():
            continue
        if pending.ok:
            future.set_result(pending.value)
        else:
            future.set_exception(pending.value)


_RETRY_PAUSE_S = 0.05  # before events that failed to commit are tried again
_AWAY_PAUSE_MAX_S = 0.4  # the longest pause between tries while the server is away


def deliver(jobs: list[Pending], loop: asyncio.AbstractEventLoop | None, *, inline: bool) -> None:
    """Answer a batch's jobs: right here (``inline``: on the loop's own thread), or on
    ``loop`` from the writer's thread (None: the loop closed, nobody waits). A refused
    background job is logged (below a warning when fenced: the host says so once,
    ``host_fenced``; it was a lost run's)."""
    for pending in jobs:
        if pending.future is None and not pending.ok:
            fenced = isinstance(pending.value, errors.HostFenced)
            log.log(
                logging.DEBUG if fenced else logging.WARNING,
                "background write refused: %s",
                pending.value,
                extra={"action": "background_write_refused"},
            )
    waiting = [p for p in jobs if p.future is not None]
    if not waiting:
        return
    if inline:
        resolve(waiting)
    elif loop is not None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(resolve, waiting)


class Outage:
    """Whether the server was found away and no batch committed since: said once per
    outage, not once per batch, and the pause before failed events are tried again."""

    def __init__(self) -> None:
        self._away = False
        self._pause = _RETRY_PAUSE_S

    def failed(self, exc: Exception) -> errors.DelegationError:
        """A batch failed with ``exc``: the domain error its jobs get (logged)."""
        failure = translate(exc)
        if isinstance(failure, errors.DatabaseReplaced):
            return failure  # the engine says so, once
        if isinstance(failure, errors.HostFenced):
            # Expected once another host took this one over: the host says so once
            # (``host_fenced``, engine.membership) and its runs stop; no traceback.
            log.debug("write batch fenced: %s", failure, extra={"action": "write_batch_fenced"})
        elif not isinstance(failure, errors.StoreUnavailable):
            log.error("write batch failed", extra={"action": "write_batch_failed"}, exc_info=exc)
        elif not self._away:
            self._away = True
            log.warning(
                "the database is unavailable: writes are refused until it is back (%s)",
                exc,
                extra={"action": "store_unavailable"},
            )
        return failure

    def back(self) -> bool:
        """A batch committed: if the server was away, say it is back (True)."""
        self._pause = _RETRY_PAUSE_S
        if not self._away:
            return False
        self._away = False
        log.warning("the database is back: writing again", extra={"action": "store_back"})
        return True

    def pause(self, failure: errors.DelegationError) -> float:
        """Seconds before events that failed are tried again: while the server is away,
        a pause that doubles up to ``_AWAY_PAUSE_MAX_S`` (so a restart is noticed within
        about that), else ``_RETRY_PAUSE_S``."""
        if not isinstance(failure, errors.StoreUnavailable):
            self._pause = _RETRY_PAUSE_S
            return _RETRY_PAUSE_S
        pause, self._pause = self._pause, min(self._pause * 2, _AWAY_PAUSE_MAX_S)
        return pause
