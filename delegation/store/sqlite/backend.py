"""The SQLite store's record (:class:`delegation.store.backend.Backend`): one file, one
live host (design §9), the one writer composed with :class:`SqliteDialect`, its
spelling of the shared SQL (:mod:`.spelling`) and what sqlite3's errors mean
(:mod:`.errors`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Connection

from delegation.store import migrate
from delegation.store.backend import Backend, Reader
from delegation.store.database import Database
from delegation.store.interface import Store
from delegation.store.registry import DriverErrors
from delegation.store.spelling import Spelling
from delegation.store.sqlite import errors as sqlite_errors
from delegation.store.sqlite import files
from delegation.store.sqlite.dialect import SqliteDialect
from delegation.store.sqlite.spelling import SQLITE
from delegation.store.sqlite.watch import FileWatch
from delegation.store.watch import Watch

T = TypeVar("T")


class SqliteBackend:
    name = "sqlite"
    shared = False
    spelling: Spelling = SQLITE
    errors: DriverErrors = sqlite_errors

    def normalize(self, url: str) -> str:
        files.sqlite_path(url)  # refuses an in-memory database and a file: URI
        return url

    def open(self, url: str, *, synchronous: str, busy_timeout_ms: int) -> Store:
        dialect = SqliteDialect(url, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
        return Database(url, dialect)

    def watch(self, url: str, interval: float) -> Watch:
        return FileWatch(files.sqlite_path(url), interval)

    def reader(self, url: str) -> Reader:
        return files.ReadOnly(url)

    def write_once(self, url: str, fn: Callable[[Connection], T], *, busy_timeout_ms: int) -> T:
        return files.write_once(url, fn, busy_timeout_ms=busy_timeout_ms)

    def upgrade(
        self, url: str, *, apply: bool, on_step: migrate.OnStep | None
    ) -> tuple[str | None, str | None]:
        return files.upgrade_file(url, apply=apply, on_step=on_step)

    def file_of(self, url: str) -> Path | None:
        return files.sqlite_path(url)

    def dsn(self, url: str) -> str:
        return str(files.sqlite_path(url))

    def migrating(self, connection: Connection) -> AbstractContextManager[None]:
        return files.keeping_rows(connection)


BACKEND: Backend = SqliteBackend()
