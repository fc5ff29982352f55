"""What a store's aggregates ask of its dialect's SQL (children, grants, lifecycle …):
the few fragments and statements SQLite and PostgreSQL spell differently. Each
dialect holds its own (``sqlite/spelling.py``, ``postgres/spelling.py``), which its
record carries (:class:`delegation.store.backend.Backend`); an aggregate gets its
connection's with :func:`delegation.store.sql.spelling_of` and never asks which store
it is on.

The store's plain SQL (:func:`delegation.store.sql.run`) marks parameters with ``?``, the
one marker it has; PostgreSQL's dialect runs a text with psycopg's ``%s`` in its place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class Cursor(Protocol):
    """What :func:`delegation.store.sql.run` returns on either store (sqlite3's or psycopg's
    cursor)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Spelling(Protocol):
    # Unfinished children, read through ix_children_one_active: ``children`` with the
    # index named where the store would not use it by itself (SQLite), and that hint.
    active: str
    active_index: str
    # The database's clock, in epoch seconds (heartbeats are the database's, design §12).
    clock: str
    # Appended to a SELECT whose rows must stay as read until the transaction ends
    # (PostgreSQL; a SQLite write transaction already excludes every other writer).
    for_update: str
    # A heartbeat's extra condition: this instance's lock is held (PostgreSQL); whether
    # an instance's lock is free (empty: no locks, SQLite); and a takeover's extra way to
    # be dead: the lock free once the heartbeat is ``:suspect`` old. They bind
    # ``:locks`` and ``:me``/``id``.
    instance_lock_held: str
    instance_lock_free: str
    instance_lock_freed: str
    # When the server last started (a restart frees every lock; SQLite: never, 0).
    server_started: str
    # A row's version in an expression of its table alias ``{t}`` (None: no versions,
    # a start then reads its rows in its own transaction).
    row_version: str | None
    # Statements only a store of several hosts needs (None: nothing to do): lock one
    # child's row (``?``: its id), take a transaction's work lock without waiting
    # (``:k``: its key; whether it was free), and wake every host at commit (``?``: the
    # channel).
    lock_child: str | None
    first_to: str | None
    wake: str | None
    # A page of a child's event bodies as one JSON array (``?``: child id, after,
    # limit), with how many it holds: the array NULL for none. One row, not one a
    # body (None: the rows are read and joined by the caller).
    joined_page: str | None

    def __hash__(self) -> int: ...  # statements built for a spelling are kept (cache)

    def run(self, raw: Any, sql: str, params: Sequence[Any], planned_each_time: bool) -> Cursor:
        """Execute one plain statement on the driver's connection ``raw``."""
        ...

    def run_many(self, raw: Any, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    def code_point_order(self, conn: Any) -> bool:
        """Whether text compares by code point on this database (id prefixes by range)."""
        ...
