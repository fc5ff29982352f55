"""The engine's store on PostgreSQL (design §12), through psycopg 3.

The dialect the store's writer (:class:`delegation.store.database.Database`) is composed
with on PostgreSQL: the writer is the same on both stores (one write connection that
commits in batches, reads on a connection of their own on the loop's thread); what
this dialect holds is only what PostgreSQL does differently:

* **Transactions.** Connections run in autocommit mode and the store issues ``BEGIN``
  and ``COMMIT`` itself, as on SQLite. Writes are ``READ COMMITTED``; the engine's
  guarded updates (``UPDATE … WHERE state IN …``) re-check their row after any wait,
  so two writers never move one child twice. A ``read`` is one ``REPEATABLE READ,
  READ ONLY`` snapshot; ``read_now`` runs each statement on the newest commit.
* **Capabilities** (flags of the store): ``shared`` (several hosts), ``writes_alone``
  (a lone ``one_write`` job commits in autocommit, without ``BEGIN`` and ``COMMIT``),
  ``starts_as_seen`` (a start checks the row versions it read in its insert).
* **A failed job** aborts a PostgreSQL transaction, and the store cannot count the rows
  a job changed: a batch where a job failed is always undone and run again with one
  savepoint per job, so its neighbours still commit (on SQLite only a job that failed
  after writing causes that).
* **Busy.** A write waits for another transaction's row lock at most ``busy_timeout``
  (``lock_timeout``), then fails with :class:`errors.DatabaseBusy`, as on SQLite.
* **Durability.** Every batch commits with the server's ``synchronous_commit`` (on by
  default): an answer is given only after the commit is flushed to the server's WAL.
* **Ownership.** One live host per database (design §9): the host holds a session-level
  advisory lock on a connection of its own for its whole life. The server releases it
  when that connection ends -- the host's process dying in any way included -- so a new
  host opens at once after a crash. Migrations run under a transaction-level advisory
  lock, so two hosts starting together never migrate at once.
* **Notices** across processes: a batch that committed events, and an operator's
  control request, send ``NOTIFY delegation`` in their own transaction (delivered at
  commit), and so does a child's end, whoever writes it (a trigger, migration 0012);
  :class:`delegation.store.postgres.watch.PostgresWatch` listens, with a slow poll as
  a fallback.

Where it stops: reads and inline commits run on the event loop's thread, so a server
that is slow to answer slows the loop (as a slow disk does on SQLite); run the server
close to the host. A connection lost to a server restart is opened again for the next
batch; the batch that found it broken fails (its callers get :class:`errors.StoreError`,
its events are kept for the next batch).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine

from delegation import errors
from delegation.store import credentials
from delegation.store.dialect import Engines
from delegation.store.failures import closed, translate, unavailable
from delegation.store.lifecycle import INSTANCE_LOCKS
from delegation.store.postgres import admin
from delegation.store.postgres.connect import (
    IDLE_IN_TRANSACTION_MS,
    connect,
    in_transaction,
    make_engine,
    reader_engine,
    refuse_pooled_transactions,
    release_instance_lock,
)
from delegation.store.postgres.watch import PostgresWatch
from delegation.store.watch import Watch

log = logging.getLogger("delegation.store")

# Inline commits run on the event loop's thread: a row lock held elsewhere may hold them
# this long before the batch goes to the writer thread, which waits the full lock_timeout.
INLINE_LOCK_TIMEOUT_MS = 20
_INSTANCE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # the ids a host gives itself


class PostgresDialect:
    shared = True  # several hosts may open this database (design §12)
    writes_alone = True  # autocommit saves BEGIN's and COMMIT's round trips
    starts_as_seen = True  # row versions (xmin, ctid) tell a changed row

    def __init__(self, url: str, *, synchronous: str = "FULL", busy_timeout_ms: int = 5000) -> None:
        self.url = url
        self._busy_timeout_ms = busy_timeout_ms
        self._lock_conn: Any = None  # holds this host instance's session lock
        self._lock_held = True  # the lock connection holds the lock (see keep_lock)
        self._claimed: str | None = None  # the instance whose lock is held
        # The lock connection is used by one thread at a time (a heartbeat's keep_lock
        # runs in an executor thread, on after its task was cancelled), and not made
        # again once the store closed: see close.
        self._guard = threading.Lock()
        self._closed = False

    def open(self) -> Engines:
        """Migrate the database to head (never two hosts at once) and make the engines.
        Other hosts may share the database (design §12); ``claim`` names this one.

        Raises:
            errors.SchemaMismatch: the database is not ours to migrate.
            errors.StoreError: the server cannot be reached or refuses us.
        """
        made: list[Engine] = []
        self._closed = False
        try:
            self._lock_conn = connect(self.url, "delegation-host")
            refuse_pooled_transactions(self._lock_conn, self.url)
            admin.upgrade(self.url, beside_hosts=True)
            made.append(self._writer("delegation-writer"))
            made.append(reader_engine(self.url))
            made.append(self._writer("delegation-writer-unflushed", synchronous_commit="off"))
            with made[0].connect():
                pass  # reach the server now, not in the first batch
        except BaseException:
            for engine in made:
                engine.dispose()
            raise
        return Engines(*made)

    def _writer(self, application: str, **settings: str) -> Engine:
        """An engine for write connections: inline statements wait INLINE_LOCK_TIMEOUT_MS
        for a row lock, the writer's transactions busy_timeout (their BEGIN sets it)."""
        return make_engine(
            self.url,
            application,
            begin=self._writer_begin(),
            # A host stopped mid-batch (SIGSTOP) must not hold its rows locked against
            # the host taking over from it: the server ends its session.
            options={
                "lock_timeout": str(INLINE_LOCK_TIMEOUT_MS),
                "idle_in_transaction_session_timeout": IDLE_IN_TRANSACTION_MS,
                **settings,
            },
        )

    def _writer_begin(self) -> str:
        """The writer thread's BEGIN: its transactions wait busy_timeout for a lock."""
        return f"BEGIN; SET LOCAL lock_timeout = {self._busy_timeout_ms}"

    def close(self) -> None:
        """Let go of the host's lock. A heartbeat still in keep_lock (its task cancelled,
        its thread not) is waited for, at most the TCP timeouts on a silent server, and
        makes no connection after: one it made would hold the instance's lock unclosed
        until the garbage collector found it."""
        with self._guard:
            self._closed = True
            lock, self._lock_conn = self._lock_conn, None
            if lock is not None:
                release_instance_lock(lock, self._claimed)

    @contextlib.contextmanager
    def _lock_session(self) -> Iterator[None]:
        """The lock connection, for this thread alone; refused once the store closed."""
        with self._guard:
            if self._closed:
                raise closed()
            yield

    # --- the host's lock ----------------------------------------------------------

    def ready_to_claim(self, instance_id: str) -> None:
        if not _INSTANCE_ID.fullmatch(instance_id):
            raise ValueError(f"not a host instance id: {instance_id!r}")
        with self._lock_session():
            self._ready_to_claim()

    def _ready_to_claim(self) -> None:
        lock = self._lock_conn
        if lock is None or lock.closed:  # lost with the server: a new session holds it
            try:
                self._lock_conn = connect(self.url, "delegation-host")
            except errors.StoreError as exc:
                raise errors.StoreUnavailable() from exc

    def hold(self, previous: str | None, instance_id: str) -> None:
        """Hold ``instance_id``'s lock (and no longer ``previous``'s) before the instance
        is written anywhere: another host takes an instance whose lock is free for dead.
        A session lost meanwhile (a server restart) held neither: the lock is taken on a
        new one.

        Raises:
            errors.StoreUnavailable: the server cannot be reached now (nothing is held).
            errors.StoreError: the server refused the lock for another reason.
        """
        with self._lock_session():
            self._hold(previous, instance_id)

    def _hold(self, previous: str | None, instance_id: str) -> None:
        lock = self._lock_conn
        self._claimed, self._lock_held = instance_id, False
        try:
            if previous is not None:
                lock.execute(
                    "SELECT pg_advisory_unlock(%s, hashtext(%s))", (INSTANCE_LOCKS, previous)
                )
            lock.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (INSTANCE_LOCKS, instance_id))
        except Exception as exc:
            if not unavailable(exc):
                raise translate(exc) from exc
            with contextlib.suppress(Exception):
                lock.close()
            self._lock_conn = None
            self._hold_anew(instance_id)
        self._lock_held = True

    def _hold_anew(self, instance_id: str) -> None:
        """Take ``instance_id``'s lock on a new session (the old one was lost)."""
        try:
            lock = connect(self.url, "delegation-host")
        except errors.StoreError as exc:
            raise errors.StoreUnavailable() from exc
        try:
            lock.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (INSTANCE_LOCKS, instance_id))
        except Exception as exc:
            with contextlib.suppress(Exception):
                lock.close()
            raise translate(exc) from exc
        self._lock_conn = lock

    def keep_lock(self, instance_id: str | None) -> None:
        """Hold this instance's lock again if its connection was lost (a server restart
        or failover frees every lock): called before each heartbeat, which commits only
        while the lock is held (``lifecycle.heartbeat``).

        Raises:
            errors.StoreUnavailable: the server cannot be reached (the next beat tries).
        """
        if instance_id is None:
            return
        with self._lock_session():
            self._keep_lock(instance_id)

    def _keep_lock(self, instance_id: str) -> None:
        lock = self._lock_conn
        try:
            if lock is not None and not lock.closed:
                if self._lock_held:
                    lock.execute("SELECT 1")  # a dead session is found only by using it
                else:  # its old session, ended, may have held it a moment longer
                    self._lock_held = self._try_lock(lock, instance_id)
                return
        except Exception as exc:
            if not unavailable(exc):
                raise translate(exc) from exc
        if lock is not None:
            with contextlib.suppress(Exception):
                lock.close()
        self._lock_conn, self._lock_held = None, False
        try:
            lock = connect(self.url, "delegation-host")
        except errors.StoreError as exc:
            raise errors.StoreUnavailable() from exc
        self._lock_conn = lock
        self._lock_held = self._try_lock(lock, instance_id)
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

    # --- transactions -------------------------------------------------------------

    def try_begin(
        self, raw: Any, *, relaxed: bool, instance: str | None
    ) -> tuple[bool, str | None]:
        # PostgreSQL has no database-wide write lock to wait for, but a statement can
        # wait for another connection's row lock. Inline, on the loop's thread, it
        # waits at most the session's lock_timeout (INLINE_LOCK_TIMEOUT_MS); then the
        # batch is undone and the writer runs it again (``Redo``), waiting busy_timeout.
        # A connection the server dropped is left to the writer, which connects again.
        if raw.closed:
            return False, None
        try:
            return True, self._open_transaction(raw, "BEGIN", relaxed, instance)
        except Exception:
            with contextlib.suppress(Exception):
                if in_transaction(raw):
                    raw.execute("ROLLBACK")
            return False, None

    def begin(self, raw: Any, *, relaxed: bool, instance: str | None) -> str | None:
        return self._open_transaction(raw, self._writer_begin(), relaxed, instance)

    @staticmethod
    def _open_transaction(raw: Any, sql: str, relaxed: bool, instance: str | None) -> str | None:
        """BEGIN, the batch's settings and the fence's read in one round trip (a simple
        query of several statements): who took ``instance`` over, if any.

        A batch of only writes nobody was answered for (``relaxed``) commits without
        waiting for the WAL flush; the next durable commit flushes the WAL up to
        itself, so it makes the earlier one durable too."""
        if relaxed:
            sql += "; SET LOCAL synchronous_commit = off"
        if instance is None:
            raw.execute(sql)
            return None
        # The row is share-locked until the batch commits, so a takeover (which updates
        # it) waits for the batch, and a batch after the takeover sees it. The id is
        # this host's own (checked in ready_to_claim), safe as a literal.
        cursor = raw.execute(
            f"{sql}; SELECT taken_by FROM engine_instances WHERE id = '{instance}' FOR SHARE"
        )
        while cursor.nextset():
            pass
        row = cursor.fetchone()
        return row[0] if row is not None else None

    in_transaction = staticmethod(in_transaction)

    @staticmethod
    def changes(raw: Any) -> int | None:
        return None  # not known: a batch where a job failed is always redone

    @staticmethod
    def lost(raw: Any) -> bool:
        return bool(raw.closed)

    def announce(self, raw: Any, child_ids: set[int]) -> None:
        """Other hosts and followers learn which children have new events (the payload
        is cut to what NOTIFY carries; an empty one means "look at everything")."""
        ids = ",".join(str(i) for i in sorted(child_ids))
        raw.execute("SELECT pg_notify(%s, %s)", (admin.CHANNEL, ids if len(ids) < 7900 else ""))

    # --- notices and files ----------------------------------------------------------

    def verify(self) -> None:
        """Nothing to check: a server's database is no file that can be replaced."""

    def let_go(self) -> None:
        """Nothing to give up (see verify)."""

    def watch(self, interval: float) -> Watch:
        return PostgresWatch(self.url, interval)

    def protected_paths(self) -> list[str]:
        """No file of the database: a server's (see :meth:`secret_paths`)."""
        return []

    def secret_paths(self) -> list[str]:
        """libpq's files of credentials the host may use, named in its URL, its
        environment or by default (design §23, :mod:`delegation.store.credentials`)."""
        return credentials.files(self.url)
