"""The PostgreSQL store's record (:class:`delegation.store.backend.Backend`): several
hosts on one database (design §12), through psycopg 3 (extra
``durable-delegation[postgres]``), the one writer composed with
:class:`~delegation.store.postgres.dialect.PostgresDialect`, its spelling of the shared
SQL (:mod:`.spelling`) and what psycopg's errors mean (:mod:`.errors`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Connection, make_url
from sqlalchemy.exc import ArgumentError

from delegation.store import dburl, migrate
from delegation.store.backend import Backend, Reader
from delegation.store.database import Database
from delegation.store.interface import Store
from delegation.store.postgres import admin
from delegation.store.postgres import errors as postgres_errors
from delegation.store.postgres.connect import libpq
from delegation.store.postgres.dialect import PostgresDialect
from delegation.store.postgres.spelling import POSTGRES
from delegation.store.postgres.watch import PostgresWatch
from delegation.store.registry import DriverErrors
from delegation.store.spelling import Spelling
from delegation.store.watch import Watch

T = TypeVar("T")


class PostgresBackend:
    name = "postgresql"
    shared = True
    spelling: Spelling = POSTGRES
    errors: DriverErrors = postgres_errors

    def normalize(self, url: str) -> str:
        """The driver made explicit (psycopg 3), several hosts named in one spelling
        (``?host=h1,h2&port=p1,p2``, :mod:`delegation.store.dburl`): what SQLAlchemy's
        engines and libpq read alike."""
        try:
            parsed = make_url(dburl.one_spelling(url))
        except ArgumentError as exc:
            raise ValueError(f"not a PostgreSQL URL: {exc}") from None
        if parsed.drivername == "postgresql":  # SQLAlchemy's default would be psycopg2
            parsed = parsed.set(drivername="postgresql+psycopg")
        if parsed.drivername != "postgresql+psycopg":
            raise ValueError(
                "delegation talks to PostgreSQL through psycopg 3: postgresql+psycopg://…"
            )
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise ValueError(
                "PostgreSQL needs psycopg 3: pip install -e '.[postgres]' from the checkout"
                " (once published: pip install 'durable-delegation[postgres]')"
            ) from exc
        return parsed.render_as_string(hide_password=False)

    def open(self, url: str, *, synchronous: str, busy_timeout_ms: int) -> Store:
        dialect = PostgresDialect(url, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
        return Database(url, dialect)

    def watch(self, url: str, interval: float) -> Watch:
        return PostgresWatch(url, interval)

    def reader(self, url: str) -> Reader:
        return admin.PostgresReadOnly(url)

    def write_once(self, url: str, fn: Callable[[Connection], T], *, busy_timeout_ms: int) -> T:
        return admin.write_once(url, fn, busy_timeout_ms=busy_timeout_ms)

    def upgrade(
        self, url: str, *, apply: bool, on_step: migrate.OnStep | None
    ) -> tuple[str | None, str | None]:
        if not apply:
            current = admin.revision(url)
            return current, current
        return admin.upgrade(url, on_step=on_step)

    def file_of(self, url: str) -> Path | None:
        return None

    def dsn(self, url: str) -> str:
        return libpq(url)

    def migrating(self, connection: Connection) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # a rebuild's drop deletes no row it keeps


BACKEND: Backend = PostgresBackend()
