"""The one way asyncio code reaches the database: the writer, the same on every store.

What SQLite and PostgreSQL do differently is asked of the store's dialect
(:mod:`delegation.store.dialect`); this module holds no SQL of either. What follows
is told in SQLite's words; PostgreSQL's dialect says what it does instead
(:mod:`delegation.store.postgres`).

SQLite has a single writer, so the engine does not fight for the lock: every write
goes through one write connection that commits in batches (group commit). A batch is
one ``BEGIN IMMEDIATE`` transaction holding, in order, every event appended so far
and every queued job; a job that refuses never undoes its neighbours. Futures are
resolved only after the batch's COMMIT returned, so an answer never reports a write
that could still be lost.

Who commits: what the loop queues in one turn is handed over at the end of the turn.
A lone job finding the connection idle is committed right there on the loop's thread
(a round trip to another thread costs more than a small job); anything more goes to
the **writer thread**, which commits while the loop goes on. The loop never waits for
another process's lock: SQLite's busy handler is off on the write connection, and only
the writer thread waits for the lock, up to ``busy_timeout``.

Durability: a batch of only ``durable=False`` jobs commits without waiting for the
disk (the dialect's way). Reads run on the loop's thread (:mod:`.reading`).

Ordering guarantee: a job queued after ``append_event`` commits in the same batch as
that event or a later one. So "flush" is simply an empty job (a barrier), and a
terminal state written after a run's last emit is committed after its events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection, Engine

from delegation import errors
from delegation.store.batch import (
    Outage,
    Pending,
    Queue,
    Redo,
    boot_clock,
    commit_open,
    deliver,
    job_failed,
    report_commit,
    roll_back,
    run_batch,
)
from delegation.store.dialect import Dialect
from delegation.store.events import EventRow
from delegation.store.failures import closed, refused, translate, waiting_briefly
from delegation.store.reading import Reads, healthy
from delegation.store.sql import dbapi
from delegation.store.watch import Watch

log = logging.getLogger("delegation.store")

T = TypeVar("T")


class Database:
    """The engine's store: batched writes on one connection, reads on the loop, composed
    with the dialect of its database (see :func:`delegation.store.stores.open_store`).

    Its capabilities are set once, here, from the dialect: ``shared`` (several hosts),
    ``writes_alone`` (a lone ``one_write`` job commits as its statement's own
    transaction) and ``starts_as_seen`` (a start checks the rows it read in its insert).
    """

    def __init__(self, url: str, dialect: Dialect) -> None:
        self.url = url
        self._dialect = dialect
        self.shared = dialect.shared
        self.writes_alone = dialect.writes_alone
        self.starts_as_seen = dialect.starts_as_seen
        self._queue = Queue()
        self._cond = threading.Condition()
        self._stopping = False
        self._dispatching = False  # a _dispatch is scheduled on the loop
        self._busy = False  # a batch is being committed (by the writer or inline)
        self._claiming = False  # a claim waits for the batch being committed
        self._conn: Connection | None = None  # the write connection, while the writer runs
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._write_engine: Engine | None = None
        self._unflushed_engine: Engine | None = None
        self._unflushed: Connection | None = None
        self._outage = Outage()
        self._reconnected = False  # see reconnected
        self._reads = Reads(dialect.lost)
        self._claimed: str | None = None  # this host's instance (shared): its fence
        self._taken_by: str | None = None  # the fence, as the current transaction read it
        self._alive_until = 0.0  # boot_clock(): until then no host can have taken us over
        # Called on the loop's thread with the ids of children whose events a batch
        # committed: what wakes ``Engine.follow`` without polling.
        self.on_events: Callable[[set[int]], None] | None = None
        # Called after each commit with its seconds and its events (telemetry).
        self.on_commit: Callable[[float, int], None] | None = None
        # Called once on the loop's thread when the database is found replaced (see held).
        self.on_lost: Callable[[errors.DelegationError], None] | None = None
        self._lost = False  # on_lost was told (since open)
        # Called on the loop's thread when a batch commits after the server was away:
        # a commit whose answer was lost meanwhile may have left work undone (§32).
        self.on_back: Callable[[], None] | None = None

    # --- lifecycle --------------------------------------------------------------

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take the database for this host (the dialect: SQLite's file lock; on
        PostgreSQL other hosts may share it, :meth:`claim` names this one), migrate it
        to head, and start the writer.

        Raises:
            errors.HostConflict: another live host holds the file (nothing is written).
            errors.SchemaMismatch: the database is not ours to migrate.
            errors.StoreError: it cannot be opened, reached or written (the dialect's
                reasons).
        """
        self._loop, self._lost = loop, False
        try:
            engines = self._dialect.open()
        except BaseException as exc:
            self.close()
            if not isinstance(exc, Exception) or isinstance(exc, errors.DelegationError):
                raise
            raise translate(exc) from exc
        self._write_engine, self._reads.engine, self._unflushed_engine = engines
        self._start_writer()

    def _start_writer(self) -> None:
        self._stopping = False
        self._dispatching, self._queue = False, Queue()  # nothing of an earlier opening
        self._thread = threading.Thread(target=self._writer_main, name="delegation-writer")
        self._thread.start()

    async def aclose(self) -> None:
        """Commit everything queued and stop the writer (off the loop), then close the
        readers on the loop's thread.

        Reads keep working while the writer drains (a call in flight may still read
        what it wrote); once closed, they are refused with a :class:`errors.StoreError`.
        """
        await asyncio.get_running_loop().run_in_executor(None, self._stop_writer)
        self._reads.close()
        self._dialect.close()

    def close(self) -> None:
        """Like :meth:`aclose`, blocking; call it on the loop's thread."""
        self._stop_writer()
        self._reads.close()
        self._dialect.close()  # last, once no connection of ours is open

    def _stop_writer(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        unflushed, self._unflushed = self._unflushed, None
        if unflushed is not None:
            unflushed.close()
        for engine in (self._write_engine, self._unflushed_engine):
            if engine is not None:
                engine.dispose()
        self._write_engine = self._unflushed_engine = None

    # --- several hosts (a shared store) -------------------------------------------

    def claim(self, instance_id: str) -> None:
        """Hold ``instance_id``'s lock for this host's life (letting go of an earlier
        instance's), and fence every later batch on it: a batch commits only while no
        other host has taken the instance over (``engine_instances.taken_by``). An
        unshared store (SQLite: the file's lock already makes this host the only one)
        does nothing."""
        if not self.shared:
            return
        self._dialect.ready_to_claim(instance_id)
        with self._cond:
            previous, left = self._claimed, Queue()
            if previous is not None:
                # A rejoin: what the earlier instance queued belongs to runs it lost;
                # fenced on the new instance, it would commit (an event beside the
                # taking host's). The batch being committed, fenced on the earlier one,
                # ends first.
                self._claiming = True
                while self._busy:
                    self._cond.wait()
                self._claiming = False  # no batch began meanwhile (the writer waits)
                left, self._queue = self._queue, Queue()
                self._cond.notify_all()
            self._claimed = instance_id
            self._alive_until = 0.0  # fresh once its first heartbeat committed
        if left.jobs or left.events:
            self._refuse(left, errors.HostFenced(f"host instance {previous} was taken over"))
        self._dialect.hold(previous, instance_id)

    def _refuse(self, left: Queue, fenced: errors.HostFenced) -> None:
        for pending in left.jobs:
            pending.ok, pending.value = False, fenced
        deliver(left.jobs, self._loop, inline=False)
        log.info(  # what host_fenced (engine.membership) already says: its runs were lost
            "writes of a taken-over instance dropped",
            extra={"action": "fenced_writes_dropped", "events": len(left.events)},
        )

    def alive_until(self, deadline: float) -> None:
        """Until ``deadline`` (:func:`boot_clock`) no other host can take this one over."""
        with self._cond:
            self._alive_until = deadline

    def keep_lock(self) -> None:
        """Hold this host's lock again if the server let it go (blocking, off the loop)."""
        self._dialect.keep_lock(self._claimed)

    def reconnected(self) -> bool:
        """Whether the writer ever connected again after losing its connection (never
        on SQLite). Read on the writer's thread, in the batch that uses it."""
        return self._reconnected

    def held(self) -> bool:
        """Whether the database is still the one this host opened (the dialect's
        ``verify``); once not, ``on_lost`` is told, once."""
        try:
            self._dialect.verify()
        except errors.DatabaseReplaced as exc:
            self._tell_lost(exc)
            return False
        return True

    def _tell_lost(self, failure: errors.DelegationError) -> None:
        with self._cond:
            told, self._lost = self._lost, True
        if not told and self.on_lost is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
                self._loop.call_soon_threadsafe(self.on_lost, failure)

    def let_go(self) -> None:
        self._dialect.let_go()

    def watch(self, interval: float) -> Watch:
        return self._dialect.watch(interval)

    def protected_paths(self) -> list[str]:
        return self._dialect.protected_paths()

    def secret_paths(self) -> list[str]:
        return self._dialect.secret_paths()

    # --- writing ----------------------------------------------------------------

    async def write(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in the next write batch; return its value once committed.

        Raises what ``fn`` raised (its savepoint rolled back), or a
        :class:`errors.StoreError` when the batch could not commit.
        """
        return await self.submit(fn)

    def submit(
        self,
        fn: Callable[[Connection], T],
        *,
        durable: bool = True,
        committed: Callable[[T], None] | None = None,
        one_write: bool = False,
    ) -> asyncio.Future[T]:
        """Queue ``fn`` for the next write batch; the future resolves after its COMMIT.

        ``durable=False`` is for writes nobody has been told about yet and that a later
        durable commit always follows before anyone is (a start's reservation before
        its admission): a batch of only such jobs commits without waiting for the
        disk, which still survives a crash of the process.

        ``committed`` is called on the loop's thread with ``fn``'s value as soon as the
        commit is known, before the future resolves and whether or not anyone still
        awaits it: what must follow a commit happens even if the caller went away, and
        without waiting a turn of the loop for the future's callbacks.

        ``one_write``: ``fn`` writes with at most one statement and raises nothing after
        it (it may read before and after). A server store may then run it alone as that
        statement's own transaction, without ``BEGIN`` and ``COMMIT`` (SQLite batches it
        as usual).
        """
        if self._loop is None:
            raise closed()
        future: asyncio.Future[T] = self._loop.create_future()
        self._enqueue(Pending(fn, future, durable, committed, one_write))
        return future

    async def barrier(self) -> None:
        """Return once everything queued before this call is committed."""
        assert self._loop is not None
        future: asyncio.Future[None] = self._loop.create_future()
        self._enqueue(Pending(None, future))
        await future

    def append_event(self, row: EventRow) -> None:
        """Queue one event row; it commits with the next batch (dropped once closing,
        as a crash would: only a flush acknowledges events)."""
        with self._cond:
            if self._stopping:
                log.warning("event dropped: the child store is closing")
                return
            self._queue.events.append(row)
            self._cond.notify()

    def _enqueue(self, pending: Pending) -> None:
        with self._cond:
            if self._stopping:
                raise closed()
            self._queue.jobs.append(pending)
            if self._dispatching:
                return
            self._dispatching = True
        assert self._loop is not None
        self._loop.call_soon(self._dispatch)

    def _dispatch(self) -> None:
        """Hand what the loop queued this turn to the writer, or commit it right here.

        A lone job with an idle writer is committed inline: waking the writer thread
        and being woken back costs more than the job itself, and nobody else was
        ready to run meanwhile. Everything else goes to the writer, so that batches
        of many jobs commit while the loop goes on.
        """
        with self._cond:
            self._dispatching = False
            queue = self._queue
            inline = (
                self._conn is not None
                and not self._busy
                and not self._claiming
                and not self._stopping
                and len(queue.jobs) == 1
                and not queue.events
            )
            if not inline:
                self._cond.notify()
                return
            self._busy, self._queue = True, Queue()
        committed = False
        try:
            committed = self._commit_inline(queue)
        finally:
            with self._cond:
                self._busy = False
                if not committed:
                    self._queue.jobs[:0] = queue.jobs
                if self._queue.jobs or self._queue.events or self._stopping or self._claiming:
                    self._cond.notify_all()  # the writer, or a claim waiting for this commit
        if committed:
            deliver(queue.jobs, self._loop, inline=True)

    def _commit_inline(self, batch: Queue) -> bool:
        """Commit ``batch`` on the loop's thread unless another connection holds the
        lock it needs: the loop never waits for a lock, the writer does (False)."""
        assert self._conn is not None
        alone = self._commit_alone(self._conn, batch)
        if alone is not None:
            return alone
        try:
            raw = dbapi(self._conn)
        except Exception:  # invalidated: asked for, it connects again, and the server is away
            return False  # the writer runs it, and says so
        begun, self._taken_by = self._dialect.try_begin(
            raw, relaxed=batch.relaxed(), instance=self._claimed
        )
        if not begun:
            return False
        try:
            with waiting_briefly():
                self._commit_batch(self._conn, batch, begun=True)
        except Redo:
            return False  # undone: the writer runs it again, with savepoints
        return True

    def _commit_alone(self, conn: Connection, batch: Queue) -> bool | None:
        """Commit a lone ``one_write`` job as its statement's own transaction (a store
        that ``writes_alone``): whether it committed (False: the writer runs it), or
        None: not done that way.

        Its reads before that statement see what READ COMMITTED would show them inside
        a transaction: each statement's own snapshot. On a shared database this write
        is fenced by time instead of by the row: it runs so only while this host's last
        heartbeat is recent enough that no host can have declared it dead (see
        alive_until); otherwise it is a guarded batch. What a host paused between that
        check and its statement writes after its takeover is taken over by the next
        heartbeat of a live host (lifecycle.LOST). A ``durable=False`` job (a
        reservation) runs on a second connection that commits without waiting for the
        disk: the admission's durable commit on the main one makes it durable too.
        """
        pending = batch.jobs[0]
        if not self.writes_alone or not pending.one_write or pending.fn is None:
            return None
        if self._claimed is not None and boot_clock() >= self._alive_until:
            return None
        if not pending.durable and self._unflushed_engine is not None:
            try:
                conn = self._unflushed_connection()
            except Exception:  # the server away: the writer runs it, and says so
                return False
        try:
            raw = dbapi(conn)
        except Exception:  # as in _commit_inline
            return False
        if self._dialect.lost(raw) or self._dialect.in_transaction(raw):
            return False
        began = time.perf_counter() if self.on_commit is not None else 0.0
        try:
            pending.ok, pending.value = True, pending.fn(conn)
            # A Core statement began a transaction: commit it now.
            commit_open(conn, raw, self._dialect)
        except Exception as exc:
            with contextlib.suppress(Exception):
                roll_back(conn, raw, self._dialect)
            if isinstance(translate(exc), errors.DatabaseBusy) or self._dialect.lost(raw):
                return False  # nothing was written: the writer runs it, waiting its turn
            job_failed(pending, exc)
        else:
            report_commit(self.on_commit, began, 0)
        return True

    def _unflushed_connection(self) -> Connection:
        """The connection of lone ``durable=False`` commits (used only while ``_busy``)."""
        assert self._unflushed_engine is not None
        if self._unflushed is None:
            self._unflushed = self._unflushed_engine.connect()
        self._unflushed = self._healthy(self._unflushed, self._unflushed_engine)
        return self._unflushed

    def _writer_main(self) -> None:
        assert self._write_engine is not None
        conn = self._write_engine.connect()
        try:
            with self._cond:
                self._conn = conn
            while True:
                with self._cond:
                    while (self._busy or self._claiming) or not (
                        self._queue.jobs or self._queue.events or self._stopping
                    ):
                        self._cond.wait()
                    batch, self._queue = self._queue, Queue()
                    if not batch.jobs and not batch.events:
                        self._conn = None
                        return  # stopping, and nothing left to commit
                    self._busy = True
                committed = False
                try:
                    try:
                        conn = self._healthy(conn)
                    except Exception as exc:  # the server is away: this batch fails
                        with self._cond:
                            self._conn = None  # nothing to commit on inline meanwhile
                        self._failed(batch, exc)
                    else:
                        with self._cond:
                            self._conn = conn
                        committed = self._commit_batch(conn, batch)
                finally:
                    with self._cond:
                        self._busy = False
                        if self._claiming:
                            self._cond.notify_all()  # it waits for this batch to end
                deliver(batch.jobs, self._loop, inline=False)
                if committed and batch.events and self.on_events is not None:
                    self._announce({row.child_id for row in batch.events})
        finally:
            conn.close()

    def _announce(self, child_ids: set[int]) -> None:
        """Tell the loop which children have new committed events (see ``on_events``)."""
        hook, loop = self.on_events, self._loop
        if hook is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody follows
                loop.call_soon_threadsafe(hook, child_ids)

    def _commit_batch(self, conn: Connection, batch: Queue, *, begun: bool = False) -> bool:
        """Commit one batch. Jobs run without savepoints: a job that refuses does so
        before writing, which ``total_changes`` confirms. Only when a job fails after
        writing is the batch undone and run again, each job in its own savepoint.

        ``begun``: the caller already holds the write lock (``BEGIN IMMEDIATE``).
        Returns whether the batch committed.
        """
        try:
            try:
                self._transaction(conn, batch, savepoints=False, begun=begun)
            except Redo:
                if begun:  # inline: the loop must not wait for the lock a second time
                    raise
                self._transaction(conn, batch, savepoints=True, begun=False)
            except Exception as exc:
                # An event a constraint refuses (its child is gone: purged, or never
                # ours) must not fail the jobs beside it: run the batch again, each
                # event and job on its own, dropping only what is refused.
                if begun or not batch.events or not refused(exc):
                    raise
                self._transaction(conn, batch, savepoints=True, begun=False)
            if self._outage.back() and self.on_back is not None and self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
                    self._loop.call_soon_threadsafe(self.on_back)
            return True
        except Redo:
            raise
        except Exception as exc:
            self._failed(batch, exc)
            return False

    def _failed(self, batch: Queue, exc: Exception) -> None:
        """``batch`` did not commit: its jobs fail with ``exc``; its events are kept."""
        failure = self._outage.failed(exc)
        for pending in batch.jobs:
            pending.ok, pending.value = False, failure
        lost = isinstance(failure, errors.DatabaseReplaced)
        if lost:  # told before the jobs' callers are: the engine stops its runs first
            self._tell_lost(failure)
        if batch.events and not lost:
            # Kept for a busy or full database (a lost one would leave a gap in its
            # child's sequence): first in the next batch, after a pause. Given up:
            # closing (one try, as a crash), refused by a constraint (a fault of ours,
            # logged), a fenced host's or a replaced file's (runs it lost).
            fenced = isinstance(failure, errors.HostFenced)
            with self._cond:
                if not self._stopping and not refused(exc) and not fenced:
                    self._queue.events[:0] = batch.events
            if not isinstance(failure, errors.DatabaseBusy):  # busy already waited
                time.sleep(self._outage.pause(failure))

    def _transaction(
        self, conn: Connection, batch: Queue, *, savepoints: bool, begun: bool
    ) -> None:
        """One ``BEGIN`` … ``COMMIT``, issued on the driver's connection itself
        (SQLAlchemy's transaction bookkeeping cost a third of a small batch). A job that
        runs a Core statement joins this transaction (the dialect's ``begin`` hook)."""
        raw = dbapi(conn)
        began = time.perf_counter() if self.on_commit is not None else 0.0
        try:
            if not begun:  # inside: a BEGIN whose fence failed is rolled back too
                self._taken_by = self._dialect.begin(
                    raw, relaxed=batch.relaxed(), instance=self._claimed
                )
            self._guard()
            run_batch(conn, batch, self._dialect.changes, savepoints=savepoints)
            if batch.events:
                self._dialect.announce(raw, {row.child_id for row in batch.events})
            self._dialect.verify()  # last: a file replaced meanwhile gets no commit
            commit_open(conn, raw, self._dialect)
        except BaseException:  # a failed COMMIT too: never leave the write lock held
            roll_back(conn, raw, self._dialect)
            raise
        report_commit(self.on_commit, began, len(batch.events))

    def _guard(self) -> None:
        """Refuse the batch if another host took this instance over (the fence)."""
        if self._taken_by is not None:
            raise errors.HostFenced(
                f"host instance {self._claimed} was taken over by {self._taken_by};"
                " its writes are refused"
            )

    # --- reading ----------------------------------------------------------------

    async def read_now(self, fn: Callable[[Connection], T]) -> T:
        """Like :meth:`read`, each statement on the newest commit (see ``Reads``)."""
        return await self._reads.read_now(fn)

    async def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one read transaction, a consistent snapshot (see ``Reads``)."""
        return await self._reads.read(fn)

    def _healthy(self, conn: Connection, engine: Engine | None = None) -> Connection:
        """``conn``, or a new one of ``engine`` (default: the writer's) if it was lost."""
        engine = engine or self._write_engine
        assert engine is not None
        connected = healthy(conn, engine, self._dialect.lost)
        if connected is not conn and engine is self._write_engine:
            self._reconnected = True
        return connected
