"""One consistent, read-only read of a soak's database, on either store.

A SQLite file is read through SQLite's read-only mode (``mode=ro``) in one explicit
transaction, and checked with ``PRAGMA integrity_check`` when no host has it open. Any
other database is read through the store (:func:`delegation.store.stores.read_once`):
on PostgreSQL one ``REPEATABLE READ, READ ONLY`` snapshot, safe beside live hosts; the
integrity check is SQLite's own, so there is none there. The same SQL serves both, but
for reading an event body's JSON fields, which each store spells its own way.
"""

from __future__ import annotations

import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from delegation import errors
from delegation.store import stores
from delegation.store.sql import Connection

T = TypeVar("T")
Row = dict[str, Any]
Query = Callable[[str], list[Row]]  # one statement, without parameters: its rows
Source = Path | str  # a SQLite file, or a database URL


@dataclass
class Snapshot:
    """One consistent read of everything the checks look at."""

    children: list[Row]
    grants: dict[str, Row]
    leases: dict[tuple[str, str], Row]
    events: dict[int, tuple[int, int, int]]  # child id -> (count, first, last sequence)
    recoveries: Counter[int]
    last_result: dict[int, str]
    instances: list[Row]
    open_connections: list[Row]
    steers: set[tuple[int, str]]  # injected receipts: (child id, requestId)
    integrity: list[str]
    # child -> sequence -> (kind, text): the children with journaled events, and every
    # child that was resumed (its events name who wrote them, around each recovery)
    bodies: dict[int, dict[int, tuple[str, str]]]
    purged: dict[str, float]  # run id -> when it was purged after retention
    # The soak's own record (tools.soak.audit), rows after the last read;
    # None where the database has none (a database the soak did not make).
    audit: list[Row] | None = None


class Reading:
    """How to read one store: run ``fn`` on a query function in one read transaction."""

    def __init__(self, source: Source) -> None:
        path = source if isinstance(source, Path) else stores.file_of(source)
        self.path: Path | None = Path(path) if path is not None else None
        self.url = "" if isinstance(source, Path) else stores.normalize(source)

    @property
    def is_file(self) -> bool:
        return self.path is not None

    def _read_server(self, fn: Callable[[Query], T]) -> T:
        """One snapshot of the server's database; its session ended under it (a soak's
        ``--db-restarts``) is tried again, for up to ten seconds."""
        for _ in range(100):
            try:
                return stores.read_once(self.url, lambda conn: fn(_store_query(conn)))
            except errors.StoreUnavailable:
                time.sleep(0.1)
        return stores.read_once(self.url, lambda conn: fn(_store_query(conn)))

    def exists(self) -> bool:
        return self.path is None or self.path.exists()

    def field(self, name: str, alias: str = "") -> str:
        """SQL for the JSON field ``name`` of an event body (a text, or NULL)."""
        if self.path is not None:
            return f"json_extract(CAST({alias}body AS TEXT), '$.{name}')"
        return f"(convert_from({alias}body, 'UTF8')::json ->> '{name}')"

    def read(self, fn: Callable[[Query], T]) -> T:
        if self.path is None:
            return self._read_server(fn)
        conn = sqlite3.connect(
            f"file:{self.path}?mode=ro", uri=True, timeout=30, isolation_level=None
        )
        conn.row_factory = _as_dict
        try:
            conn.execute("BEGIN")
            found = fn(lambda sql: conn.execute(sql).fetchall())
            conn.execute("COMMIT")
            return found
        finally:
            conn.close()


def _as_dict(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> Row:
    return {d[0]: value for d, value in zip(cursor.description, row, strict=True)}


def _store_query(conn: Connection) -> Query:
    return lambda sql: [dict(row) for row in conn.exec_driver_sql(sql).mappings()]


def _pairs(rows: list[Row]) -> dict[Any, Any]:
    return dict(tuple(row.values()) for row in rows)


def read_snapshot(
    source: Source, wanted: set[str], *, integrity: bool, audit_after: int = 0
) -> Snapshot:
    """Everything the checks read, in one transaction; the event bodies of the runs in
    ``wanted`` and of every resumed child; the soak's record after row ``audit_after``.
    ``integrity``: SQLite's own checks too."""
    reading = Reading(source)

    def collect(q: Query) -> Snapshot:
        snap = _collect(reading, q, wanted, integrity and reading.is_file)
        snap.audit = _audit(reading, q, audit_after)
        return snap

    return reading.read(collect)


def _audit(reading: Reading, q: Query, after: int) -> list[Row] | None:
    """The soak's record after row ``after``, oldest first; None where there is none."""
    found = (
        q("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'soak_audit'")
        if reading.is_file
        else q("SELECT to_regclass('soak_audit') AS name")
    )
    if not found or found[0]["name"] is None:
        return None
    return q(f"SELECT * FROM soak_audit WHERE id > {int(after)} ORDER BY id")


def _collect(reading: Reading, q: Query, wanted: set[str], integrity: bool) -> Snapshot:
    children = q("SELECT * FROM children ORDER BY id")
    grants = {g["id"]: g for g in q("SELECT * FROM grants")}
    events = {
        r["child_id"]: (int(r["n"]), int(r["first"]), int(r["last"]))
        for r in q(
            'SELECT child_id, COUNT(*) AS n, MIN(sequence) AS "first", MAX(sequence) AS "last"'
            " FROM events GROUP BY child_id"
        )
    }
    kind = reading.field("kind")
    recovered = f"SELECT child_id, COUNT(*) FROM events WHERE {kind} = 'recovery' GROUP BY child_id"
    recoveries: Counter[int] = Counter(_pairs(q(recovered)))
    last_result = _pairs(
        q(
            f"SELECT e.child_id, {reading.field('text', 'e.')} FROM events e"
            f" JOIN (SELECT child_id, MAX(sequence) AS s FROM events WHERE {kind} = 'result'"
            " GROUP BY child_id) m ON m.child_id = e.child_id AND m.s = e.sequence"
        )
    )
    ids = {c["id"] for c in children if c["run_id"] in wanted} | set(recoveries)
    bodies: dict[int, dict[int, tuple[str, str]]] = {child_id: {} for child_id in ids}
    if ids:
        listed = ", ".join(str(int(i)) for i in sorted(ids))
        for r in q(
            f"SELECT child_id, sequence, {kind} AS kind, {reading.field('text')} AS text"
            f" FROM events WHERE child_id IN ({listed})"
        ):
            bodies[r["child_id"]][int(r["sequence"])] = (r["kind"] or "", r["text"] or "")
    steers = {
        (r["child_id"], r["request_id"])
        for r in q("SELECT child_id, request_id FROM steers WHERE outcome = 'injected'")
    }
    instances = q("SELECT * FROM engine_instances ORDER BY started_at")
    open_connections = q("SELECT * FROM connections WHERE closed_at IS NULL")
    purged = _pairs(q("SELECT run_id, purged_at FROM purged"))
    checks: list[str] = []
    if integrity:
        checks = [str(next(iter(r.values()))) for r in q("PRAGMA integrity_check")]
        checks += [f"foreign key {tuple(r.values())}" for r in q("PRAGMA foreign_key_check")]
    leases = {(g["runner_id"], g["lease_id"]): g for g in grants.values() if g["kind"] == "lease"}
    return Snapshot(
        children,
        grants,
        leases,
        events,
        recoveries,
        last_result,
        instances,
        open_connections,
        steers,
        checks,
        bodies,
        purged,
    )


def tally(source: Source) -> dict[str, Any]:
    """What the soak left in the database: children by state, events, resumes, leases."""
    reading = Reading(source)
    if not reading.exists():
        return {}

    def count(q: Query) -> dict[str, Any]:
        states = _pairs(q("SELECT state, COUNT(*) FROM children GROUP BY state"))

        def one(sql: str) -> int:
            return int(next(iter(q(sql)[0].values())) or 0)

        return {
            "children": sum(states.values()),
            "children_by_state": {k: int(v) for k, v in states.items()},
            "events": one("SELECT COUNT(*) FROM events"),
            "resumed": one("SELECT SUM(recovery_attempts) FROM children"),
            "leases": one("SELECT COUNT(*) FROM grants WHERE kind = 'lease'"),
            "purged": one("SELECT COUNT(*) FROM purged"),
        }

    return reading.read(count)
