"""The dialects the store knows, one line each in :data:`DIALECTS`: a new dialect is its
folder (a ``backend`` module exporting ``BACKEND``, its
:class:`~delegation.store.backend.Backend`) and its line here.

A record is found by its name, which is both a URL's scheme (``postgresql`` of
``postgresql+psycopg://…``: :func:`delegation.store.backend.backend_of`) and
SQLAlchemy's name of a connection's dialect (``conn.dialect.name``); its module is
imported when first asked for. The store's own modules reach a dialect only here, through
the part of its record they read (:class:`Record`): how it spells the shared SQL (for
:mod:`delegation.store.sql`), what its driver's errors mean (for
:mod:`delegation.store.failures`) and what it does around a migration (for
:mod:`delegation.store.migrate`). None of them imports a dialect's module.
"""

from __future__ import annotations

import functools
import importlib
from contextlib import AbstractContextManager
from typing import Protocol

from sqlalchemy import Connection

from delegation.store.spelling import Spelling

# Each dialect's name and the module of its record.
DIALECTS = {
    "sqlite": "delegation.store.sqlite.backend",
    "postgresql": "delegation.store.postgres.backend",
}


class DriverErrors(Protocol):
    """What a driver's exceptions mean (each dialect's ``errors`` module), asked of the
    driver's own exception (under SQLAlchemy's wrapper, its ``orig``)."""

    def owns(self, cause: BaseException) -> bool:
        """Whether ``cause`` is this driver's."""
        ...

    def is_busy(self, cause: BaseException) -> bool:
        """Another transaction holds what it needs: the same work may succeed later."""
        ...

    def away(self, cause: BaseException) -> bool:
        """The server cannot be reached or cannot take writes now."""
        ...

    def read_only_server(self, cause: BaseException) -> bool:
        """The server takes no writes (in a read-only transaction of ours, the read's
        own fault)."""
        ...

    def refused(self, cause: BaseException) -> bool:
        """A constraint's refusal (the same statement would fail again)."""
        ...


class Record(Protocol):
    """What the store's own modules read of a dialect's record."""

    name: str  # its key in DIALECTS
    spelling: Spelling
    errors: DriverErrors

    def migrating(self, connection: Connection) -> AbstractContextManager[None]:
        """Around a migration on ``connection`` (SQLite: the rows a table's rebuild
        would delete are kept)."""
        ...


def record(name: str) -> Record:
    """The record of the dialect ``name``.

    Raises:
        KeyError: no dialect of that name.
    """
    found: Record = importlib.import_module(DIALECTS[name]).BACKEND
    return found


_SPELLINGS: dict[str, Spelling] = {}


def spelling(name: str) -> Spelling:
    """The spelling of the dialect ``name``, kept once asked (the plain SQL asks it for
    every statement).

    Raises:
        KeyError: no dialect of that name.
    """
    found = _SPELLINGS.get(name)
    if found is None:
        found = _SPELLINGS[name] = record(name).spelling
    return found


@functools.cache
def drivers() -> tuple[DriverErrors, ...]:
    """What each dialect's driver errors mean, in :data:`DIALECTS`' order (the records
    are imported when the first failure is told)."""
    return tuple(record(name).errors for name in DIALECTS)
