"""SQLite's files: what a URL names, how a connection is set up (pragmas, our own
``BEGIN``), a migration's rows kept through a table's rebuild, and the short-lived views
and writes the operator's tools use beside a live host (a read-only view, an upgrade, a
control request)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

from sqlalchemy import Connection, Engine, create_engine, event

from delegation import errors
from delegation.store import migrate
from delegation.store.backend import ACCEPTED_URLS
from delegation.store.failures import translate, translated
from delegation.store.sql import dbapi
from delegation.store.sqlite.hostlock import HostLock

T = TypeVar("T")


def sqlite_path(url: str) -> Path:
    """The file behind a ``sqlite:///`` URL; in-memory databases are refused."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        raise ValueError(f"delegation needs {ACCEPTED_URLS}")
    if url[len(prefix) :] in ("", ":memory:"):
        raise ValueError("delegation needs a SQLite file (sqlite:///PATH), not an in-memory one")
    path, _, query = url[len(prefix) :].partition("?")
    # With uri=true SQLite opens the file a "file:" URI names, not this path: the host
    # lock would be taken on another file (a second host on a live one).
    if "uri" in {key.lower() for key in parse_qs(query, keep_blank_values=True)}:
        raise ValueError("delegation needs a plain SQLite file URL, not a file: URI")
    return Path(path)


def make_engine(
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


class ReadOnly:
    """A read-only view of a database file, safe beside a running host (WAL readers).

    It never migrates and never writes; the caller checks the schema revision
    (see ``Inspector.revision``) before trusting the tables.
    """

    def __init__(self, url: str, *, immutable: bool = False) -> None:
        path = sqlite_path(url)
        if not path.is_file():
            raise errors.StoreError(f"no delegation database at {path}")
        if not immutable and not Path(f"{path}-wal").exists():
            # A WAL reader would leave a -wal and -shm beside a file it then refuses.
            ReadOnly.read_once(url, migrate.check, immutable=True)
        # immutable: read the file alone, creating no -wal nor -shm (see check_file).
        options = "mode=ro&immutable=1" if immutable else "mode=ro"
        self._engine = create_engine(
            f"sqlite:///file:{path}?{options}&uri=true", pool_size=1, max_overflow=0
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
    def read_once(cls, url: str, fn: Callable[[Connection], T], *, immutable: bool = False) -> T:
        """Open ``url`` read-only, run ``fn``, and close it again."""
        reader = cls(url, immutable=immutable)
        try:
            return reader.read(fn)
        finally:
            reader.close()


def check_file(url: str) -> None:
    """Refuse a file this code must not migrate (``migrate.check``) before writing to it:
    even the writer's first pragma (WAL) would change another application's file.

    Call it holding the file's lock. Without a -wal beside it, the file alone holds
    every commit, and it is read as immutable: a read-only WAL reader would create the
    -wal and -shm, and leave them beside a file that is then refused. A -wal left by a
    crash holds commits too: it is read through (and the -shm it needs may be made)."""
    path = sqlite_path(url)
    if not path.is_file() or path.stat().st_size == 0:
        return  # a new database
    alone = not Path(f"{path}-wal").exists()
    ReadOnly.read_once(url, migrate.check, immutable=alone)


@contextlib.contextmanager
def keeping_rows(connection: Connection) -> Iterator[None]:
    """A revision that rebuilds a table (a CHECK changed) drops the old one, and with
    foreign keys on, that drop deletes every row that references it, cascading
    (``children``'s events, steps, steers). Foreign keys are off while it migrates,
    and checked after: a dangling reference refuses the migration. Only between
    transactions may they be switched; inside one (a caller's), nothing changes."""
    raw = connection.connection.dbapi_connection
    if raw is None or raw.in_transaction:
        yield
        return
    (before,) = raw.execute("PRAGMA foreign_keys").fetchone()
    raw.execute("PRAGMA foreign_keys=OFF")
    try:
        yield
        dangling = raw.execute("PRAGMA foreign_key_check").fetchall()
        if dangling:
            first = dangling[0]
            raise errors.SchemaMismatch(
                f"the migration left {len(dangling)} rows referencing nothing (first: {first})"
            )
    finally:
        raw.execute(f"PRAGMA foreign_keys={'ON' if before else 'OFF'}")


def upgrade_file(
    url: str, *, apply: bool, on_step: migrate.OnStep | None = None
) -> tuple[str | None, str | None]:
    """The schema revision of a file before and after an optional upgrade to head
    (``on_step``: told of each revision applied)."""
    if not apply:
        current = ReadOnly.read_once(url, migrate.checked_revision)
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
    engine = make_engine(
        url,
        begin="BEGIN IMMEDIATE",
        pragmas={"busy_timeout": str(busy_timeout_ms), "foreign_keys": "ON"},
        pool_size=1,
    )
    try:
        with translated(), engine.connect() as conn, conn.begin():
            migrate.at_head(conn, str(path))
            return fn(conn)
    finally:
        engine.dispose()
