"""The SQLite dialect of the store's writer (:class:`delegation.store.database.Database`).

One host per file, held by the file's lock (design §9): nothing is shared, fenced or
claimed. SQLite has a single writer, so the engine does not fight for the lock: the
write connection's busy handler is off (an inline commit on the loop's thread never
waits), and the writer thread waits for the lock itself, up to ``busy_timeout``, with
pauses that grow from 1 to 50 ms.

Durability: batches commit at the configured ``synchronous`` level (``FULL``), except
a batch of only ``durable=False`` jobs -- writes nobody has been answered for, which a
synced commit always follows before anyone is -- which commits at ``NORMAL``: it
survives a crash of the process, and only a power loss before the next synced commit
could undo it.

A replaced file (design §18): the host's lock and connections hold the file it opened,
not its path. A file renamed over the path while the host runs (a backup restored)
is noticed by :meth:`SqliteDialect.verify` -- one ``stat`` of the path before each
commit, and at the engine's periodic check -- and from then on every batch is refused
with ``DatabaseReplaced``: nothing more is committed, to either file.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from delegation import errors
from delegation.store import migrate
from delegation.store.dialect import Engines
from delegation.store.sql import dbapi
from delegation.store.sqlite.errors import is_busy
from delegation.store.sqlite.files import check_file, make_engine, sqlite_path
from delegation.store.sqlite.hostlock import HostLock
from delegation.store.sqlite.watch import FileWatch
from delegation.store.watch import Watch

_SQLITE_MIN = (3, 35, 5)  # UPDATE ... RETURNING, with the fixes of 3.35.5
_BUSY_PAUSE_MAX_S = 0.05  # the longest pause between two tries of a busy BEGIN
# WAL at NORMAL survives a crash of the process; only a power loss can undo its last
# commits, and the next synced commit makes them durable too (the WAL is one file).
_RELAXED = {"FULL": "NORMAL", "EXTRA": "NORMAL"}


class SqliteDialect:
    shared = False  # one host per SQLite file (its lock)
    writes_alone = False  # BEGIN and COMMIT cost no round trip: every job is batched
    starts_as_seen = False  # no row versions; a start reads in its own transaction

    def __init__(self, url: str, *, synchronous: str = "FULL", busy_timeout_ms: int = 5000) -> None:
        self.url = url
        self.path = sqlite_path(url)
        synchronous = synchronous.upper()
        # Batches that hold nothing anyone was told about commit without the sync.
        self._levels = {False: synchronous, True: _RELAXED.get(synchronous, synchronous)}
        self._level = synchronous
        self._pragmas = {
            "journal_mode": "WAL",
            "synchronous": synchronous,
            "busy_timeout": str(busy_timeout_ms),
            "foreign_keys": "ON",
        }
        self._busy_timeout_s = busy_timeout_ms / 1000
        self._lock: HostLock | None = None
        self._replaced = False  # once noticed, for good (see verify)

    def open(self) -> Engines:
        """Lock the file for this host's life first (a second host on it, in any
        process, is refused before anything is read or written), create it if needed,
        and migrate it to head.

        Raises:
            errors.HostConflict: another live host holds the file, or its -wal (nothing
                is written, nothing created).
            errors.SchemaMismatch: the file is not ours to migrate (nothing is written,
                nothing created).
            errors.DatabaseReadOnly: the file may not be written (nothing is changed).
            errors.StoreError: its directory is missing; SQLite cannot open or write the
                file, cannot keep it in WAL mode, or is older than 3.35.5.
        """
        if sqlite3.sqlite_version_info < _SQLITE_MIN:
            raise errors.StoreError(
                f"delegation needs SQLite 3.35.5 or newer; this Python has {sqlite3.sqlite_version}"
            )
        self._lock, self._replaced = HostLock.acquire(self.path), False
        check_file(self.url)
        self._lock.restrict_modes()  # only now: another application's file keeps its mode
        writer = make_engine(
            self.url,
            begin="BEGIN IMMEDIATE",
            # SQLite's busy handler would make an inline commit wait on the loop's
            # thread: it is off on every write connection, and the writer thread waits
            # for the lock itself (``begin``); only the migration below waits in it.
            pragmas={**self._pragmas, "busy_timeout": "0"},
            pool_size=1,
            shared=True,  # the writer thread's, lent to the loop while the writer idles
        )
        read_pragmas = {**self._pragmas, "query_only": "ON"}
        del read_pragmas["journal_mode"]
        reader = make_engine(self.url, begin="BEGIN", pragmas=read_pragmas, pool_size=1)
        try:
            with writer.connect() as conn:  # the pool's one connection
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
            self._lock.hold_log()  # SQLite made it; nothing written since
        except BaseException:
            writer.dispose()
            reader.dispose()
            raise
        return Engines(writer, reader)

    def close(self) -> None:
        # Last, once no connection of ours is open: closing the lock's descriptor drops
        # the POSIX locks SQLite holds on the file in this process.
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def verify(self) -> None:
        """Refuse to commit once the path names another file than the one this host
        opened and holds (one ``stat``; noticed once, refused for good).

        Raises:
            errors.DatabaseReplaced: the file was replaced (or removed) while in use.
        """
        if not self._replaced and self._lock is not None and self._lock.replaced():
            self._replaced = True
        if self._replaced:
            raise errors.DatabaseReplaced()

    def let_go(self) -> None:
        """The file was replaced and this host's runs stopped: remove its -wal and -shm
        from the path, if still its own (see ``HostLock.let_go``)."""
        if self._lock is not None:
            self._lock.let_go()

    def _synchronous(self, raw: Any, relaxed: bool) -> None:
        """The sync level the batch needs (SQLite takes it only between transactions)."""
        level = self._levels[relaxed]
        if level != self._level:
            raw.execute(f"PRAGMA synchronous={level}")
            self._level = level

    def try_begin(
        self, raw: Any, *, relaxed: bool, instance: str | None
    ) -> tuple[bool, str | None]:
        self._synchronous(raw, relaxed)
        try:
            raw.execute("BEGIN IMMEDIATE")  # the write connection never waits (begin)
        except sqlite3.OperationalError:
            return False, None
        return True, None

    def begin(self, raw: Any, *, relaxed: bool, instance: str | None) -> str | None:
        """``BEGIN IMMEDIATE``, waiting up to the busy timeout while another connection
        holds the write lock, with pauses that grow from 1 to 50 ms (SQLite's own
        handler waits alike).

        Raises:
            sqlite3.OperationalError: still busy at the deadline, or any other failure.
        """
        self._synchronous(raw, relaxed)
        deadline: float | None = None
        pause = 0.001
        while True:
            try:
                raw.execute("BEGIN IMMEDIATE")
                return None
            except sqlite3.OperationalError as exc:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._busy_timeout_s
                if not is_busy(exc) or now >= deadline:
                    raise
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, _BUSY_PAUSE_MAX_S)

    @staticmethod
    def in_transaction(raw: Any) -> bool:
        return bool(raw.in_transaction)

    @staticmethod
    def changes(raw: Any) -> int | None:
        return int(raw.total_changes)

    @staticmethod
    def lost(raw: Any) -> bool:
        return False  # a SQLite file cannot drop the connection

    def announce(self, raw: Any, child_ids: set[int]) -> None:
        """Nothing to do: ``PRAGMA data_version`` moves by itself (FileWatch)."""

    def ready_to_claim(self, instance_id: str) -> None:
        """Nothing to do: the file's lock already makes this host the only one."""

    def hold(self, previous: str | None, instance_id: str) -> None:
        """Nothing to do (see ready_to_claim)."""

    def keep_lock(self, instance_id: str | None) -> None:
        """Nothing to do: the file's lock is this process's own, never lost."""

    def watch(self, interval: float) -> Watch:
        return FileWatch(self.path, interval)

    def protected_paths(self) -> list[str]:
        return [str(self.path.parent)]

    def secret_paths(self) -> list[str]:
        return []  # the database's directory stands for it whole
