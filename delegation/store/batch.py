"""A write batch: the jobs and events the writer commits in one transaction, and how
its jobs' answers reach their callers (see :mod:`delegation.store.database`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from delegation import errors
from delegation.store import dbapi
from delegation.store.events import EventRow, insert_events
from delegation.store.failures import refused, translate, unavailable

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
