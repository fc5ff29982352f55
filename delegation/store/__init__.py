"""Persistence: the only package that imports SQLAlchemy."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar, cast

from sqlalchemy import Connection

__all__ = ["IN_LIST_MAX", "Connection", "chunks", "dbapi", "run"]

T = TypeVar("T")

# Ids bound into one ``IN (...)`` list at most: SQLite refuses a statement with more
# than 32,766 variables, and one revocation can reach tens of thousands of children.
IN_LIST_MAX = 500


def dbapi(conn: Connection) -> sqlite3.Connection:
    """The sqlite3 connection under ``conn``, in the same transaction.

    Hot paths run their few plain statements here: SQLAlchemy's per-statement result
    machinery costs more than an indexed lookup. Everything else uses Core.
    """
    return cast(sqlite3.Connection, conn.connection.dbapi_connection)


def run(conn: Connection, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
    return dbapi(conn).execute(sql, params)


def chunks(values: Iterable[T], size: int = IN_LIST_MAX) -> Iterator[list[T]]:
    """``values`` in lists of at most ``size``, for statements that bind each one."""
    batch: list[T] = []
    for value in values:
        batch.append(value)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
