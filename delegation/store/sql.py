"""The plain SQL the hot paths run, on either store.

Hot paths run plain SQL through :func:`run` on the DBAPI connection under a SQLAlchemy
``Connection``: SQLAlchemy's per-statement result machinery costs more than an indexed
lookup. That SQL is written once, with ``?`` parameters and only what both stores
accept (``ON CONFLICT … DO UPDATE``, ``RETURNING``); what the stores spell differently
(an index hint, the clock, a row lock, a notice) each dialect holds in its
:class:`~delegation.store.spelling.Spelling`, which its record carries (found by the
connection's dialect, :mod:`delegation.store.registry`) and an aggregate asks for with
:func:`spelling_of`. Everything else uses Core.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection

from delegation.store import registry
from delegation.store.spelling import Cursor, Spelling

__all__ = [
    "IN_LIST_MAX",
    "Connection",
    "Cursor",
    "Spelling",
    "chunks",
    "dbapi",
    "run",
    "run_many",
    "spelling_of",
    "stored_time",
    "stored_times",
]

T = TypeVar("T")

# Ids bound into one ``IN (...)`` list at most: SQLite refuses a statement with more
# than 32,766 variables, and one revocation can reach tens of thousands of children.
IN_LIST_MAX = 500


def spelling_of(conn: Connection) -> Spelling:
    """The spelling of ``conn``'s store (see :mod:`delegation.store.spelling`)."""
    return registry.spelling(conn.dialect.name)


def dbapi(conn: Connection) -> Any:
    """The driver's connection under ``conn``, in the same transaction."""
    return conn.connection.dbapi_connection


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
    raw = conn.connection.dbapi_connection
    return registry.spelling(conn.dialect.name).run(raw, sql, params, planned_each_time)


def run_many(conn: Connection, sql: str, rows: Iterable[Sequence[Any]]) -> None:
    """Execute one plain statement once for each of ``rows``."""
    spelling = registry.spelling(conn.dialect.name)
    spelling.run_many(conn.connection.dbapi_connection, sql, rows)


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


def stored_time(value: Any) -> float:
    """A stored time (epoch seconds) as records hold it: a float, or NaN when the column
    holds no number. SQLite keeps whatever is written in a REAL column, text too (a
    hand edit, another tool): such a time is set but unreadable, and a record never
    hands it on as text, where the first sum would raise."""
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return math.nan


def stored_times(values: list[Any], indices: Iterable[int]) -> None:
    """Each of ``values`` at ``indices`` (a row's times) as :func:`stored_time` reads
    it, NULL left None."""
    for i in indices:
        value = values[i]
        if value is not None and value.__class__ is not float:
            values[i] = stored_time(value)
