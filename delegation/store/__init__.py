"""Persistence: the only package that imports SQLAlchemy.

Hot paths run plain SQL through :func:`run` on the DBAPI connection under a SQLAlchemy
``Connection``: SQLAlchemy's per-statement result machinery costs more than an indexed
lookup. That SQL is written once, in SQLite's spelling with ``?`` parameters and only
what both stores accept (``ON CONFLICT … DO UPDATE``, ``RETURNING``); on PostgreSQL
:func:`run` rewrites it once per statement text (``?`` becomes ``%s``, SQLite's
``INDEXED BY`` hints are dropped) and caches the result. Everything else uses Core.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy import Connection

__all__ = [
    "IN_LIST_MAX",
    "Connection",
    "Cursor",
    "chunks",
    "dbapi",
    "is_sqlite",
    "run",
    "run_many",
    "spell",
]

T = TypeVar("T")

# Ids bound into one ``IN (...)`` list at most: SQLite refuses a statement with more
# than 32,766 variables, and one revocation can reach tens of thousands of children.
IN_LIST_MAX = 500


class Cursor(Protocol):
    """What :func:`run` returns on either store (sqlite3's or psycopg's cursor)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


def dbapi(conn: Connection) -> Any:
    """The driver's connection under ``conn``, in the same transaction."""
    return conn.connection.dbapi_connection


def is_sqlite(conn: Connection) -> bool:
    return conn.dialect.name == "sqlite"


def run(
    conn: Connection, sql: str, params: Sequence[Any] = (), *, planned_each_time: bool = False
) -> Cursor:
    """Execute one plain statement (see the module's docstring) on either store.

    ``planned_each_time``: PostgreSQL plans it anew on every run, never from a plan
    kept since the connection first prepared it. For an operator's query (a listing, an
    id prefix) whose best plan depends on the table's size: psycopg prepares a statement
    the fifth time a connection runs it, and the generic plan PostgreSQL then keeps was
    made on the table as it was (a whole-table read, on a new database). Hot
    statements keep theirs: each one's plan is an index's at any size (tested).
    """
    raw: Any = conn.connection.dbapi_connection
    if type(raw) is sqlite3.Connection:
        return raw.execute(sql, params)
    if planned_each_time:
        return cast(Cursor, raw.execute(_postgres(sql), params, prepare=False))
    return cast(Cursor, raw.execute(_postgres(sql), params))


def run_many(conn: Connection, sql: str, rows: Iterable[Sequence[Any]]) -> None:
    """Execute one plain statement once for each of ``rows``."""
    raw: Any = conn.connection.dbapi_connection
    if type(raw) is sqlite3.Connection:
        raw.executemany(sql, rows)
        return
    with raw.cursor() as cursor:  # psycopg pipelines executemany: one round trip
        cursor.executemany(_postgres(sql), list(rows))


_SPELLINGS: dict[str, str] = {}
_HINT = re.compile(r"\s+INDEXED BY \w+")


def _postgres(sql: str) -> str:
    spelled = _SPELLINGS.get(sql)
    if spelled is None:
        if "%" in sql:
            raise ValueError("plain SQL must not contain '%' (psycopg's parameter marker)")
        spelled = _SPELLINGS[sql] = _HINT.sub("", sql).replace("?", "%s")
    return spelled


def spell(conn: Connection, sql: str) -> str:
    """``sql`` for a Core ``text()`` statement on ``conn``'s store: SQLite's index hints
    are dropped elsewhere (PostgreSQL plans partial indexes by itself)."""
    return sql if is_sqlite(conn) else _HINT.sub("", sql)


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
