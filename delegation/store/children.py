"""Child rows: reservation, guarded transitions, cancellation requests and queries."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from functools import cache
from typing import Any

from sqlalchemy import Connection, select, update

from delegation import errors, machine
from delegation.machine import State, Trigger
from delegation.records import ChildFilter, ChildRecord, ChildSummary
from delegation.store.sql import IN_LIST_MAX, Spelling, chunks, run, spelling_of, stored_times
from delegation.store.tables import children, purged

ACTIVE_STATES = [s.value for s in machine.ACTIVE]

# Unfinished children by state alone: ix_children_one_active holds exactly these rows.
# A query through it repeats the index's own term and reads ``Spelling.active`` (SQLite
# uses a partial index only when told).
ACTIVE_TERM = "state IN ('prepared', 'queued', 'admitted', 'running', 'waiting')"


# Hot paths use plain SQL through the same connection: building and caching a Core
# statement costs more than the query itself on an indexed lookup. They select the
# record's fields in its own order, so a row becomes a record without a dict.
FIELDS = tuple(f.name for f in dataclasses.fields(ChildRecord))
_SELECT = f"SELECT {', '.join(FIELDS)} FROM children"
_FOLLOWUP = FIELDS.index("followup")
_TIMES = tuple(
    FIELDS.index(name)
    for name in (
        "cancel_requested_at",
        "created_at",
        "updated_at",
        "admitted_at",
        "finished_at",
        "queued_at",
        "deadline_at",
        "unpinned_at",
    )
)
_COLUMNS = [children.c[name] for name in FIELDS]  # the same order, for Core queries


def _one(conn: Connection, where: str, params: tuple[Any, ...]) -> ChildRecord | None:
    row = run(conn, f"{_SELECT} WHERE {where}", params).fetchone()
    return None if row is None else from_row(row)


def _many(
    conn: Connection,
    where: str,
    params: tuple[Any, ...],
    *,
    active: bool = False,
    planned_each_time: bool = False,
) -> list[ChildRecord]:
    """``active``: read through the one-active index (``where`` repeats ``ACTIVE_TERM``);
    ``planned_each_time``: see :func:`delegation.store.sql.run`."""
    sql = f"{_select_active(spelling_of(conn)) if active else _SELECT} WHERE {where}"
    rows = run(conn, sql, params, planned_each_time=planned_each_time)
    return [from_row(row) for row in rows.fetchall()]


@cache
def _select_active(spelling: Spelling) -> str:
    return f"SELECT {', '.join(FIELDS)} FROM {spelling.active}"


def from_row(row: tuple[Any, ...]) -> ChildRecord:
    values = list(row)
    values[_FOLLOWUP] = bool(values[_FOLLOWUP])
    stored_times(values, _TIMES)
    return ChildRecord(*values)


def lock(conn: Connection, child_id: int) -> None:
    """Hold the child's row until the transaction ends, so what is read next is not
    changed by another host before this transaction writes it (PostgreSQL; a SQLite
    write transaction already excludes every other writer)."""
    sql = spelling_of(conn).lock_child
    if sql is not None:
        run(conn, sql, (child_id,))


def get(conn: Connection, child_id: int) -> ChildRecord | None:
    return _one(conn, "id = ?", (child_id,))


def find(conn: Connection, conversation_id: str, run_id: str | None = None) -> ChildRecord | None:
    """One execution: by run id, or the newest of the conversation."""
    return _one(conn, *_found(conversation_id, run_id))


def find_many(
    conn: Connection, keys: Iterable[tuple[str, str | None]]
) -> dict[tuple[str, str | None], ChildRecord]:
    """:func:`find` of many (conversation id, run id or None), by key: one statement per
    500 conversations, where one each was a round trip (the control requests of a
    lease expiry across hosts are thousands). A key with no execution is left out."""
    wanted = list(dict.fromkeys(keys))
    newest: dict[str, ChildRecord] = {}
    of_run: dict[tuple[str, str], ChildRecord] = {}
    for part in chunks(sorted({conversation for conversation, _ in wanted})):
        marks = ", ".join("?" for _ in part)
        for child in _many(conn, f"conversation_id IN ({marks})", tuple(part)):
            of_run[(child.conversation_id, child.run_id)] = child
            known = newest.get(child.conversation_id)
            if known is None or child.id > known.id:
                newest[child.conversation_id] = child
    found: dict[tuple[str, str | None], ChildRecord] = {}
    for conversation, run_id in wanted:
        execution = of_run.get((conversation, run_id)) if run_id else newest.get(conversation)
        if execution is not None:
            found[(conversation, run_id)] = execution
    return found


def _found(conversation_id: str, run_id: str | None) -> tuple[str, tuple[str, ...]]:
    if run_id:
        return "conversation_id = ? AND run_id = ?", (conversation_id, run_id)
    return "conversation_id = ? ORDER BY id DESC LIMIT 1", (conversation_id,)


def by_run(conn: Connection, run_id: str) -> ChildRecord | None:
    """The execution whose own run id is ``run_id`` (run ids are unique)."""
    return _one(conn, "run_id = ?", (run_id,))


def by_state(conn: Connection, state: str) -> list[ChildRecord]:
    """The unfinished children in ``state``, oldest first."""
    if state not in ACTIVE_STATES:
        raise ValueError(f"not an unfinished state: {state}")
    return _many(conn, f"{ACTIVE_TERM} AND state = ? ORDER BY id", (state,), active=True)


def deadline_of_run(conn: Connection, run_id: str) -> float | None:
    """The deadline of the child execution ``run_id`` (a nested child's parent)."""
    row = run(conn, "SELECT deadline_at FROM children WHERE run_id = ?", (run_id,)).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def of_ids(conn: Connection, ids: list[int]) -> list[ChildRecord]:
    """The children of these ids (those that exist), by id."""
    found: list[ChildRecord] = []
    for part in chunks(ids):
        marks = ", ".join("?" for _ in part)
        found += _many(conn, f"id IN ({marks}) ORDER BY id", tuple(part))
    return found


def was_purged(
    conn: Connection, grant_id: str | None, conversation_id: str, run_id: str | None
) -> bool:
    """Whether an execution (under this grant, unless ``grant_id`` is None) was purged
    after retention."""
    query = select(purged.c.run_id).where(purged.c.conversation_id == conversation_id)
    if grant_id is not None:
        query = query.where(purged.c.grant_id == grant_id)
    if run_id:
        query = query.where(purged.c.run_id == run_id)
    return conn.execute(query.limit(1)).first() is not None


_BY_REQUEST_AND_COUNT = (
    "SELECT n.count, "
    + ", ".join(f"c.{name}" for name in FIELDS)
    + " FROM (SELECT COUNT(*) AS count FROM children WHERE grant_id = ?) n"
    " LEFT JOIN children c ON c.grant_id = ? AND c.request_id = ?"
)


def by_request_and_count(
    conn: Connection, grant_id: str, request_id: str
) -> tuple[ChildRecord | None, int]:
    """The child a start's ``requestId`` already reserved under the grant (if any), and
    how many children the grant has: one statement, one round trip on a server."""
    row = run(conn, _BY_REQUEST_AND_COUNT, (grant_id, grant_id, request_id)).fetchone()
    child = from_row(row[1:]) if row[1] is not None else None
    return child, int(row[0])


def executions(conn: Connection, conversation_id: str) -> list[ChildRecord]:
    rows = conn.execute(
        select(*_COLUMNS)
        .where(children.c.conversation_id == conversation_id)
        .order_by(children.c.id)
    )
    return [from_row(tuple(row)) for row in rows]


_FRESH: dict[str, Any] = {
    "state": State.PREPARED.value,
    "engine_instance_id": None,
    "cancel_requested_at": None,
    "cancel_reason": None,
    "error": "",
    "output": "",
    "recovery_attempts": 0,
    "admitted_at": None,
    "finished_at": None,
    "origin_grant_id": None,
    "trace_context": None,
    "options": None,
    "lease_id": None,
    "followup": 0,
    "inputs_open": 0,
    "priority": 5,
    "queued_at": None,
    "deadline_at": None,
    "version": None,
    "attempt_version": None,
    "pinned_version": None,
    "unpinned_at": None,
    "rewound_from": None,
    "rewound_step": None,
}


def insert_child(conn: Connection, **values: Any) -> ChildRecord:
    """Reserve a new child as ``prepared``; returns its record without reading it back."""
    child = _insert(conn, values, "", ())
    assert child is not None  # no guard: inserted, or raised
    return child


def insert_child_if(
    conn: Connection, guard: str, guard_params: tuple[Any, ...], **values: Any
) -> ChildRecord | None:
    """:func:`insert_child` in one statement, only if the SQL condition ``guard`` holds
    then (None: it did not; nothing was written).

    Columns whose value is None are left to their default (NULL): a parameter with no
    type in a ``SELECT`` list would be taken for text on PostgreSQL.
    """
    return _insert(conn, values, guard, guard_params)


def _insert(
    conn: Connection, values: dict[str, Any], guard: str, guard_params: tuple[Any, ...]
) -> ChildRecord | None:
    row = {**_FRESH, "updated_at": values["created_at"], **values}
    if guard:
        given = {name: value for name, value in row.items() if value is not None}
        sql, params = _insert_sql(tuple(given), guard), (*given.values(), *guard_params)
    else:
        sql, params = _insert_sql(tuple(row), ""), tuple(row.values())
    inserted = run(conn, sql, params).fetchone()
    if inserted is None:
        return None
    row["id"] = int(inserted[0])
    row["followup"] = bool(row["followup"])
    return ChildRecord(*_in_order(row))


_in_order = operator.itemgetter(*FIELDS)  # a row's values as the record orders them


@cache
def _insert_sql(names: tuple[str, ...], guard: str) -> str:
    """Every column in ``names`` from a parameter; with a ``guard``, only if it holds."""
    marks = ", ".join("?" for _ in names)
    source = f"SELECT {marks} WHERE {guard}" if guard else f"VALUES ({marks})"
    return f"INSERT INTO children ({', '.join(names)}) {source} RETURNING id"


def transition(
    conn: Connection, child_id: int, trigger: Trigger, now: float, **fields: Any
) -> State:
    """Fire ``trigger``: one guarded UPDATE; zero matched rows is an error, never a no-op.

    Raises:
        errors.IllegalTransition: the child is not in a state ``trigger`` may leave.
    """
    to = machine.target(trigger)
    if "state" in fields:
        raise ValueError("a transition's target state comes from the table, not from fields")
    values: dict[str, Any] = {**fields, "state": to.value, "updated_at": now}
    if to in machine.TERMINAL:
        values.setdefault("finished_at", now)
    sql = _transition_sql(trigger, tuple(values))
    if run(conn, sql, (*values.values(), child_id)).rowcount != 1:
        current = conn.execute(select(children.c.state).where(children.c.id == child_id)).scalar()
        raise errors.IllegalTransition(
            f"child state transition {trigger.value} is not allowed from {current or 'nowhere'}"
        )
    return to


def advance(
    conn: Connection,
    child_id: int,
    triggers: tuple[Trigger, ...],
    now: float,
    fields: dict[str, Any],
    *,
    unless_cancelled: bool = False,
) -> ChildRecord | None:
    """Fire a chain of triggers (``machine.path``) in one guarded UPDATE, so that no
    reader ever sees the states between; the updated record, or None if nothing
    matched (the caller then looks at the row to learn why). ``fields`` are set too.

    ``unless_cancelled``: match only while no cancellation was requested.
    """
    sources, to = machine.path(triggers)
    values: dict[str, Any] = {**fields, "state": to.value, "updated_at": now}
    sql = _advance_sql(sources, tuple(values), unless_cancelled)
    rows = run(conn, sql, (*values.values(), child_id)).fetchall()
    return from_row(rows[0]) if rows else None


@cache
def _advance_sql(sources: frozenset[State], names: tuple[str, ...], unless_cancelled: bool) -> str:
    return _transition_sql_of(sources, names, unless_cancelled) + f" RETURNING {', '.join(FIELDS)}"


@cache
def _transition_sql(trigger: Trigger, names: tuple[str, ...]) -> str:
    """The guarded UPDATE of one trigger: ``WHERE id = ? AND state IN (its sources)``."""
    return _transition_sql_of(machine.sources(trigger), names, False)


def _transition_sql_of(
    sources: frozenset[State], names: tuple[str, ...], unless_cancelled: bool
) -> str:
    states = ", ".join(f"'{state.value}'" for state in sorted(sources))
    assignments = ", ".join(f"{name} = ?" for name in names)
    guard = " AND cancel_requested_at IS NULL" if unless_cancelled else ""
    return f"UPDATE children SET {assignments} WHERE id = ? AND state IN ({states}){guard}"


def finish(
    conn: Connection, ends: list[tuple[int, str]], now: float, not_admitted: str
) -> dict[int, ChildRecord]:
    """Runs' ends (child id, error), set-based: one guarded UPDATE for up to
    ``IN_LIST_MAX // 2`` of them. Each is ``stop`` (with the cancel's reason) if its
    cancellation was requested, else ``finish`` (with its error, or ``not_admitted``
    for a child that ended unadmitted without one). Returns the ones it ended, by id;
    the others ended already, or are gone, or are in a state neither trigger leaves.

    The UPDATE locks each row as it writes it, so a cancel another host commits
    meanwhile waits, or is seen by it. A lease expiry of 5,000 children is 20 such
    statements on a server store, where one per child was 5,000 round trips."""
    found: dict[int, ChildRecord] = {}
    for batch in chunks(ends, IN_LIST_MAX // 2):
        values = ", ".join("(CAST(? AS BIGINT), CAST(? AS TEXT))" for _ in batch)
        params = [value for pair in batch for value in pair]
        sql = _FINISH_SQL.format(values=values)
        for row in run(conn, sql, (*params, now, now, not_admitted)).fetchall():
            record = from_row(row)
            found[record.id] = record
    return found


def _finish_sql() -> str:
    # STOP and FINISH leave exactly the same states: one WHERE guards both.
    stop, done = machine.sources(Trigger.STOP), machine.sources(Trigger.FINISH)
    if stop != done:
        raise ValueError("stop and finish must leave the same states")
    states = ", ".join(f"'{state.value}'" for state in sorted(stop))
    cancelled, finished = machine.target(Trigger.STOP).value, machine.target(Trigger.FINISH).value
    # The VALUES are cast: PostgreSQL types a bare parameter there as text.
    return (
        "WITH v (fid, ferror) AS (VALUES {values}) UPDATE children SET state = CASE"
        f" WHEN cancel_requested_at IS NOT NULL THEN '{cancelled}' ELSE '{finished}' END,"
        " finished_at = ?, updated_at = ?, error = CASE WHEN cancel_requested_at IS NOT NULL"
        " THEN COALESCE(cancel_reason, '') WHEN admitted_at IS NULL AND v.ferror = ''"
        " THEN ? ELSE v.ferror END FROM v"
        f" WHERE children.id = v.fid AND children.state IN ({states})"
        f" RETURNING {', '.join(f'children.{name}' for name in FIELDS)}"
    )


_FINISH_SQL = _finish_sql()  # its one field: ``{values}``


def request_cancel(
    conn: Connection, child_ids: Iterable[int], now: float, reason: str
) -> list[int]:
    """Record a durable cancellation request on the unfinished children among ``child_ids``.

    An earlier request keeps its reason. Returns every unfinished child of the set,
    whether its request is new or not.
    """
    found: list[int] = []
    for ids in chunks(child_ids):
        conn.execute(
            update(children)
            .where(
                children.c.id.in_(ids),
                children.c.state.in_(ACTIVE_STATES),
                children.c.cancel_requested_at.is_(None),
            )
            .values(cancel_requested_at=now, cancel_reason=reason, updated_at=now)
        )
        found += active_ids(conn, children.c.id.in_(ids))
    return found


def active_ids(conn: Connection, *conditions: Any) -> list[int]:
    query = select(children.c.id).where(children.c.state.in_(ACTIVE_STATES), *conditions)
    return list(conn.execute(query).scalars())


def active_under_lease(conn: Connection, runner_id: str, lease_id: str) -> list[int]:
    """The unfinished children a runner started under a leaseId."""
    return active_ids(conn, children.c.runner_id == runner_id, children.c.lease_id == lease_id)


def active_of_grants(conn: Connection, grant_ids: Iterable[str]) -> list[int]:
    return [
        child_id
        for ids in chunks(grant_ids)
        for child_id in active_ids(conn, children.c.grant_id.in_(ids))
    ]


def pending_first_admissions(conn: Connection, tool_ids: Iterable[str]) -> list[int]:
    """Unadmitted children that these tools authorized under a not-yet-activated lease
    (asked at every tool's end: through the unfinished children only)."""
    found: list[int] = []
    hint = spelling_of(conn).active_index
    for ids in chunks(tool_ids):
        marks = ", ".join("?" for _ in ids)
        sql = (
            f"SELECT c.id FROM children AS c {hint}"
            f" JOIN grants g ON g.id = c.grant_id WHERE c.{ACTIVE_TERM}"
            " AND c.state IN ('prepared', 'queued', 'admitted')"
            f" AND c.origin_grant_id IN ({marks}) AND g.kind = 'lease' AND g.activated_at IS NULL"
        )
        # Queued, or admitted by a policy's turn with its run not past admit() yet (a
        # lease not activated has admitted no run): never run, as a prepared one.
        found += [row[0] for row in run(conn, sql, tuple(ids)).fetchall()]
    return found


def listing(conn: Connection, wanted: ChildFilter) -> list[ChildRecord]:
    """Children newest first, filtered; an unfinished state reads only unfinished rows."""
    active, where, params = _filtered(
        wanted.state, wanted.lease_id, wanted.parent_run_id, wanted.parent_conversation_id
    )
    return _many(conn, where, (*params, wanted.limit), active=active, planned_each_time=True)


def summaries(
    conn: Connection,
    *,
    state: str | None = None,
    lease_id: str | None = None,
    limit: int = 100,
    clip: int | None = None,
) -> list[ChildSummary]:
    """What a list shows of the children :func:`listing` finds: their columns, never a
    stored request, preset or options, with error and output cut to ``clip``
    characters by the query itself (SQLite's and PostgreSQL's ``substr``)."""
    active, where, params = _filtered(state, lease_id, None, None)
    source = spelling_of(conn).active if active else "children"
    sql = f"{_summary_select(source, clip)} WHERE {where}"
    rows = run(conn, sql, (*params, limit), planned_each_time=True)
    return [_summarized(row) for row in rows.fetchall()]


def summary(conn: Connection, conversation_id: str, run_id: str | None) -> ChildSummary | None:
    """One execution as :func:`find` finds it, as a page shows it (error and output
    whole; nothing else stored beside them)."""
    where, params = _found(conversation_id, run_id)
    row = run(conn, f"{_summary_select('children', None)} WHERE {where}", params).fetchone()
    return None if row is None else _summarized(row)


def summary_of_run(conn: Connection, run_id: str) -> ChildSummary | None:
    """The execution whose run id is ``run_id``, as a page shows it."""
    row = run(conn, f"{_summary_select('children', None)} WHERE run_id = ?", (run_id,)).fetchone()
    return None if row is None else _summarized(row)


def conversation_summaries(
    conn: Connection, conversation_id: str | None, before: int | None, limit: int, clip: int
) -> list[ChildSummary]:
    """Up to ``limit`` executions (of one conversation, or all) whose id is below
    ``before`` (None: any), newest first, as a list shows them: a page of a listing
    that goes on from its last id."""
    where, params = [], []
    for term, value in (("conversation_id = ?", conversation_id), ("id < ?", before)):
        if value is not None:
            where.append(term)
            params.append(value)
    sql = f"{_summary_select('children', clip)} WHERE {' AND '.join(where) or 'TRUE'}"
    rows = run(conn, f"{sql} ORDER BY id DESC LIMIT ?", (*params, limit)).fetchall()
    return [_summarized(row) for row in rows]


def _summarized(row: Any) -> ChildSummary:
    values = list(row)
    stored_times(values, _SUMMARY_TIMES)  # a time stored as text: NaN, never text
    return ChildSummary(*values)


def _filtered(
    state: str | None,
    lease_id: str | None,
    parent_run_id: str | None,
    parent_conversation_id: str | None,
) -> tuple[bool, str, list[Any]]:
    """Whether the listing reads through the one-active index, its ``WHERE`` (newest
    first, up to a bound ``LIMIT``) and the parameters before the limit's."""
    active = state in ACTIVE_STATES
    where, params = ([ACTIVE_TERM] if active else []), []
    for name, value in (
        ("state", state),
        ("lease_id", lease_id),
        ("parent_run_id", parent_run_id),
        ("parent_conversation_id", parent_conversation_id),
    ):
        if value is not None:
            where.append(f"{name} = ?")
            params.append(value)
    conditions = " AND ".join(where) or "TRUE"  # no filter: every child
    return active, f"{conditions} ORDER BY id DESC LIMIT ?", params


# What a summary reads: its fields' columns (ChildSummary ends with error and output,
# which a list reads cut).
_SUMMARY = tuple(f.name for f in dataclasses.fields(ChildSummary))
_SUMMARY_TIMES = tuple(
    _SUMMARY.index(name) for name in ("created_at", "finished_at", "admitted_at")
)


@cache
def _summary_select(source: str, clip: int | None) -> str:
    texts = ["error", "output"]
    if clip is not None:
        texts = [f"substr({name}, 1, {int(clip)})" for name in texts]
    return f"SELECT {', '.join([*_SUMMARY[:-2], *texts])} FROM {source}"
