"""PostgreSQL's spelling of what the aggregates ask (see
:mod:`delegation.store.spelling`), and how its driver runs the store's plain SQL."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

# The texts psycopg was given, by the store's text (``?`` markers): one per statement.
_SPELLINGS: dict[str, str] = {}
_C_COLLATIONS = {"c", "posix", "c.utf8", "c.utf-8"}


def _text(sql: str) -> str:
    spelled = _SPELLINGS.get(sql)
    if spelled is None:
        if "%" in sql:
            raise ValueError("plain SQL must not contain '%' (psycopg's parameter marker)")
        spelled = _SPELLINGS[sql] = sql.replace("?", "%s")
    return spelled


# Its two-key advisory lock is held by a session (pg_locks shows the keys as oids).
_LOCK_HELD = (
    "EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND classid = CAST(:locks AS oid) AND objid = CAST(hashtext(:me) AS oid)"
    " AND objsubid = 2)"
)


# The statements the writer runs for many rows at once, each as one statement of its
# columns' arrays (keyed by the store's text of it, ``?`` markers).
_AS_ARRAYS: dict[str, str] = {
    "INSERT INTO events (child_id, sequence, body) VALUES (?, ?, ?)": (
        "INSERT INTO events (child_id, sequence, body)"
        " SELECT * FROM unnest(%s::integer[], %s::bigint[], %s::bytea[])"
    ),
    "UPDATE children SET output = ? WHERE id = ?": (
        "UPDATE children SET output = u.output"
        " FROM unnest(%s::text[], %s::integer[]) AS u(output, id) WHERE children.id = u.id"
    ),
}


# One array statement binds at most this many rows, and about this many bytes of their
# texts and bytes (a batch after a long outage can hold many; a bound value is at most
# 1 GB, a bytea array's text twice its bytes).
ARRAY_ROWS = 1000
ARRAY_BYTES = 16 << 20


def _parts(rows: list[tuple[Any, ...]]) -> Iterator[list[tuple[Any, ...]]]:
    part: list[tuple[Any, ...]] = []
    size = 0
    for row in rows:
        weight = sum(len(v) for v in row if isinstance(v, (bytes, str)))
        if part and (len(part) == ARRAY_ROWS or size + weight > ARRAY_BYTES):
            yield part
            part, size = [], 0
        part.append(row)
        size += weight
    if part:
        yield part


class PostgresSpelling:
    active_index: str = ""  # PostgreSQL plans partial indexes by itself
    active: str = "children"
    clock: str = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"
    for_update: str = " FOR UPDATE"
    instance_lock_held: str = f" AND {_LOCK_HELD}"
    instance_lock_free: str = "pg_try_advisory_xact_lock(:locks, hashtext(id))"
    server_started: str = "EXTRACT(EPOCH FROM pg_postmaster_start_time())"
    # A free lock proves a death only on a server up long enough for a live host to
    # have taken its lock again: a restart frees every lock (design §32).
    instance_lock_freed: str = (
        " OR (COALESCE(heartbeat_at, 0) < {clock} - :suspect"
        f" AND {server_started} < {{clock}} - :suspect AND {instance_lock_free})"
    )
    # xmin tells two versions apart across transactions, ctid within one (a batch of
    # jobs is one transaction).
    row_version: str | None = "{t}.xmin::text || '/' || {t}.ctid::text"
    lock_child: str | None = "SELECT id FROM children WHERE id = ? FOR UPDATE"
    first_to: str | None = "SELECT pg_try_advisory_xact_lock(:k)"
    wake: str | None = "SELECT pg_notify(?, 'c')"
    # string_agg(... ORDER BY) sorts again on the server: 128 rows of psycopg's are
    # read faster than that (about 30 us, measured).
    joined_page: str | None = None

    @staticmethod
    def run(raw: Any, sql: str, params: Sequence[Any], planned_each_time: bool) -> Any:
        # ``planned_each_time``: planned anew on every run, never from a plan kept since
        # the connection prepared it (see ``delegation.store.sql.run``).
        if planned_each_time:
            return raw.execute(_text(sql), params, prepare=False)
        return raw.execute(_text(sql), params)

    @staticmethod
    def run_many(raw: Any, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """One statement for all of ``rows``: its columns bound as arrays (see
        ``_AS_ARRAYS``), or one statement per row. Never psycopg's ``executemany``: it
        pipelines, and a host stopped (SIGSTOP) between two of its rows leaves the
        server waiting for the next one, its transaction's locks held for as long as
        the host is stopped (the server ends only sessions idle in a transaction)."""
        listed = [tuple(row) for row in rows]
        as_arrays = _AS_ARRAYS.get(sql)
        if as_arrays is not None and len(listed) > 1:
            for part in _parts(listed):
                raw.execute(as_arrays, [list(column) for column in zip(*part, strict=True)])
            return
        for row in listed:
            raw.execute(_text(sql), row)

    @staticmethod
    def code_point_order(conn: Any) -> bool:
        """Whether the database compares text by code point (its collation); asked
        once a connection."""
        known = conn.info.get("code_point_order")
        if known is None:
            known = conn.info["code_point_order"] = _ask_code_point_order(conn)
        return bool(known)


def _ask_code_point_order(conn: Any) -> bool:
    row = conn.connection.dbapi_connection.execute(
        "SELECT row_to_json(d)::text FROM pg_database d WHERE datname = current_database()"
    ).fetchone()
    settings = json.loads(row[0]) if row else {}
    provider = str(settings.get("datlocprovider", "c"))  # PostgreSQL 15 and later say which
    if provider == "c":
        return str(settings.get("datcollate", "")).lower() in _C_COLLATIONS
    return provider == "b"  # PostgreSQL 17's builtin provider: C and C.UTF-8, code points


POSTGRES = PostgresSpelling()
