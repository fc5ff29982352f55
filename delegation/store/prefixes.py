"""Ids by their beginning: how the command line finds the id a shortened one stands for.

Ids are case-sensitive and compared as code points on both stores. A prefix is read
as a range of an index, ``id >= prefix AND id < the next prefix``, which is exact in
code-point order: SQLite's ``BINARY`` collation, and on PostgreSQL a database whose
collation is ``C``, ``POSIX`` or ``C.UTF-8``. Under another PostgreSQL collation that
range could miss ids, so there a prefix is matched with ``LIKE`` alone, which is always
exact but reads the table instead of the index.
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import Connection

from delegation.store.sql import run, spelling_of

Kind = Literal["conversation", "run", "parent_run", "lease", "runner"]

# Which column holds each kind of id, and a condition its index is partial on.
COLUMNS: dict[str, tuple[str, str, str]] = {
    "conversation": ("children", "conversation_id", ""),
    "run": ("children", "run_id", ""),
    "parent_run": ("children", "parent_run_id", ""),
    "lease": ("children", "lease_id", "lease_id IS NOT NULL AND "),
    "runner": ("runners", "runner_id", ""),
}


def exists(conn: Connection, kind: Kind, value: str) -> bool:
    """Whether ``value`` is an id of this kind, exactly."""
    table, column, _ = COLUMNS[kind]
    return (
        run(conn, f"SELECT 1 FROM {table} WHERE {column} = ? LIMIT 1", (value,)).fetchone()
        is not None
    )


def starting_with(conn: Connection, kind: Kind, prefix: str, limit: int) -> list[str]:
    """The distinct ids of this kind that begin with ``prefix`` (the prefix itself
    included), in order, at most ``limit`` of them."""
    by_range = _code_point_order(conn)
    sql, params = query(kind, prefix, by_range=by_range)
    return [row[0] for row in run(conn, sql, (*params, limit), planned_each_time=True).fetchall()]


def query(kind: Kind, prefix: str, *, by_range: bool) -> tuple[str, list[str]]:
    """The statement of :func:`starting_with` (its last parameter is the limit)."""
    table, column, partial = COLUMNS[kind]
    after = following(prefix)
    if not by_range:
        where, params = f"{column} LIKE ? ESCAPE '!'", [_like(prefix)]
    elif after is None:
        where, params = f"{column} >= ?", [prefix]
    else:
        where, params = f"{column} >= ? AND {column} < ?", [prefix, after]
    sql = f"SELECT DISTINCT {column} FROM {table} WHERE {partial}{where} ORDER BY {column} LIMIT ?"
    return sql, params


def following(prefix: str) -> str | None:
    """The least string after every string that begins with ``prefix``, in code-point
    order (None: there is none, a prefix of only U+10FFFF characters)."""
    chars = list(prefix)
    while chars:
        code = ord(chars[-1]) + 1
        if code == 0xD800:  # surrogates are no characters of UTF-8 text
            code = 0xE000
        if code <= 0x10FFFF:
            chars[-1] = chr(code)
            return "".join(chars)
        chars.pop()
    return None


def _like(prefix: str) -> str:
    return prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"


def _code_point_order(conn: Connection) -> bool:
    """Whether ``conn``'s database compares text by code point (its dialect says)."""
    return spelling_of(conn).code_point_order(conn)
