"""What the rest of the package asks of a store by URL, through its record
(:mod:`delegation.store.backend`): nothing outside ``store/`` looks at a URL's scheme."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Connection, make_url

from delegation.store import migrate
from delegation.store.backend import Backend, Reader, as_url, backend_of
from delegation.store.interface import Store
from delegation.store.watch import Watch

T = TypeVar("T")


def _found(url: str) -> tuple[Backend, str]:
    url = as_url(url)
    backend = backend_of(url)
    return backend, backend.normalize(url)


def normalize(url: str) -> str:
    """``url`` as every connection of its store reads it (a plain path: the SQLite URL
    of that file).

    Raises:
        ValueError: not a SQLite file nor a PostgreSQL URL, or one that cannot be read
            (one line saying why).
    """
    return _found(url)[1]


def store_name(url: str) -> str:
    """``sqlite`` or ``postgresql``: the store ``url`` names."""
    return _found(url)[0].name


def open_store(url: str, *, synchronous: str, busy_timeout_ms: int) -> Store:
    """The store for ``url``, not opened yet (see :class:`Store`)."""
    backend, url = _found(url)
    return backend.open(url, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)


def open_watch(url: str, interval: float) -> Watch:
    """Notices of commits other processes make to the database at ``url``."""
    backend, url = _found(url)
    return backend.watch(url, interval)


def reader(url: str) -> Reader:
    """A read-only view, safe beside a live host (it never migrates nor writes).

    Raises:
        errors.StoreError: no database there (SQLite: no file), or it cannot be reached.
    """
    backend, url = _found(url)
    return backend.reader(url)


def read_once(url: str, fn: Callable[[Connection], T]) -> T:
    view = reader(url)
    try:
        return view.read(fn)
    finally:
        view.close()


def write_once(url: str, fn: Callable[[Connection], T], *, busy_timeout_ms: int = 5000) -> T:
    """One short write transaction beside a live host (SQLite: beside its lock; on
    PostgreSQL the host is told at once, ``NOTIFY``)."""
    backend, url = _found(url)
    return backend.write_once(url, fn, busy_timeout_ms=busy_timeout_ms)


def upgrade(
    url: str, *, apply: bool, on_step: migrate.OnStep | None = None
) -> tuple[str | None, str | None]:
    """The schema revision before and after an optional upgrade to head (``on_step``:
    told of each revision applied)."""
    backend, url = _found(url)
    return backend.upgrade(url, apply=apply, on_step=on_step)


def with_database(url: str, name: str) -> str:
    """``url`` naming database ``name`` on the same server."""
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def libpq(url: str) -> str:
    """psycopg's connection string for a PostgreSQL URL (its record's
    :meth:`~delegation.store.backend.Backend.dsn`), for a tool's own connection."""
    return backend_of(as_url(url)).dsn(url)


def file_of(url: str) -> Path | None:
    """The SQLite file behind ``url``; None for a store without one."""
    backend, url = _found(url)
    return backend.file_of(url)


__all__ = [
    "Reader",
    "file_of",
    "libpq",
    "normalize",
    "open_store",
    "open_watch",
    "read_once",
    "reader",
    "store_name",
    "upgrade",
    "write_once",
]
