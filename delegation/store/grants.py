"""Tool grants, lease grants and lease tombstones."""

from __future__ import annotations

import dataclasses
import itertools
import operator
import secrets
import time
from collections.abc import Iterable, Sequence
from functools import cache, lru_cache
from typing import Any

import msgspec
from sqlalchemy import Connection, func, insert, select, update

from delegation._struct import I64_MAX
from delegation.options import ExecutionOptions
from delegation.records import ChildRecord, GrantRecord, LeaseRecord, RunnerRecord
from delegation.store import children as child_rows
from delegation.store import registrations
from delegation.store.sql import Spelling, chunks, run, spelling_of, stored_time, stored_times
from delegation.store.tables import children as children_table
from delegation.store.tables import grants
from delegation.wire import Preset

_presets = msgspec.json.Decoder(tuple[Preset, ...])
_policy = msgspec.json.Decoder(ExecutionOptions)
_encoder = msgspec.json.Encoder()


# The record's fields in its own order (``engine_instance_id``, where a tool grant was
# opened, is not authority and stays out), so a row becomes a record without a dict.
FIELDS = tuple(f.name for f in dataclasses.fields(GrantRecord))
_SELECT = f"SELECT {', '.join(FIELDS)} FROM grants"
_PRESETS, _GENERATIONS = FIELDS.index("presets"), FIELDS.index("generations")
_POLICY = FIELDS.index("policy")
_TIMES = tuple(
    FIELDS.index(name)
    for name in ("created_at", "expires_at", "closed_at", "activated_at", "revoked_at")
)


_serial = itertools.count()


def new_grant_id() -> str:
    """A new grant's id: 32 hex digits that sort in the order grants were made (the
    wall clock in nanoseconds, then a counter of this process, then randomness), so
    that tombstones made in the same tick of the engine's clock still keep their order
    (``trim_tombstones``) on every store. Grant ids never leave the database."""
    return f"{time.time_ns():016x}{next(_serial) & 0xFFFF:04x}{secrets.token_hex(6)}"


def _one(conn: Connection, where: str, params: tuple[Any, ...]) -> GrantRecord | None:
    """One grant by a plain-SQL lookup (hot paths: no statement to build per call)."""
    row = run(conn, f"{_SELECT} WHERE {where}", params).fetchone()
    return None if row is None else _record(row)


def _record(row: Sequence[Any]) -> GrantRecord:
    values = list(row)
    values[_PRESETS] = _decode_presets(values[_PRESETS])
    values[_GENERATIONS] = _parse_generations(values[_GENERATIONS])
    values[_POLICY] = _decode_policy(values[_POLICY])
    stored_times(values, _TIMES)
    return GrantRecord(*values)


@lru_cache(maxsize=4096)
def _decode_presets(raw: bytes | None) -> tuple[Preset, ...]:
    """A grant's preset snapshot never changes once written: decode each one once."""
    return _presets.decode(raw) if raw else ()


@lru_cache(maxsize=1024)
def _decode_policy(raw: bytes | None) -> ExecutionOptions | None:
    return _policy.decode(raw) if raw is not None else None


@lru_cache(maxsize=4096)
def _parse_generations(text: str | None) -> frozenset[int]:
    return frozenset(int(g) for g in (text or "").split(",") if g)


def _generations(values: Iterable[int]) -> str:
    return ",".join(str(g) for g in sorted(set(values)))


def get(conn: Connection, grant_id: str) -> GrantRecord | None:
    return _one(conn, "id = ?", (grant_id,))


def insert_tool(
    conn: Connection,
    *,
    runner_id: str,
    connection_id: str,
    engine_instance_id: str,
    run_id: str,
    conversation_id: str,
    tool_call_id: str,
    extension_id: str,
    workspace: str,
    presets: Sequence[Preset],
    depth: int,
    now: float,
    policy: ExecutionOptions | None = None,
) -> GrantRecord:
    grant_id = new_grant_id()
    values = {
        "id": grant_id,
        "kind": "tool",
        "runner_id": runner_id,
        "connection_id": connection_id,
        "engine_instance_id": engine_instance_id,
        "run_id": run_id,
        "conversation_id": conversation_id,
        "tool_call_id": tool_call_id,
        "extension_id": extension_id,
        "workspace": workspace,
        "presets": _encoder.encode(list(presets)),
        "generations": _generations(p.generation for p in presets),
        "depth": depth,
        "created_at": now,
        "policy": None if policy is None else _encoder.encode(policy),
    }
    return _record(run(conn, _insert_returning(tuple(values)), tuple(values.values())).fetchone())


@lru_cache(maxsize=8)
def _insert_returning(names: tuple[str, ...]) -> str:
    marks = ", ".join("?" for _ in names)
    return f"INSERT INTO grants ({', '.join(names)}) VALUES ({marks}) RETURNING {', '.join(FIELDS)}"


# A call's runner and the open tool grant it names, in one statement (every child
# method asks for both, first thing); more columns after theirs where a hot path reads
# more in the same statement. Each is built once, here (or once per dialect), by name.
_RUNNER_COLUMNS = [
    *(f"r.{name}" for name in registrations.FIELDS),
    *(f"g.{name}" for name in FIELDS),
]
_TOOL_END = len(_RUNNER_COLUMNS)  # where a statement's own columns begin


def _runner_and_tool(columns: Sequence[str] = (), join: str = "") -> str:
    """The runner and its open tool grant, then ``columns`` (from a ``join`` on the
    children ``c`` after the grant's, if any)."""
    listed = ", ".join([*_RUNNER_COLUMNS, *columns])
    return (
        f"SELECT {listed} FROM runners r LEFT JOIN grants g ON g.run_id = ?"
        " AND g.tool_call_id = ? AND g.kind = 'tool' AND g.runner_id = r.runner_id"
        f" AND g.closed_at IS NULL{' ' + join if join else ''} WHERE r.runner_id = ?"
    )


def _named(row: Any, *names: str) -> dict[str, Any]:
    """A statement's own columns (after the runner's and the grant's) by name."""
    return dict(zip(names, row[_TOOL_END:], strict=False))


_RUNNER_AND_TOOL = _runner_and_tool()


def runner_and_tool(
    conn: Connection, runner_id: str, run_id: str, tool_call_id: str
) -> tuple[RunnerRecord | None, GrantRecord | None]:
    """The runner's record and the open tool grant of the runner's tool call
    (None and None for an unknown runner)."""
    row = run(conn, _RUNNER_AND_TOOL, (run_id, tool_call_id, runner_id)).fetchone()
    return (None, None) if row is None else _runner_and_tool_of(row, tool_call_id)


_CHILD_COLUMNS = [f"c.{name}" for name in child_rows.FIELDS]
_RUNNER_TOOL_AND_DEPTH = _runner_and_tool(["(SELECT d.depth FROM children d WHERE d.run_id = ?)"])


def runner_tool_and_depth(
    conn: Connection, runner_id: str, run_id: str, tool_call_id: str
) -> tuple[RunnerRecord | None, GrantRecord | None, int]:
    """:func:`runner_and_tool`, and the nesting depth of the run ``run_id`` (a child's
    own, 0 for a top-level run): what opening a tool call reads, in one statement."""
    row = run(conn, _RUNNER_TOOL_AND_DEPTH, (run_id, run_id, tool_call_id, runner_id)).fetchone()
    if row is None:
        return None, None, 0
    runner, tool = _runner_and_tool_of(row, tool_call_id)
    return runner, tool, int(_named(row, "depth")["depth"] or 0)


# Unordered: an ORDER BY c.id made SQLite sort the joined rows, every column of them, in
# a temporary B-tree on every child method (3 µs of the statement's 23); a
# conversation's few executions are put in order by ``_records_of`` instead.
_RUNNER_TOOL_AND_EXECUTIONS = _runner_and_tool(
    _CHILD_COLUMNS, "LEFT JOIN children c ON c.conversation_id = ?"
)
# The child a requestId names is looked up in a subquery, by id, not joined: a join on
# the tool grant's id (itself outer-joined) plans, on PostgreSQL, as a scan of every
# child once the statement is prepared on a new database, and stays so as it grows.
_REQUEST_COLUMNS = [
    "(SELECT COUNT(*) FROM children n WHERE n.grant_id = g.id)",
    "(SELECT e.id FROM children e WHERE e.grant_id = g.id AND e.request_id = ?)",
]


def _runner_and_tool_of(row: Any, tool_call_id: str) -> tuple[RunnerRecord, GrantRecord | None]:
    width = len(registrations.FIELDS)
    tool = _record(row[width:_TOOL_END]) if tool_call_id and row[width] is not None else None
    return RunnerRecord(*row[:width]), tool


def runner_tool_and_executions(
    conn: Connection, runner_id: str, run_id: str, tool_call_id: str, conversation_id: str
) -> tuple[RunnerRecord | None, GrantRecord | None, list[ChildRecord]]:
    """:func:`runner_and_tool`, and every execution of ``conversation_id`` (under any
    grant; the caller keeps its grant's), oldest first: one statement for what
    locating a child reads before its page."""
    rows = run(
        conn, _RUNNER_TOOL_AND_EXECUTIONS, (run_id, tool_call_id, conversation_id, runner_id)
    ).fetchall()
    if not rows:
        return None, None, []
    key = (tuple(rows), bool(tool_call_id))
    try:
        runner, tool, executions = _records_of(key)
    except TypeError:  # a value no key can hold (unhashable): its records made afresh
        runner, tool, executions = _records_of.__wrapped__(key)
    return runner, tool, list(executions)


@lru_cache(maxsize=256)
def _records_of(
    key: tuple[tuple[tuple[Any, ...], ...], bool],
) -> tuple[RunnerRecord, GrantRecord | None, tuple[ChildRecord, ...]]:
    """The records of :func:`runner_tool_and_executions`' rows, kept by the rows
    themselves: a child method is mostly a read of the same child again (a page, a
    follow's next), whose rows are unchanged since (its events are not in them), and
    building their records again took as long as the statement itself. Records are
    frozen, so the same ones serve every caller; a changed row is another key."""
    rows, with_tool = key
    runner, tool = _runner_and_tool_of(rows[0], "tool" if with_tool else "")
    # The children's columns, after the grant's (none: the conversation has no execution).
    executions = [
        child_rows.from_row(row[_TOOL_END:]) for row in rows if row[_TOOL_END] is not None
    ]
    executions.sort(key=_by_id)
    return runner, tool, tuple(executions)


_by_id = operator.attrgetter("id")


@dataclasses.dataclass(frozen=True, slots=True)
class SeenTool:
    """A runner's row and its open tool grant as a read found them: the records, and
    each row's version (``Spelling.row_version``)."""

    runner: RunnerRecord
    tool: GrantRecord
    versions: tuple[str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class StartReads:
    """What a start under a tool grant reads first (see :func:`runner_tool_and_request`)."""

    runner: RunnerRecord | None
    tool: GrantRecord | None
    existing: ChildRecord | None  # the child the start's requestId already names
    count: int  # the children of the tool grant
    seen: SeenTool | None  # PostgreSQL: the runner and the tool grant, if both were found


@cache
def _start_reads(spelling: Spelling) -> str:
    """What a start reads (:func:`runner_tool_and_request`), in this store's spelling:
    with the two rows' versions where it has them (``Spelling.row_version``:
    PostgreSQL's; a start then checks them as it inserts)."""
    version = spelling.row_version
    versions = [] if version is None else [version.format(t="r"), version.format(t="g")]
    return _runner_and_tool([*_REQUEST_COLUMNS, *versions])


def runner_tool_and_request(
    conn: Connection, runner_id: str, run_id: str, tool_call_id: str, request_id: str
) -> StartReads:
    """:func:`runner_and_tool`, then, under that tool grant, what
    ``children.by_request_and_count`` reads: one statement for a start's reads."""
    spelling = spelling_of(conn)
    sql = _start_reads(spelling)
    row = run(conn, sql, (request_id, run_id, tool_call_id, runner_id)).fetchone()
    if row is None:
        return StartReads(None, None, None, 0, None)
    runner, tool = _runner_and_tool_of(row, tool_call_id)
    found = _named(row, "count", "existing", "runner_version", "tool_version")
    existing = found["existing"]
    child = child_rows.get(conn, existing) if existing is not None else None  # a retry
    seen = None
    if tool is not None and spelling.row_version is not None:
        seen = SeenTool(runner, tool, (found["runner_version"], found["tool_version"]))
    count = int(found["count"] or 0)
    return StartReads(runner, tool, child, count, seen)


@cache
def _as_seen(version: str) -> str:
    """The runner's row and the tool grant's as a start last saw them (no change since),
    the grant's children under the cap, and the start's requestId new under it."""
    return (
        "EXISTS (SELECT 1 FROM runners r JOIN grants g ON g.id = ?"
        f" WHERE r.runner_id = ? AND {version.format(t='r')} = ?"
        f" AND {version.format(t='g')} = ?)"
        " AND (SELECT COUNT(*) FROM children n WHERE n.grant_id = ?) < ?"
        " AND NOT EXISTS (SELECT 1 FROM children e WHERE e.grant_id = ? AND e.request_id = ?)"
    )


def insert_child_as_seen(
    conn: Connection, seen: SeenTool, cap: int, **values: Any
) -> ChildRecord | None:
    """:func:`children.insert_child` (under ``seen.tool``) in one statement that inserts
    only if neither the runner's row nor the tool grant's changed since ``seen`` was
    read, the grant has fewer than ``cap`` children and none with this ``request_id``;
    None if not (nothing was written: read them again).

    What a start checks of the two rows, checked on ``seen``, then holds of the rows
    the statement inserts under. PostgreSQL only (row versions): on a server this
    saves the round trip of the read.
    """
    grant_id = seen.tool.id
    guard = (
        grant_id,
        seen.runner.runner_id,
        *seen.versions,
        grant_id,
        cap,
        grant_id,
        values["request_id"],
    )
    version = spelling_of(conn).row_version
    if version is None:
        raise ValueError("this store has no row versions: a start reads its rows first")
    return child_rows.insert_child_if(conn, _as_seen(version), guard, **values)


def get_lease(conn: Connection, runner_id: str, lease_id: str) -> GrantRecord | None:
    if not lease_id:
        return None
    return _one(conn, "kind = 'lease' AND runner_id = ? AND lease_id = ?", (runner_id, lease_id))


def count_leases(conn: Connection, runner_id: str) -> int:
    """The live leases of a runner: what the lease capacity counts (tombstones do not)."""
    query = select(func.count()).where(
        grants.c.kind == "lease", grants.c.runner_id == runner_id, grants.c.revoked_at.is_(None)
    )
    return int(conn.execute(query).scalar_one())


def trim_tombstones(conn: Connection, owners: Iterable[tuple[str, str]], keep: int) -> None:
    """Keep the ``keep`` newest tombstones of each (runner, extension) of ``owners``; drop
    the older ones. Each extension has its own: one extension's releases never drop
    another's tombstone (design §18).

    A dropped tombstone no longer fences its leaseId, and the records of children
    that were under it keep their rows (``grant_id`` becomes NULL).
    """
    for runner_id, extension_id in set(owners):
        run(
            conn,
            "DELETE FROM grants WHERE id IN (SELECT id FROM grants WHERE kind = 'lease'"
            " AND runner_id = ? AND extension_id = ? AND revoked_at IS NOT NULL"
            f" ORDER BY revoked_at DESC, created_at DESC, id DESC LIMIT {I64_MAX} OFFSET ?)",
            (runner_id, extension_id, keep),
        )


def owners_of(conn: Connection, grant_ids: Iterable[str]) -> set[tuple[str, str]]:
    """The (runner, extension) pairs the grants ``grant_ids`` belong to."""
    return {
        (runner_id, extension_id)
        for ids in chunks(grant_ids)
        for runner_id, extension_id in conn.execute(
            select(grants.c.runner_id, grants.c.extension_id).where(grants.c.id.in_(ids)).distinct()
        )
    }


def insert_lease(
    conn: Connection, tool: GrantRecord, lease_id: str, now: float, lifetime: float
) -> GrantRecord:
    """A lease grant created from a live tool grant: same owner, presets and workspace."""
    grant_id = new_grant_id()
    conn.execute(
        insert(grants).values(
            id=grant_id,
            kind="lease",
            runner_id=tool.runner_id,
            connection_id=tool.connection_id,
            run_id=tool.run_id,
            conversation_id=tool.conversation_id,
            tool_call_id=tool.tool_call_id,
            extension_id=tool.extension_id,
            lease_id=lease_id,
            origin_grant_id=tool.id,
            workspace=tool.workspace,
            presets=_encoder.encode(list(tool.presets)),
            generations=_generations(tool.generations),
            depth=tool.depth,
            policy=None if tool.policy is None else _encoder.encode(tool.policy),
            created_at=now,
            expires_at=now + lifetime,
        )
    )
    record = get(conn, grant_id)
    assert record is not None
    return record


def insert_tombstone(
    conn: Connection, runner_id: str, lease_id: str, extension_id: str, generation: int, now: float
) -> None:
    """A revoked lease that never existed: it fences later starts with that leaseId."""
    conn.execute(
        insert(grants).values(
            id=new_grant_id(),
            kind="lease",
            runner_id=runner_id,
            extension_id=extension_id,
            lease_id=lease_id,
            generations=str(generation),
            created_at=now,
            revoked_at=now,
            revoke_reason="released",
        )
    )


def close_tools(conn: Connection, grant_ids: Iterable[str], now: float) -> list[str]:
    """Close the still-open tool grants among ``grant_ids``; return those closed now."""
    closed: list[str] = []
    for ids in chunks(grant_ids):
        open_ids = list(
            conn.execute(
                select(grants.c.id).where(grants.c.id.in_(ids), grants.c.closed_at.is_(None))
            ).scalars()
        )
        if open_ids:
            conn.execute(update(grants).where(grants.c.id.in_(open_ids)).values(closed_at=now))
        closed += open_ids
    return closed


def revoke_leases(conn: Connection, grant_ids: Iterable[str], now: float, reason: str) -> None:
    for ids in chunks(grant_ids):
        conn.execute(
            update(grants)
            .where(grants.c.id.in_(ids), grants.c.revoked_at.is_(None))
            .values(revoked_at=now, revoke_reason=reason)
        )


def activate(conn: Connection, grant_id: str, now: float) -> None:
    conn.execute(
        update(grants)
        .where(grants.c.id == grant_id, grants.c.activated_at.is_(None))
        .values(activated_at=now)
    )


def ids_where(conn: Connection, *conditions: Any) -> list[str]:
    return list(conn.execute(select(grants.c.id).where(*conditions)).scalars())


def tools_of_connections(conn: Connection, connection_ids: Iterable[str]) -> list[str]:
    return [
        grant_id
        for ids in chunks(connection_ids)
        for grant_id in ids_where(
            conn,
            grants.c.kind == "tool",
            grants.c.connection_id.in_(ids),
            grants.c.closed_at.is_(None),
        )
    ]


def tools_of_run(conn: Connection, run_id: str, runner_id: str | None = None) -> list[str]:
    """The open tool grants of a parent run (of one runner's, given ``runner_id``)."""
    mine = () if runner_id is None else (grants.c.runner_id == runner_id,)
    return ids_where(
        conn,
        grants.c.kind == "tool",
        grants.c.run_id == run_id,
        grants.c.closed_at.is_(None),
        *mine,
    )


def live_leases(conn: Connection, *conditions: Any) -> list[str]:
    return ids_where(conn, grants.c.kind == "lease", grants.c.revoked_at.is_(None), *conditions)


def leases_of_run(conn: Connection, run_id: str, runner_id: str | None = None) -> list[str]:
    """The live leases of a parent run (of one runner's, given ``runner_id``)."""
    mine = () if runner_id is None else (grants.c.runner_id == runner_id,)
    return live_leases(conn, grants.c.run_id == run_id, *mine)


def leases_of_runner(conn: Connection, runner_id: str) -> list[str]:
    return live_leases(conn, grants.c.runner_id == runner_id)


_LEASE_COLUMNS = (
    *("lease_id", "runner_id", "extension_id", "run_id", "conversation_id", "created_at"),
    *("expires_at", "activated_at", "revoked_at", "revoke_reason"),
)


def _time(value: Any) -> float | None:
    return None if value is None else stored_time(value)


def leases_with_counts(conn: Connection, runner_id: str | None = None) -> list[LeaseRecord]:
    """Live leases and tombstones, newest first, with how many children each holds."""
    count = select(func.count()).where(children_table.c.grant_id == grants.c.id).scalar_subquery()
    # The columns a lease shows, never the grant's stored presets or policy.
    shown = [grants.c[name] for name in _LEASE_COLUMNS]
    query = select(*shown, count.label("children")).where(grants.c.kind == "lease")
    if runner_id is not None:
        query = query.where(grants.c.runner_id == runner_id)
    rows = conn.execute(query.order_by(grants.c.created_at.desc()))
    return [
        LeaseRecord(
            lease_id=row.lease_id,
            runner_id=row.runner_id,
            extension_id=row.extension_id,
            run_id=row.run_id,
            conversation_id=row.conversation_id,
            created_at=stored_time(row.created_at),
            expires_at=_time(row.expires_at),
            activated_at=_time(row.activated_at),
            revoked_at=_time(row.revoked_at),
            revoke_reason=row.revoke_reason,
            children=row.children,
        )
        for row in rows
    ]
