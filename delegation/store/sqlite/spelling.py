"""SQLite's spelling of what the aggregates ask (see :mod:`delegation.store.spelling`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


class SqliteSpelling:
    # SQLite uses a partial index only for a WHERE that repeats the index's own term.
    # Such a query names the index and repeats the term: an INDEXED BY that cannot be
    # used is an error, never a silent scan of every child ever kept.
    active_index: str = "INDEXED BY ix_children_one_active"
    active: str = f"children {active_index}"
    clock: str = "((julianday('now') - 2440587.5) * 86400.0)"
    for_update: str = ""
    instance_lock_held: str = ""  # one host per file: its lock is the file's
    instance_lock_free: str = ""
    instance_lock_freed: str = ""
    server_started: str = "0"
    row_version: str | None = None
    lock_child: str | None = None
    first_to: str | None = None
    wake: str | None = None  # a SQLite host sees the file change by itself
    # An aggregate over a subquery with a LIMIT is never flattened: SQLite steps the
    # subquery as a co-routine, in its ORDER BY (group_concat's own ORDER BY is 3.44's).
    joined_page: str | None = (
        "SELECT CAST('[' || group_concat(body, ',') || ']' AS BLOB), count(*) FROM"
        " (SELECT body FROM events WHERE child_id = ? AND sequence > ? ORDER BY sequence LIMIT ?)"
    )

    @staticmethod
    def run(raw: Any, sql: str, params: Sequence[Any], planned_each_time: bool) -> Any:
        return raw.execute(sql, params)

    @staticmethod
    def run_many(raw: Any, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        raw.executemany(sql, rows)

    @staticmethod
    def code_point_order(conn: Any) -> bool:
        return True  # SQLite's BINARY collation compares UTF-8 bytes: code points


SQLITE = SqliteSpelling()
