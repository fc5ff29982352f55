"""The one way asyncio code reaches SQLite.

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

Durability: batches commit at the configured ``synchronous`` level (``FULL``), except
a batch of only ``durable=False`` jobs -- writes nobody has been answered for, which a
synced commit always follows before anyone is -- which commits at ``NORMAL``: it
survives a crash of the process, and only a power loss before the next synced commit
could undo it.

Reads run inline on the loop's thread, on a connection of their own (WAL readers see
only committed data and never wait for the writer).

Ordering guarantee: a job queued after ``append_event`` commits in the same batch as
that event or a later one. So "flush" is simply an empty job (a barrier), and a
terminal state written after a run's last emit is committed after its events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DBAPIError

from delegation import errors
from delegation.store import dbapi, migrate
from delegation.store.events import EventRow, insert_events
from delegation.store.hostlock import HostLock
from delegation.watch import FileWatch, Watch

log = logging.getLogger("delegation.store")

T = TypeVar("T")
Job = Callable[[Connection], Any]
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6  # primary result codes: another connection has the lock
_RETRY_PAUSE_S = 0.05  # before events that failed to commit are tried again
_AWAY_PAUSE_MAX_S = 0.4  # the longest pause between tries while the server is away
_SQLITE_MIN = (3, 35, 5)  # UPDATE ... RETURNING, with the fixes of 3.35.5
_BUSY_PAUSE_MAX_S = 0.05  # the longest pause between two tries of a busy BEGIN
_POSTGRES_BUSY = frozenset({"40001", "40P01", "55P03", "57014"})
# The server went away or cannot take us now: shut down (57P01-3), out of connections
# (53300), a primary that turned read-only while it hands over to another (25006: but
# on a reader, whose transactions are read-only, that is the read's own fault); class
# 08 below.
_READ_ONLY_SERVER = "25006"
_POSTGRES_GONE = frozenset({"57P01", "57P02", "57P03", "53300", _READ_ONLY_SERVER})
_PSYCOPG_CONNECTION_ERRORS = frozenset({"OperationalError", "InterfaceError"})
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
_POSTGRES_REFUSALS = frozenset(
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

# WAL at NORMAL survives a crash of the process; only a power loss can undo its last
# commits, and the next synced commit makes them durable too (the WAL is one file).
_RELAXED = {"FULL": "NORMAL", "EXTRA": "NORMAL"}


@dataclass(slots=True)
class _Pending:
    fn: Job | None
    future: asyncio.Future[Any] | None
    durable: bool = True
    committed: Callable[[Any], None] | None = None  # called with the value on the loop
    one_write: bool = False  # writes with one statement at most (see submit)
    ok: bool = True
    value: Any = None


class _Redo(Exception):
    """A job failed after writing: undo the batch and run it with savepoints."""


@dataclass(slots=True)
class _Queue:
    jobs: list[_Pending] = field(default_factory=list)
    events: list[EventRow] = field(default_factory=list)


def boot_clock() -> float:
    """Seconds on a clock that keeps counting while the process is stopped (SIGSTOP) or
    the machine sleeps: what a host's heartbeat freshness is measured on."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


def sqlite_path(url: str) -> Path:
    """The file behind a ``sqlite:///`` URL; in-memory databases are refused."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url[len(prefix) :] in ("", ":memory:"):
        raise ValueError("delegation needs a SQLite file URL such as sqlite:///delegation.db")
    path, _, query = url[len(prefix) :].partition("?")
    # With uri=true SQLite opens the file a "file:" URI names, not this path: the host
    # lock would be taken on another file (a second host on a live one).
    if "uri" in {key.lower() for key in parse_qs(query, keep_blank_values=True)}:
        raise ValueError("delegation needs a plain SQLite file URL, not a file: URI")
    return Path(path)


def _make_engine(
    url: str, *, begin: str, pragmas: dict[str, str], pool_size: int, shared: bool = False
) -> Engine:
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=0,
        pool_pre_ping=False,
        connect_args={"check_same_thread": False} if shared else {},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # We issue BEGIN ourselves (below), so pysqlite must not start its own.
        dbapi_connection.isolation_level = None
        # The portable default, whatever this build allows: code that works here must
        # work on every SQLite (the store splits long id lists, see ``chunks``).
        dbapi_connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 32_766)
        cursor = dbapi_connection.cursor()
        for name, value in pragmas.items():
            cursor.execute(f"PRAGMA {name}={value}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        raw = dbapi(conn)
        if not raw.in_transaction:  # the writer may have begun it already
            raw.execute(begin)

    return engine


def translate(exc: BaseException, *, reading: bool = False) -> errors.DelegationError:
    """SQLAlchemy and sqlite3 failures as domain errors (the store's one boundary);
    ``reading``: in a read-only transaction of ours."""
    if isinstance(exc, errors.DelegationError):
        return exc
    # SQLAlchemy wraps the driver's errors, but not those raised in its event hooks:
    # a busy BEGIN IMMEDIATE (see ``_on_begin``) arrives as sqlite3's own error.
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    own = reading and getattr(cause, "sqlstate", None) == _READ_ONLY_SERVER
    if unavailable(exc) and not own:
        return errors.StoreUnavailable()
    if isinstance(cause, sqlite3.Error):
        busy = _is_busy(cause)
    elif type(cause).__module__.startswith("psycopg") and isinstance(cause, Exception):
        # Serialization failure, deadlock, lock not available, a lock or statement timeout.
        busy = getattr(cause, "sqlstate", None) in _POSTGRES_BUSY
    else:
        return errors.InternalError()
    if busy:
        return errors.DatabaseBusy(f"child store is busy; retry ({cause})")
    return errors.StoreError(f"child store failed: {cause}")


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server cannot be reached or cannot take writes now (a
    restart, a failover, a killed backend, a cut network): the same work may succeed
    once it is back. A store already closed is not that."""
    if isinstance(exc, errors.StoreUnavailable):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    if not type(cause).__module__.startswith("psycopg"):
        return False
    state = getattr(cause, "sqlstate", None)
    if state is None:  # libpq's own: no connection, lost, closed, timed out; but a
        # refusal at connect (a wrong password, no such database) is no outage
        said = str(cause).lower()
        return not any(word in said for word in _CONNECT_REFUSALS) and any(
            kind.__name__ in _PSYCOPG_CONNECTION_ERRORS for kind in type(cause).__mro__
        )
    return state.startswith("08") or state in _POSTGRES_GONE


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a constraint's refusal (the same statement would fail again)."""
    cause = getattr(exc, "orig", exc)
    return isinstance(cause, sqlite3.IntegrityError) or (
        type(cause).__name__ in _POSTGRES_REFUSALS and type(cause).__module__.startswith("psycopg")
    )


def _is_busy(exc: sqlite3.Error) -> bool:
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in (_SQLITE_BUSY, _SQLITE_LOCKED)


class Database:
    """SQLite for the engine: batched writes on one connection, WAL reads on the loop."""

    def __init__(self, url: str, *, synchronous: str = "FULL", busy_timeout_ms: int = 5000) -> None:
        self.url = url
        self.path = sqlite_path(url)
        synchronous = synchronous.upper()
        # Batches that hold nothing anyone was told about commit without the sync.
        self._levels = {True: synchronous, False: _RELAXED.get(synchronous, synchronous)}
        self._pragmas = {
            "journal_mode": "WAL",
            "synchronous": synchronous,
            "busy_timeout": str(busy_timeout_ms),
            "foreign_keys": "ON",
        }
        self._busy_timeout_s = busy_timeout_ms / 1000
        self._init_state()

    def _init_state(self) -> None:
        self._queue = _Queue()
        self._cond = threading.Condition()
        self._stopping = False
        self._dispatching = False  # a _dispatch is scheduled on the loop
        self._busy = False  # a batch is being committed (by the writer or inline)
        self._claiming = False  # a claim waits for the batch being committed (PostgreSQL)
        self._conn: Connection | None = None  # the write connection, while the writer runs
        self._level = self._levels[True]
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._write_engine: Engine | None = None
        self._read_engine: Engine | None = None
        self._away_pause = _RETRY_PAUSE_S
        self._away = False  # the server was found away, and no batch committed since
        self._reconnected = False  # see reconnected
        self._reader: Connection | None = None
        self._lock: HostLock | None = None
        # Called on the loop's thread with the ids of children whose events a batch
        # committed: what wakes ``Engine.follow`` without polling.
        self.on_events: Callable[[set[int]], None] | None = None
        # Called after each commit with its seconds and its events (telemetry).
        self.on_commit: Callable[[float, int], None] | None = None

    # --- lifecycle --------------------------------------------------------------

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Create the file if needed, migrate it to head, and start the writer.

        The file is locked for this host's life first (SPEC §9): a second host on it,
        in any process, is refused before anything is read or written.

        Raises:
            errors.HostConflict: another live host holds the file (nothing is written).
            errors.SchemaMismatch: the file is not ours to migrate (nothing is written).
            errors.StoreError: its directory is missing; SQLite cannot open or write the
                file, cannot keep it in WAL mode, or is older than 3.35.5.
        """
        if sqlite3.sqlite_version_info < _SQLITE_MIN:
            raise errors.StoreError(
                f"delegation needs SQLite 3.35.5 or newer; this Python has {sqlite3.sqlite_version}"
            )
        self._loop = loop
        self._lock = HostLock.acquire(self.path)
        try:
            check_file(self.url)
            self._lock.restrict_modes()  # only now: another application's file keeps its mode
        except BaseException:
            self.close()
            raise
        self._write_engine = _make_engine(
            self.url,
            begin="BEGIN IMMEDIATE",
            # SQLite's busy handler would make an inline commit wait on the loop's
            # thread: it is off on every write connection, and the writer thread waits
            # for the lock itself (``_begin``); only the migration below waits in it.
            pragmas={**self._pragmas, "busy_timeout": "0"},
            pool_size=1,
            shared=True,  # the writer thread's, lent to the loop while the writer idles
        )
        read_pragmas = {**self._pragmas, "query_only": "ON"}
        del read_pragmas["journal_mode"]
        self._read_engine = _make_engine(self.url, begin="BEGIN", pragmas=read_pragmas, pool_size=1)
        try:
            with self._write_engine.connect() as conn:  # the pool's one connection
                raw = dbapi(conn)
                # Without WAL, a COMMIT would wait for readers, which nothing here does.
                (mode,) = raw.execute("PRAGMA journal_mode").fetchone()
                if str(mode).lower() != "wal":
                    raise errors.StoreError(
                        f"delegation needs SQLite's WAL journal mode; {self.path} is in"
                        f" {mode} mode (a file system without shared memory?)"
                    )
                raw.execute(f"PRAGMA busy_timeout={self._pragmas['busy_timeout']}")
                try:
                    migrate.upgrade(conn)
                finally:
                    raw.execute("PRAGMA busy_timeout=0")
        except BaseException as exc:
            self.close()
            if not isinstance(exc, Exception):
                raise
            raise translate(exc) from exc
        self._start_writer()

    def _start_writer(self) -> None:
        self._stopping = False
        self._dispatching, self._queue = False, _Queue()  # nothing of an earlier opening
        self._thread = threading.Thread(target=self._writer_main, name="delegation-writer")
        self._thread.start()

    async def aclose(self) -> None:
        """Commit everything queued and stop the writer (off the loop), then close the
        readers on the loop's thread.

        Reads keep working while the writer drains (a call in flight may still read
        what it wrote); once closed, they are refused with a :class:`errors.StoreError`.
        """
        await asyncio.get_running_loop().run_in_executor(None, self._stop_writer)
        self._close_readers()
        self._release_lock()

    def close(self) -> None:
        """Like :meth:`aclose`, blocking; call it on the loop's thread."""
        self._stop_writer()
        self._close_readers()
        self._release_lock()

    def _release_lock(self) -> None:
        # Last, once no connection of ours is open: closing the lock's descriptor drops
        # the POSIX locks SQLite holds on the file in this process.
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _stop_writer(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._write_engine is not None:
            self._write_engine.dispose()
            self._write_engine = None

    def _close_readers(self) -> None:
        # The read connection belongs to the loop's thread: closing it from another
        # thread while the loop reads on it corrupts SQLAlchemy's state or crashes.
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        if self._read_engine is not None:
            self._read_engine.dispose()
            self._read_engine = None

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
            raise errors.StoreError("child store is closed")
        future: asyncio.Future[T] = self._loop.create_future()
        self._enqueue(_Pending(fn, future, durable, committed, one_write))
        return future

    def write_nowait(self, fn: Job) -> None:
        """Queue ``fn`` without waiting; a failure is logged, never raised."""
        try:
            self._enqueue(_Pending(fn, None))
        except errors.StoreError as exc:
            log.warning("background write dropped: %s", exc)

    async def barrier(self) -> None:
        """Return once everything queued before this call is committed."""
        assert self._loop is not None
        future: asyncio.Future[None] = self._loop.create_future()
        self._enqueue(_Pending(None, future))
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

    def _enqueue(self, pending: _Pending) -> None:
        with self._cond:
            if self._stopping:
                raise errors.StoreError("child store is closed")
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
            self._busy, self._queue = True, _Queue()
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
            self._deliver(queue.jobs, inline=True)

    def _commit_inline(self, batch: _Queue) -> bool:
        """Commit ``batch`` on the loop's thread unless another process holds the write
        lock: the loop never waits for the lock, the writer does (False)."""
        assert self._conn is not None
        raw = dbapi(self._conn)
        alone = self._commit_alone(self._conn, batch)
        if alone is not None:
            return alone
        self._synchronous(self._conn, batch)
        if not self._try_begin(raw):
            return False
        try:
            self._commit_batch(self._conn, batch, begun=True)
        except _Redo:
            return False  # undone: the writer runs it again, with savepoints
        return True

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
                    batch, self._queue = self._queue, _Queue()
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
                self._deliver(batch.jobs, inline=False)
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

    def _commit_batch(self, conn: Connection, batch: _Queue, *, begun: bool = False) -> bool:
        """Commit one batch. Jobs run without savepoints: a job that refuses does so
        before writing, which ``total_changes`` confirms. Only when a job fails after
        writing is the batch undone and run again, each job in its own savepoint.

        ``begun``: the caller already holds the write lock (``BEGIN IMMEDIATE``).
        Returns whether the batch committed.
        """
        try:
            if not begun:
                self._synchronous(conn, batch)
            try:
                self._transaction(conn, batch, savepoints=False, begun=begun)
            except _Redo:
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
            self._back()
            return True
        except _Redo:
            raise
        except Exception as exc:
            self._failed(batch, exc)
            return False

    def _failed(self, batch: _Queue, exc: Exception) -> None:
        """``batch`` did not commit: its jobs fail with ``exc``; its events are kept."""
        failure = translate(exc)
        if not isinstance(failure, errors.StoreUnavailable):
            log.error("write batch failed", extra={"action": "write_batch_failed"}, exc_info=exc)
        elif not self._away:  # once per outage, not once per batch
            self._away = True
            log.warning(
                "the database is unavailable: writes are refused until it is back (%s)",
                exc,
                extra={"action": "store_unavailable"},
            )
        for pending in batch.jobs:
            pending.ok, pending.value = False, failure
        if batch.events:
            # Events are not lost to a busy or full database (a lost one would leave
            # a gap in its child's sequence): they go first in the next batch, after
            # a pause so a lasting failure is not retried in a tight loop. Closing,
            # they are given up after one try, as a crash would.
            # An event a constraint refuses would fail every batch after it: it is
            # dropped (a fault of ours, logged above), never retried.
            # A fenced host's events belong to runs it lost: they are never written.
            fenced = isinstance(failure, errors.HostFenced)
            with self._cond:
                if not self._stopping and not refused(exc) and not fenced:
                    self._queue.events[:0] = batch.events
            if not isinstance(failure, errors.DatabaseBusy):  # busy already waited
                time.sleep(self._pause(failure))

    def _back(self) -> None:
        """A batch committed: if the server was away, say it is back."""
        self._away_pause = _RETRY_PAUSE_S
        if self._away:
            self._away = False
            log.warning("the database is back: writing again", extra={"action": "store_back"})

    def _pause(self, failure: errors.DelegationError) -> float:
        """Seconds before events that failed are tried again: while the server is away,
        a pause that doubles up to ``_AWAY_PAUSE_MAX_S`` (so a restart is noticed within
        about that), else ``_RETRY_PAUSE_S``."""
        if not isinstance(failure, errors.StoreUnavailable):
            self._away_pause = _RETRY_PAUSE_S
            return _RETRY_PAUSE_S
        pause, self._away_pause = self._away_pause, min(self._away_pause * 2, _AWAY_PAUSE_MAX_S)
        return pause

    def _synchronous(self, conn: Connection, batch: _Queue) -> None:
        """Set the sync level ``batch`` needs (SQLite takes it only between transactions):
        a batch that holds no event and only jobs no one was answered for yet
        (``durable=False``) commits without waiting for the disk."""
        level = self._levels[bool(batch.events) or any(p.durable for p in batch.jobs)]
        if level != self._level:
            dbapi(conn).execute(f"PRAGMA synchronous={level}")
            self._level = level

    def _transaction(
        self, conn: Connection, batch: _Queue, *, savepoints: bool, begun: bool
    ) -> None:
        """One ``BEGIN IMMEDIATE`` … ``COMMIT``, issued on the sqlite3 connection itself
        (SQLAlchemy's transaction bookkeeping cost a third of a small batch). A job that
        runs a Core statement joins this transaction (see ``_on_begin``)."""
        raw = dbapi(conn)
        began = time.perf_counter() if self.on_commit is not None else 0.0
        try:
            if not begun:
                self._begin(raw)  # inside: a BEGIN whose fence failed is rolled back too
            self._guard(conn)
            self._run_batch(conn, batch, savepoints=savepoints)
            self._announce_in(conn, batch)
            self._commit_open(conn, raw)
        except BaseException:  # a failed COMMIT too: never leave the write lock held
            self._roll_back(conn, raw)
            raise
        self._report_commit(began, len(batch.events))

    def _report_commit(self, began: float, events: int) -> None:
        """Tell ``on_commit`` (if set) of a transaction that committed; a fault of the
        hook is logged, never taken for the commit's own."""
        hook = self.on_commit
        if hook is None:
            return
        try:
            hook(time.perf_counter() - began, events)
        except Exception:
            log.exception("commit hook failed", extra={"action": "commit_hook_failed"})

    def _commit_open(self, conn: Connection, raw: Any) -> None:
        """Commit the transaction open on ``conn``: through SQLAlchemy if a Core
        statement began it (``_on_begin``), else on ``raw``, the driver's connection
        taken before the work (SQLAlchemy refuses to hand out an invalidated one)."""
        if conn.in_transaction():
            conn.commit()
        elif self._in_transaction(raw):
            raw.execute("COMMIT")

    def _roll_back(self, conn: Connection, raw: Any) -> None:
        """Roll back whatever transaction is open on ``conn`` (SQLAlchemy's) or ``raw``.

        SQLAlchemy's rollback is called even when ``conn`` reports no transaction: a
        COMMIT that lost the connection leaves one it refuses every later use for until
        rolled back (``PendingRollbackError``); with none, the call does nothing."""
        conn.rollback()
        if not self._lost(raw) and self._in_transaction(raw):
            raw.execute("ROLLBACK")

    @staticmethod
    def _job_failed(pending: _Pending, exc: Exception) -> None:
        """``pending``'s job raised ``exc``: its caller gets the domain error; a fault
        of ours (not a refusal) is logged with its traceback."""
        pending.ok, pending.value = False, translate(exc)
        if not isinstance(exc, errors.DelegationError) and not unavailable(exc):
            log.error("write job failed", extra={"action": "write_job_failed"}, exc_info=exc)

    # --- what differs between stores (PostgresDatabase overrides these) -----------

    def _try_begin(self, raw: Any) -> bool:
        """Begin a write transaction unless another connection holds the write lock."""
        try:
            raw.execute("BEGIN IMMEDIATE")  # the write connection never waits (_begin)
        except sqlite3.OperationalError:
            return False
        return True

    @staticmethod
    def _in_transaction(raw: Any) -> bool:
        return bool(raw.in_transaction)

    def _commit_alone(self, conn: Connection, batch: _Queue) -> bool | None:
        """Commit a lone ``one_write`` job as its statement's own transaction: whether
        it committed (False: the writer runs it), or None: not done that way (SQLite:
        never, its ``BEGIN`` and ``COMMIT`` cost no round trip)."""
        return None

    shared = False  # one host per SQLite file (its lock)

    def claim(self, instance_id: str) -> None:
        """This host's instance (SQLite: the file's lock already makes it the only one)."""

    def alive_until(self, deadline: float) -> None:
        """Until ``deadline`` (:func:`boot_clock`) no other host can take this one over."""

    def keep_lock(self) -> None:
        """Hold this host's lock again if the server let it go (SQLite: the file's lock
        is this process's own, never lost)."""

    def _guard(self, conn: Connection) -> None:
        """Refuse the batch if this host may no longer write (SQLite: it always may)."""

    def _announce_in(self, conn: Connection, batch: _Queue) -> None:
        """Tell other processes, within the batch's transaction, that it committed
        (SQLite: nothing to do, ``PRAGMA data_version`` moves by itself)."""

    @staticmethod
    def _lost(raw: Any) -> bool:
        """Whether the server dropped the driver's connection ``raw`` (a SQLite file
        cannot)."""
        return False

    def _healthy(self, conn: Connection, engine: Engine | None = None) -> Connection:
        """``conn``, or a new connection of ``engine`` (the writer's by default) if the
        server dropped it: a lost connection fails one batch or one read, not all after."""
        if not conn.closed and not conn.invalidated and not self._lost(dbapi(conn)):
            return conn
        engine = engine or self._write_engine
        assert engine is not None
        if not conn.closed:
            log.warning(
                "a connection to the store was lost; connecting again",
                extra={"action": "store_connection_lost"},
            )
            with contextlib.suppress(Exception):  # gone: only SQLAlchemy's state is left
                conn.rollback()
                conn.invalidate()
            conn.close()
        # A failed connect leaves ``conn`` closed: the next call tries again.
        connected = engine.connect()
        if engine is self._write_engine:
            self._reconnected = True
        return connected

    def reconnected(self) -> bool:
        """Whether the writer ever connected again after losing its connection (never
        on SQLite). Read on the writer's thread, in the batch that uses it."""
        return self._reconnected

    @staticmethod
    def _changes(raw: Any) -> int | None:
        """Rows changed on ``raw`` so far; None: not known (a failed job is redone)."""
        return int(raw.total_changes)

    def _begin(self, raw: Any) -> None:
        """``BEGIN IMMEDIATE``, waiting up to the busy timeout while another connection
        holds the write lock, with pauses that grow from 1 to 50 ms (SQLite's own
        handler waits alike).

        Raises:
            sqlite3.OperationalError: still busy at the deadline, or any other failure.
        """
        deadline: float | None = None
        pause = 0.001
        while True:
            try:
                raw.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._busy_timeout_s
                if not _is_busy(exc) or now >= deadline:
                    raise
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, _BUSY_PAUSE_MAX_S)

    def _run_batch(self, conn: Connection, batch: _Queue, *, savepoints: bool) -> None:
        raw = dbapi(conn)
        if batch.events and savepoints:
            self._insert_events_apart(conn, batch)
        elif batch.events:
            insert_events(conn, batch.events)
        for pending in batch.jobs:
            if pending.fn is None:
                continue
            if savepoints:
                raw.execute("SAVEPOINT job")
            before = self._changes(raw)
            try:
                pending.ok, pending.value = True, pending.fn(conn)
            except Exception as exc:
                self._job_failed(pending, exc)
                if savepoints:
                    raw.execute("ROLLBACK TO SAVEPOINT job")
                elif before is None or self._changes(raw) != before:
                    raise _Redo() from exc  # it may have written: undo, use savepoints
            if savepoints:
                raw.execute("RELEASE SAVEPOINT job")

    def _insert_events_apart(self, conn: Connection, batch: _Queue) -> None:
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

    def _deliver(self, jobs: list[_Pending], *, inline: bool) -> None:
        waiting = [p for p in jobs if p.future is not None]
        for pending in jobs:
            if pending.future is None and not pending.ok:
                log.warning("background write refused: %s", pending.value)
        if not waiting:
            return
        if inline:
            _resolve(waiting)
        elif self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                self._loop.call_soon_threadsafe(_resolve, waiting)

    # --- notices ----------------------------------------------------------------

    def watch(self, interval: float) -> Watch:
        return FileWatch(self.path, interval)

    def protected_paths(self) -> list[str]:
        return [str(self.path.parent)]

    # --- reading ----------------------------------------------------------------

    async def read_now(self, fn: Callable[[Connection], T]) -> T:
        """Like :meth:`read`, for functions that use only the store's plain statements:
        no transaction is opened, so each statement sees the newest commit. A caller
        that reads a child's row before its events still gets a consistent page: every
        event is committed before the state that follows it."""
        conn = await self._turn()
        with translated(reading=True):
            try:
                return fn(conn)
            finally:
                if conn.in_transaction():  # a Core statement autobegan one: left open, it
                    conn.rollback()  # would pin this snapshot and refuse the next read()

    async def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one read transaction (a consistent WAL snapshot).

        Reads run inline on the event loop's thread, on a connection of its own: a WAL
        reader never waits for the writer, and a short query costs less than a hop to
        another thread would.
        """
        conn = await self._turn()
        with translated(reading=True), conn.begin():  # BEGIN itself can fail (a dropped connection)
            return fn(conn)

    async def _turn(self) -> Connection:
        """The loop's read connection, after one turn of the loop (so that a caller
        polling in a tight loop never starves the other tasks)."""
        await asyncio.sleep(0)
        if self._read_engine is None:  # closed, perhaps while this read yielded
            raise errors.StoreError("child store is closed")
        with translated():  # a server away: StoreUnavailable, and the next read tries again
            if self._reader is None:
                self._reader = self._read_engine.connect()
            else:
                self._reader = self._healthy(self._reader, self._read_engine)
        return self._reader


def _resolve(batch: list[_Pending]) -> None:
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


class ReadOnly:
    """A read-only view of a database file, safe beside a running host (WAL readers).

    It never migrates and never writes; the caller checks the schema revision
    (see ``Inspector.revision``) before trusting the tables.
    """

    def __init__(self, url: str) -> None:
        path = sqlite_path(url)
        if not path.is_file():
            raise errors.StoreError(f"no delegation database at {path}")
        self._engine = create_engine(
            f"sqlite:///file:{path}?mode=ro&uri=true", pool_size=1, max_overflow=0
        )

        @event.listens_for(self._engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.execute("PRAGMA query_only=ON")
            dbapi_connection.execute("PRAGMA busy_timeout=5000")

    def read(self, fn: Callable[[Connection], T]) -> T:
        with translated(), self._engine.connect() as conn:  # opening the file too
            return fn(conn)

    def close(self) -> None:
        self._engine.dispose()

    @classmethod
    def read_once(cls, url: str, fn: Callable[[Connection], T]) -> T:
        """Open ``url`` read-only, run ``fn``, and close it again."""
        reader = cls(url)
        try:
            return reader.read(fn)
        finally:
            reader.close()


def check_file(url: str) -> None:
    """Refuse a file this code must not migrate (``migrate.check``) before writing to it:
    even the writer's first pragma (WAL) would change another application's file."""
    path = sqlite_path(url)
    if not path.is_file() or path.stat().st_size == 0:
        return  # a new database
    ReadOnly.read_once(url, migrate.check)


def _checked_revision(conn: Connection) -> str | None:
    migrate.check(conn)
    return migrate.current(conn)


def upgrade_file(
    url: str, *, apply: bool, on_step: migrate.OnStep | None = None
) -> tuple[str | None, str | None]:
    """The schema revision of a file before and after an optional upgrade to head
    (``on_step``: told of each revision applied)."""
    if not apply:
        current = ReadOnly.read_once(url, _checked_revision)
        return current, current
    lock = HostLock.acquire(sqlite_path(url))  # never beside a live host
    engine: Engine | None = None
    try:
        check_file(url)
        lock.restrict_modes()
        engine = create_engine(url)
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            before = migrate.current(conn)
            migrate.upgrade(conn, on_step=on_step)
            return before, migrate.current(conn)
    except Exception as exc:
        raise translate(exc) from exc
    finally:
        if engine is not None:
            engine.dispose()
        lock.release()


def write_once(url: str, fn: Callable[[Connection], T], *, busy_timeout_ms: int = 5000) -> T:
    """Run ``fn`` in one short write transaction on an existing database at head, beside
    a live host if there is one (an operator's control request): no lock is taken, no
    migration is run, and SQLite's own locking orders the write with the host's.

    Raises:
        errors.StoreError: no database there, or busy past the timeout.
        errors.SchemaMismatch: not a delegation database at this code's schema.
    """
    path = sqlite_path(url)
    if not path.is_file():
        raise errors.StoreError(f"no delegation database at {path}")
    engine = _make_engine(
        url,
        begin="BEGIN IMMEDIATE",
        pragmas={"busy_timeout": str(busy_timeout_ms), "foreign_keys": "ON"},
        pool_size=1,
    )
    try:
        with translated(), engine.connect() as conn, conn.begin():
            at_head(conn, str(path))
            return fn(conn)
    finally:
        engine.dispose()


def at_head(conn: Connection, name: str) -> None:
    """Refuse a database that is not delegation's at this code's head revision.

    Raises:
        errors.SchemaMismatch: another application's, a newer one, or an older one.
    """
    migrate.check(conn)
    if migrate.current(conn) != migrate.head():
        raise errors.SchemaMismatch(
            f"{name} is at an older schema; run `delegation db upgrade` first"
        )


@contextlib.contextmanager
def translated(*, reading: bool = False) -> Iterator[None]:
    """Driver and SQLAlchemy failures inside the block as domain errors (``translate``)."""
    try:
        yield
    except errors.DelegationError:
        raise
    except Exception as exc:
        raise translate(exc, reading=reading) from exc
