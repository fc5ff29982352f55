"""The engine's store on PostgreSQL (SPEC §12), through psycopg 3.

It keeps the contract of :mod:`delegation.store.interface` with the machinery of the
SQLite store (:class:`delegation.store.database.Database`): one write connection that
commits in batches (group commit: one transaction and one WAL flush for every job and
event queued meanwhile), reads on a connection of their own on the loop's thread. What
differs is only what PostgreSQL does differently:

* **Transactions.** Connections run in autocommit mode and the store issues ``BEGIN``
  and ``COMMIT`` itself, as on SQLite. Writes are ``READ COMMITTED``; the engine's
  guarded updates (``UPDATE … WHERE state IN …``) re-check their row after any wait,
  so two writers never move one child twice. A ``read`` is one ``REPEATABLE READ,
  READ ONLY`` snapshot; ``read_now`` runs each statement on the newest commit.
* **A failed job** aborts a PostgreSQL transaction, and the store cannot count the rows
  a job changed: a batch where a job failed is always undone and run again with one
  savepoint per job, so its neighbours still commit (on SQLite only a job that failed
  after writing causes that).
* **Busy.** A write waits for another transaction's row lock at most ``busy_timeout``
  (``lock_timeout``), then fails with :class:`errors.DatabaseBusy`, as on SQLite.
* **Durability.** Every batch commits with the server's ``synchronous_commit`` (on by
  default): an answer is given only after the commit is flushed to the server's WAL.
* **Ownership.** One live host per database (SPEC §9): the host holds a session-level
  advisory lock on a connection of its own for its whole life. The server releases it
  when that connection ends -- the host's process dying in any way included -- so a new
  host opens at once after a crash. Migrations run under a transaction-level advisory
  lock, so two hosts starting together never migrate at once.
* **Notices** across processes: a batch that committed events, and an operator's
  control request, send ``NOTIFY delegation`` in their own transaction (delivered at
  commit); :class:`PostgresWatch` listens, with a slow poll as a fallback.

Where it stops: reads and inline commits run on the event loop's thread, so a server
that is slow to answer slows the loop (as a slow disk does on SQLite); run the server
close to the host. A connection lost to a server restart is opened again for the next
batch; the batch that found it broken fails (its callers get :class:`errors.StoreError`,
its events are kept for the next batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.pool import NullPool

from delegation import errors, passwords
from delegation.store import dbapi, migrate
from delegation.store.database import (
    Database,
    _Queue,
    at_head,
    boot_clock,
    translate,
    translated,
    unavailable,
)
from delegation.store.lifecycle import INSTANCE_LOCKS
from delegation.store.stores import libpq
from delegation.watch import Watch

log = logging.getLogger("delegation.store")

T = TypeVar("T")

# Advisory lock keys (any bigint, per database): the live host's, and the migration's.
MIGRATION_LOCK = 0x64656C6567617465  # "delegate"
CHANNEL = "delegation"  # NOTIFY channel: events committed, a control request recorded
_IDLE = 0  # psycopg.pq.TransactionStatus.IDLE
# Inline commits run on the event loop's thread: a row lock held elsewhere may hold them
# this long before the batch goes to the writer thread, which waits the full lock_timeout.
INLINE_LOCK_TIMEOUT_MS = 20
_INSTANCE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # the ids a host gives itself


def _nul_safe(dbapi_connection: Any, _record: Any = None) -> None:
    """PostgreSQL's text cannot hold NUL, which SQLite's can: on this connection a NUL
    in a string parameter is sent as U+FFFD, so that a peer's text never fails a write
    (and with it a batch of events) that SQLite would have taken. An id with a NUL is
    refused before it is stored (``valid_id``), so it only ever misses in a lookup."""
    from psycopg.adapt import Dumper
    from psycopg.pq import Format

    class NulSafe(Dumper):
        format = Format.TEXT

        def dump(self, obj: str) -> bytes:
            return obj.replace("\x00", "\ufffd").encode()

    dbapi_connection.adapters.register_dumper(str, NulSafe)


def _nul_safe_engine(engine: Engine) -> Engine:
    event.listen(engine, "connect", _nul_safe)
    return engine


def _engine(
    url: str, application: str, *, begin: str, options: dict[str, str], pool_size: int = 1
) -> Engine:
    """Connections in autocommit mode; a transaction SQLAlchemy starts is ``begin``."""
    settings = " ".join(f"-c {name}={value}" for name, value in options.items())
    engine = _nul_safe_engine(
        create_engine(
            url,
            isolation_level="AUTOCOMMIT",
            pool_size=pool_size,
            max_overflow=0,
            pool_pre_ping=False,
            connect_args={"options": settings, "application_name": application},
        )
    )

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        raw = dbapi(conn)
        if raw.info.transaction_status == _IDLE:  # the writer may have begun it already
            raw.execute(begin)

    return engine


def _reader(url: str) -> Engine:
    """The engine of the loop's reads: each ``read`` one ``REPEATABLE READ, READ ONLY``
    snapshot, each ``read_now`` statement its own read-only transaction.

    Read-only per transaction, not per session: a session that starts read-only (a
    startup option) is one ``target_session_attrs=read-write`` refuses on every host.
    The session's default is set once it is open instead, so that ``read_now``'s
    statements, in autocommit, cost no round trip more."""
    begin = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
    engine = _engine(url, "delegation-reader", begin=begin, options={})
    event.listen(engine, "connect", _read_only_transactions)
    return engine


def _read_only_transactions(dbapi_connection: Any, _record: Any = None) -> None:
    dbapi_connection.execute("SET default_transaction_read_only = on")


def _connect_error(url: str, exc: BaseException) -> errors.DelegationError:
    """An outage is the retryable refusal (SPEC §19; its cause says what libpq said);
    a server that refuses who connects is a StoreError naming the database."""
    if unavailable(exc):
        return errors.StoreUnavailable()
    shown = passwords.redacted(url)
    return errors.StoreError(f"cannot reach the PostgreSQL database {shown}: {exc}")


class PostgresDatabase(Database):
    """PostgreSQL for the engine: batched writes on one connection, snapshot reads."""

    def __init__(self, url: str, *, synchronous: str = "FULL", busy_timeout_ms: int = 5000) -> None:
        self.url = url
        self.path = Path()  # no file: the host lock and the watch live in the server
        self._levels = {True: "on", False: "on"}
        self._pragmas = {}
        self._busy_timeout_s = busy_timeout_ms / 1000
        self._busy_timeout_ms = busy_timeout_ms
        self._init_state()
        self._lock_conn: Any = None  # holds this host instance's session lock
        self._lock_held = True  # the lock connection holds the lock (see keep_lock)
        self._claimed: str | None = None  # the instance whose lock is held; its fence
        self._taken_by: str | None = None  # the fence, as the current transaction read it
        self._alive_until = 0.0  # boot_clock(): until then no host can have taken us over
        self._relaxed = False  # the next batch may commit without waiting for the flush
        self._unflushed_engine: Engine | None = None
        self._unflushed: Connection | None = None

    shared = True  # several hosts may open this database (SPEC §12)

    # --- lifecycle --------------------------------------------------------------

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Migrate the database to head (never two hosts at once) and start the writer.
        Other hosts may share the database (SPEC §12); :meth:`claim` names this one.

        Raises:
            errors.SchemaMismatch: the database is not ours to migrate.
            errors.StoreError: the server cannot be reached or refuses us.
        """
        self._loop = loop
        try:
            self._lock_conn = _connect(self.url, "delegation-host")
            upgrade(self.url, beside_hosts=True)
            self._write_engine = self._writer("delegation-writer")
            self._unflushed_engine = self._writer(
                "delegation-writer-unflushed", synchronous_commit="off"
            )
            self._read_engine = _reader(self.url)
            with self._write_engine.connect():
                pass  # reach the server now, not in the first batch
        except BaseException as exc:
            self.close()
            if not isinstance(exc, Exception):
                raise
            if isinstance(exc, errors.DelegationError):
                raise
            raise translate(exc) from exc
        self._start_writer()

    def _writer(self, application: str, **settings: str) -> Engine:
        """An engine for write connections: inline statements wait INLINE_LOCK_TIMEOUT_MS
        for a row lock, the writer's transactions busy_timeout (their BEGIN sets it)."""
        return _engine(
            self.url,
            application,
            begin=self._writer_begin(),
            # A host stopped mid-batch (SIGSTOP) must not hold its rows locked against
            # the host taking over from it: the server ends its session.
            options={
                "lock_timeout": str(INLINE_LOCK_TIMEOUT_MS),
                "idle_in_transaction_session_timeout": "5000",
                **settings,
            },
        )

    def _writer_begin(self) -> str:
        """The writer thread's BEGIN: its transactions wait busy_timeout for a lock."""
        return f"BEGIN; SET LOCAL lock_timeout = {self._busy_timeout_ms}"

    def claim(self, instance_id: str) -> None:
        """Hold ``instance_id``'s lock for this host's life (letting go of an earlier
        instance's), and fence every later batch on it: a batch commits only while no
        other host has taken the instance over (``host_instances.taken_by``)."""
        if not _INSTANCE_ID.fullmatch(instance_id):
            raise ValueError(f"not a host instance id: {instance_id!r}")
        lock = self._lock_conn
        if lock is None or lock.closed:  # lost with the server: a new session holds it
            try:
                lock = self._lock_conn = _connect(self.url, "delegation-host")
            except errors.StoreError as exc:
                raise errors.StoreUnavailable() from exc
        with self._cond:
            previous, left = self._claimed, _Queue()
            if previous is not None:
                # A rejoin: what the earlier instance queued belongs to runs it lost;
                # fenced on the new instance, it would commit (an event beside the
                # taking host's). The batch being committed, fenced on the earlier one,
                # ends first.
                self._claiming = True
                while self._busy:
                    self._cond.wait()
                self._claiming = False  # no batch began meanwhile (the writer waits)
                left, self._queue = self._queue, _Queue()
                self._cond.notify_all()
            self._claimed = instance_id
            self._alive_until = 0.0  # fresh once its first heartbeat committed
        if left.jobs or left.events:
            self._refuse(left, errors.HostFenced(f"host instance {previous} was taken over"))
        if previous is not None:
            lock.execute("SELECT pg_advisory_unlock(%s, hashtext(%s))", (INSTANCE_LOCKS, previous))
        lock.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (INSTANCE_LOCKS, instance_id))
        self._lock_held = True

    def keep_lock(self) -> None:
        """Hold this instance's lock again if its connection was lost (a server restart
        or failover frees every lock): called before each heartbeat, which commits only
        while the lock is held (``lifecycle.heartbeat``).

        Raises:
            errors.StoreUnavailable: the server cannot be reached (the next beat tries).
        """
        lock, instance = self._lock_conn, self._claimed
        if instance is None:
            return
        try:
            if lock is not None and not lock.closed:
                if self._lock_held:
                    lock.execute("SELECT 1")  # a dead session is found only by using it
                else:  # its old session, ended, may have held it a moment longer
                    self._lock_held = self._try_lock(lock, instance)
                return
        except Exception as exc:
            if not unavailable(exc):
                raise translate(exc) from exc
        if lock is not None:
            with contextlib.suppress(Exception):
                lock.close()
        self._lock_conn, self._lock_held = None, False
        try:
            lock = _connect(self.url, "delegation-host")
        except errors.StoreError as exc:
            raise errors.StoreUnavailable() from exc
        self._lock_conn = lock
        self._lock_held = self._try_lock(lock, instance)
        log.warning(
            "the host lock was lost with its connection; held again: %s",
            self._lock_held,
            extra={"action": "host_lock_renewed"},
        )

    @staticmethod
    def _try_lock(lock: Any, instance: str) -> bool:
        row = lock.execute(
            "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (INSTANCE_LOCKS, instance)
        ).fetchone()
        return bool(row and row[0])

    def _refuse(self, left: _Queue, fenced: errors.HostFenced) -> None:
        for pending in left.jobs:
            pending.ok, pending.value = False, fenced
        self._deliver(left.jobs, inline=False)
        log.warning(
            "writes of a taken-over instance dropped",
            extra={"action": "fenced_writes_dropped", "events": len(left.events)},
        )

    def alive_until(self, deadline: float) -> None:
        with self._cond:
            self._alive_until = deadline

    def _release_lock(self) -> None:
        lock, self._lock_conn = self._lock_conn, None
        if lock is not None:
            _release_instance_lock(lock, self._claimed)

    def watch(self, interval: float) -> Watch:
        return PostgresWatch(self.url, interval)

    def protected_paths(self) -> list[str]:
        """No file of the database, but libpq's files of credentials the host may use:
        its password file, its service file and its client certificates (SPEC §17)."""
        home = os.path.expanduser("~")
        return [
            os.environ.get("PGPASSFILE") or os.path.join(home, ".pgpass"),
            os.environ.get("PGSERVICEFILE") or os.path.join(home, ".pg_service.conf"),
            os.path.join(home, ".postgresql"),
        ]

    # --- what differs from SQLite -------------------------------------------------

    def _try_begin(self, raw: Any) -> bool:
        # PostgreSQL has no database-wide write lock to wait for, but a statement can
        # wait for another connection's row lock. Inline, on the loop's thread, it
        # waits at most the session's lock_timeout (INLINE_LOCK_TIMEOUT_MS); then the
        # batch is undone and the writer runs it again (``_Redo``), waiting busy_timeout.
        # A connection the server dropped is left to the writer, which connects again.
        if raw.closed:
            return False
        try:
            self._open_transaction(raw, inline=True)
        except Exception:
            with contextlib.suppress(Exception):
                if self._in_transaction(raw):
                    raw.execute("ROLLBACK")
            return False
        return True

    def _begin(self, raw: Any) -> None:
        self._open_transaction(raw, inline=False)

    def _open_transaction(self, raw: Any, *, inline: bool) -> None:
        """BEGIN, the batch's settings and the fence's read in one round trip (a simple
        query of several statements); who took this instance over is kept for _guard."""
        sql = "BEGIN" if inline else self._writer_begin()
        if self._relaxed:
            sql += "; SET LOCAL synchronous_commit = off"
        self._taken_by = None
        instance = self._claimed
        if instance is None:
            raw.execute(sql)
            return
        # The row is share-locked until the batch commits, so a takeover (which updates
        # it) waits for the batch, and a batch after the takeover sees it. The id is
        # this host's own (checked in claim), safe as a literal.
        cursor = raw.execute(
            f"{sql}; SELECT taken_by FROM host_instances WHERE id = '{instance}' FOR SHARE"
        )
        while cursor.nextset():
            pass
        row = cursor.fetchone()
        self._taken_by = row[0] if row is not None else None

    def _commit_alone(self, conn: Connection, batch: _Queue) -> bool | None:
        # A lone one-write job runs in autocommit: its one writing statement is its
        # own transaction, committed at the session's synchronous_commit (durable,
        # even for a ``durable=False`` job: one flush costs less than BEGIN and COMMIT).
        # Its reads before that statement see what READ COMMITTED would show them
        # inside a transaction: each statement's own snapshot.
        # On a shared database this write is fenced by time instead of by the row: it
        # runs so only while this host's last heartbeat is recent enough that no host
        # can have declared it dead (see alive_until); otherwise it is a guarded batch.
        # What a host paused between that check and its statement writes after its
        # takeover is taken over by the next heartbeat of a live host (lifecycle.LOST).
        # A durable=False job (a reservation) runs on a second connection whose session
        # commits without waiting for the WAL flush: the admission's flush on the main
        # one makes it durable too (the WAL is one sequence), as on SQLite.
        pending = batch.jobs[0]
        if not pending.one_write or pending.fn is None:
            return None
        if self._claimed is not None and boot_clock() >= self._alive_until:
            return None
        if not pending.durable:
            try:
                conn = self._unflushed_connection()
            except Exception:  # the server away: the writer runs it, and says so
                return False
        raw = dbapi(conn)
        if raw.closed or self._in_transaction(raw):
            return False
        began = time.perf_counter() if self.on_commit is not None else 0.0
        try:
            pending.ok, pending.value = True, pending.fn(conn)
            self._commit_open(conn, raw)  # a Core statement began a transaction: commit it now
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._roll_back(conn, raw)
            if isinstance(translate(exc), errors.DatabaseBusy) or raw.closed:
                return False  # nothing was written: the writer runs it, waiting its turn
            self._job_failed(pending, exc)
        else:
            self._report_commit(began, 0)
        return True

    def _unflushed_connection(self) -> Connection:
        """The connection of lone ``durable=False`` commits (used only while ``_busy``)."""
        assert self._unflushed_engine is not None
        if self._unflushed is None:
            self._unflushed = self._unflushed_engine.connect()
        self._unflushed = self._healthy(self._unflushed, self._unflushed_engine)
        return self._unflushed

    def _stop_writer(self) -> None:
        super()._stop_writer()
        unflushed, self._unflushed = self._unflushed, None
        if unflushed is not None:
            unflushed.close()
        if self._unflushed_engine is not None:
            self._unflushed_engine.dispose()
            self._unflushed_engine = None

    @staticmethod
    def _in_transaction(raw: Any) -> bool:
        return bool(raw.info.transaction_status != _IDLE)

    @staticmethod
    def _changes(raw: Any) -> int | None:
        return None

    def _synchronous(self, conn: Connection, batch: _Queue) -> None:
        # As on SQLite: a batch of only writes nobody was answered for (``durable=False``)
        # commits without waiting for the WAL flush; the next durable commit flushes
        # the WAL up to itself, so it makes the earlier one durable too.
        self._relaxed = not (batch.events or any(p.durable for p in batch.jobs))

    def _guard(self, conn: Connection) -> None:
        """The fence (read as the transaction began): refuse the batch if another host
        took this instance over."""
        if self._taken_by is not None:
            raise errors.HostFenced(
                f"host instance {self._claimed} was taken over by {self._taken_by};"
                " its writes are refused"
            )

    def _announce_in(self, conn: Connection, batch: _Queue) -> None:
        """Other hosts and followers learn which children have new events (the payload
        is cut to what NOTIFY carries; an empty one means "look at everything")."""
        if batch.events:
            ids = ",".join(str(i) for i in sorted({row.child_id for row in batch.events}))
            dbapi(conn).execute(
                "SELECT pg_notify(%s, %s)", (CHANNEL, ids if len(ids) < 7900 else "")
            )

    @staticmethod
    def _lost(raw: Any) -> bool:
        return bool(raw.closed)


def _connect(url: str, application: str) -> Any:
    import psycopg

    try:
        return psycopg.connect(libpq(url), autocommit=True, application_name=application)
    except psycopg.Error as exc:
        raise _connect_error(url, exc) from exc


def _release_instance_lock(conn: Any, instance_id: str | None) -> None:
    """Unlock, then close: the server drops a closed session's locks only once its
    backend has noticed, and a host looking right after must find the lock free."""
    try:
        if instance_id is not None:
            conn.execute(
                "SELECT pg_advisory_unlock(%s, hashtext(%s))", (INSTANCE_LOCKS, instance_id)
            )
    except Exception:  # the server is gone: so is the lock
        log.debug("instance lock not released explicitly", exc_info=True)
    finally:
        conn.close()


def upgrade(
    url: str, *, beside_hosts: bool = False, on_step: migrate.OnStep | None = None
) -> tuple[str | None, str | None]:
    """Migrate the database at ``url`` to head under the migration lock (two hosts
    starting together never migrate at once); the revision before and after. Unless
    ``beside_hosts`` (a host opening), it is refused while a host instance is live.

    Raises:
        errors.HostConflict: a live host uses the database (``delegation db upgrade``).
        errors.SchemaMismatch: not a delegation database, or a newer one's.
    """
    engine = create_engine(url, poolclass=NullPool)
    try:
        with translated(), engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
            migrate.check(conn)
            before = migrate.current(conn)
            if not beside_hosts and before is not None and live_instances(conn):
                raise errors.HostConflict("database is in use by another live host")
            migrate.upgrade(conn, on_step=on_step)  # commits, and frees the migration lock
            return before, migrate.current(conn)
    finally:
        engine.dispose()


def live_instances(conn: Connection) -> list[str]:
    """Host instances whose lock is held: their host process is alive (paused maybe)."""
    return list(
        conn.execute(
            text(
                "SELECT id FROM host_instances WHERE closed_at IS NULL AND taken_by IS NULL"
                " AND NOT pg_try_advisory_xact_lock(:locks, hashtext(id))"
            ),
            {"locks": INSTANCE_LOCKS},
        ).scalars()
    )


def revision(url: str) -> str | None:
    """The database's schema revision, checked (``migrate.check``); only reads."""
    return read_once(url, _checked_revision)


def _checked_revision(conn: Connection) -> str | None:
    migrate.check(conn)
    return migrate.current(conn)


class PostgresReadOnly:
    """A read-only view of a PostgreSQL database, safe beside running hosts: each
    :meth:`read` is one ``REPEATABLE READ, READ ONLY`` snapshot."""

    def __init__(self, url: str) -> None:
        self._engine = _nul_safe_engine(
            create_engine(
                url,
                pool_size=1,
                max_overflow=0,
                connect_args={"application_name": "delegation-inspect"},
                execution_options={
                    "postgresql_readonly": True,
                    "isolation_level": "REPEATABLE READ",
                },
            )
        )

    def read(self, fn: Callable[[Connection], T]) -> T:
        with translated(reading=True), self._engine.connect() as conn:  # reaching the server too
            return fn(conn)

    def close(self) -> None:
        self._engine.dispose()


def read_once(url: str, fn: Callable[[Connection], T]) -> T:
    """Run ``fn`` in one read-only snapshot of the database at ``url``."""
    reader = PostgresReadOnly(url)
    try:
        return reader.read(fn)
    finally:
        reader.close()


def write_once(url: str, fn: Callable[[Connection], T], *, busy_timeout_ms: int = 5000) -> T:
    """Run ``fn`` in one short write transaction beside a live host, and notify the host
    (``NOTIFY`` is delivered when it commits). See ``database.write_once``."""
    engine = _nul_safe_engine(
        create_engine(
            url,
            poolclass=NullPool,
            connect_args={"options": f"-c lock_timeout={busy_timeout_ms}"},
        )
    )
    try:
        with translated(), engine.connect() as conn, conn.begin():
            at_head(conn, "the database")
            value = fn(conn)
            conn.exec_driver_sql(f"NOTIFY {CHANNEL}")
            return value
    finally:
        engine.dispose()


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
            raise _connect_error(url, exc) from exc
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
