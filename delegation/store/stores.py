"""Which store a URL names, and what the rest of the package asks of it by URL.

``sqlite:///PATH`` is the SQLite store (:mod:`delegation.store.sqlite`);
``postgresql+psycopg://…`` (or plain ``postgresql://…``, which means psycopg 3 here)
is the PostgreSQL one (:mod:`delegation.store.postgres`, extra ``durable-delegation[postgres]``).
Either is the one writer (:class:`delegation.store.database.Database`) composed with
that store's dialect.
Nothing outside ``store/`` looks at a URL's scheme.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, make_url
from sqlalchemy.exc import ArgumentError

from delegation import dburl
from delegation.store import migrate
from delegation.store.database import Database
from delegation.store.interface import Store
from delegation.store.postgres.connect import libpq
from delegation.store.sqlite import files
from delegation.store.sqlite.dialect import SqliteDialect
from delegation.store.sqlite.watch import FileWatch
from delegation.store.watch import Watch

T = TypeVar("T")


class Reader(Protocol):
    def read(self, fn: Callable[[Connection], T]) -> T: ...

    def close(self) -> None: ...


def normalize(url: str) -> str:
    """``url`` with its driver made explicit, and several PostgreSQL hosts named in one
    spelling, ``?host=h1,h2&port=p1,p2`` (see :mod:`delegation.dburl`): what SQLAlchemy's
    engines and :func:`libpq` read alike. A URL of neither store is refused.

    Raises:
        ValueError: not a SQLite file URL nor a PostgreSQL one, or a PostgreSQL URL that
            cannot be read (one line saying why).
    """
    try:
        parsed = make_url(dburl.one_spelling(url))
    except ArgumentError:
        parsed = None
    if parsed is not None and parsed.get_backend_name() == "postgresql":
        if parsed.drivername == "postgresql":  # SQLAlchemy's default would be psycopg2
            parsed = parsed.set(drivername="postgresql+psycopg")
        if parsed.drivername != "postgresql+psycopg":
            raise ValueError(
                "delegation talks to PostgreSQL through psycopg 3: postgresql+psycopg://…"
            )
        _need_psycopg()
        return parsed.render_as_string(hide_password=False)
    files.sqlite_path(url)  # raises ValueError for anything else
    return url


def is_postgres(url: str) -> bool:
    return make_url(url).get_backend_name() == "postgresql"


def _need_psycopg() -> None:
    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            "PostgreSQL needs psycopg 3: pip install 'durable-delegation[postgres]'"
        ) from exc


def open_store(url: str, *, synchronous: str, busy_timeout_ms: int) -> Store:
    """The store for ``url``, not opened yet (see :class:`Store`)."""
    url = normalize(url)
    if is_postgres(url):
        from delegation.store.postgres.dialect import PostgresDialect

        return Database(
            url, PostgresDialect(url, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
        )
    dialect = SqliteDialect(url, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
    return Database(url, dialect)


def open_watch(url: str, interval: float) -> Watch:
    """Notices of commits other processes make to the database at ``url``."""
    url = normalize(url)
    if is_postgres(url):
        from delegation.store.postgres.watch import PostgresWatch

        return PostgresWatch(url, interval)
    return FileWatch(files.sqlite_path(url), interval)


def reader(url: str) -> Reader:
    """A read-only view, safe beside a live host (it never migrates nor writes).

    Raises:
        errors.StoreError: no database there (SQLite: no file), or it cannot be reached.
    """
    url = normalize(url)
    if is_postgres(url):
        from delegation.store.postgres.admin import PostgresReadOnly

        return PostgresReadOnly(url)
    return files.ReadOnly(url)


def read_once(url: str, fn: Callable[[Connection], T]) -> T:
    view = reader(url)
    try:
        return view.read(fn)
    finally:
        view.close()


def write_once(url: str, fn: Callable[[Connection], T], *, busy_timeout_ms: int = 5000) -> T:
    """One short write transaction beside a live host (``sqlite.files.write_once``); on
    PostgreSQL the host is told at once (``NOTIFY``)."""
    url = normalize(url)
    if is_postgres(url):
        from delegation.store.postgres import admin

        return admin.write_once(url, fn, busy_timeout_ms=busy_timeout_ms)
    return files.write_once(url, fn, busy_timeout_ms=busy_timeout_ms)


def upgrade(
    url: str, *, apply: bool, on_step: migrate.OnStep | None = None
) -> tuple[str | None, str | None]:
    """The schema revision before and after an optional upgrade to head (``on_step``:
    told of each revision applied)."""
    url = normalize(url)
    if is_postgres(url):
        from delegation.store.postgres import admin

        if not apply:
            current = admin.revision(url)
            return current, current
        return admin.upgrade(url, on_step=on_step)
    return files.upgrade_file(url, apply=apply, on_step=on_step)


def with_database(url: str, name: str) -> str:
    """``url`` naming database ``name`` on the same server."""
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def file_of(url: str) -> Any:
    """The SQLite file behind ``url``; None for a store without one."""
    url = normalize(url)
    return None if is_postgres(url) else files.sqlite_path(url)


__all__ = [
    "Reader",
    "file_of",
    "is_postgres",
    "libpq",
    "normalize",
    "open_store",
    "open_watch",
    "read_once",
    "reader",
    "upgrade",
    "write_once",
]
