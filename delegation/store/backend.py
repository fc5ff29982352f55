"""One record per store, found once by a URL's scheme (design §12, §24).

``sqlite:///PATH`` (or a plain path) is the SQLite store (:mod:`delegation.store.sqlite`);
``postgresql+psycopg://…`` (or plain ``postgresql://…``, which means psycopg 3 here) the
PostgreSQL one (:mod:`delegation.store.postgres`, extra ``durable-delegation[postgres]``).
Each dialect's package has a ``backend`` module exporting ``BACKEND``, a :class:`Backend`:
everything the package asks of a store by URL (open it, watch it, read or write it once
beside a live host, migrate it), and what the store's own modules ask of its dialect
(its spelling of the shared SQL, what its driver's errors mean). :func:`backend_of`
finds it by the scheme (its line in :data:`delegation.store.registry.DIALECTS`) and
imports only that dialect, so a SQLite host never imports psycopg. Nothing outside
``store/`` looks at a URL's scheme, and nothing in it switches on a store's name: the
record is the switch, built once per dialect (as SQLAlchemy's dialect registry and
DBOS's ``SystemDatabase.create`` pick theirs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from sqlalchemy import Connection

from delegation.store import migrate
from delegation.store.interface import Store
from delegation.store.registry import DIALECTS, Record
from delegation.store.watch import Watch

T = TypeVar("T")

ACCEPTED_URLS = (
    "a SQLite file (a path, or sqlite:///PATH) or a PostgreSQL URL (postgresql://USER@HOST/DB)"
)


class Reader(Protocol):
    def read(self, fn: Callable[[Connection], T]) -> T: ...

    def close(self) -> None: ...


class Backend(Record, Protocol):
    """What the package asks of one store by URL. Each method takes the URL as
    :meth:`normalize` made it. Its ``name`` ("sqlite", "postgresql") is what reports
    name, its line in :data:`~delegation.store.registry.DIALECTS`, and SQLAlchemy's
    name of its connections' dialect."""

    shared: bool  # several hosts may share one database of it (design §12)

    def normalize(self, url: str) -> str:
        """The URL every connection of this store reads alike.

        Raises:
            ValueError: one this store cannot take, said in one line.
        """
        ...

    def open(self, url: str, *, synchronous: str, busy_timeout_ms: int) -> Store:
        """The store, not opened yet."""
        ...

    def watch(self, url: str, interval: float) -> Watch:
        """Notices of commits other processes make."""
        ...

    def reader(self, url: str) -> Reader:
        """A read-only view, safe beside a live host (it never migrates nor writes)."""
        ...

    def write_once(self, url: str, fn: Callable[[Connection], T], *, busy_timeout_ms: int) -> T:
        """One short write transaction beside a live host, who is told of it."""
        ...

    def upgrade(
        self, url: str, *, apply: bool, on_step: migrate.OnStep | None
    ) -> tuple[str | None, str | None]:
        """The schema revision before and after an optional upgrade to head."""
        ...

    def file_of(self, url: str) -> Path | None:
        """The database's file, for a store that has one."""
        ...

    def dsn(self, url: str) -> str:
        """What the driver's own ``connect`` takes for ``url`` (psycopg's connection
        string, sqlite3's path), for a connection of a tool's beside the store's."""
        ...


def backend_of(url: str) -> Backend:
    """The store ``url`` names, by its scheme (a plain path is a SQLite file's).

    Raises:
        ValueError: a URL of neither store.
    """
    scheme = url.partition("://")[0].partition("+")[0].lower() if "://" in url else "sqlite"
    module = DIALECTS.get(scheme)
    if module is None:
        raise ValueError(f"delegation needs {ACCEPTED_URLS}")
    backend: Backend = importlib.import_module(module).BACKEND
    return backend


def as_url(url_or_path: str) -> str:
    """A plain path as the SQLite URL of that file (``file.db``: ``sqlite:///file.db``,
    relative to the working directory as a path is); a URL unchanged."""
    return url_or_path if "://" in url_or_path else f"sqlite:///{url_or_path}"
