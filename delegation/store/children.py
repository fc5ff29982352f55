"""Child rows: reservation, guarded transitions, cancellation requests and queries."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, Row, func, insert, select, update

from delegation import errors, machine
from delegation.machine import State, Trigger
from delegation.records import ChildRecord
from delegation.store.tables import children, grants, purged

ACTIVE_STATES = [s.value for s in machine.ACTIVE]


def _record(row: Row[Any]) -> ChildRecord:
    values = dict(row._mapping)
    values["followup"] = bool(values["followup"])
    return ChildRecord(**values)


def get(conn: Connection, child_id: int) -> ChildRecord | None:
    row = conn.execute(select(children).where(children.c.id == child_id)).first()
    return None if row is None else _record(row)


def find(conn: Connection, conversation_id: str, run_id: str | None = None) -> ChildRecord | None:
    """One execution: by run id, or the newest of the conversation."""
    query = select(children).where(children.c.conversation_id == conversation_id)
    if run_id:
        query = query.where(children.c.run_id == run_id)
    row = conn.execute(query.order_by(children.c.id.desc()).limit(1)).first()
    return None if row is None else _record(row)


def by_request(conn: Connection, grant_id: str, request_id: str) -> ChildRecord | None:
    row = conn.execute(
        select(children).where(children.c.grant_id == grant_id, children.c.request_id == request_id)
    ).first()
    return None if row is None else _record(row)


def of_grant(conn: Connection, grant_id: str, conversation_id: str) -> list[ChildRecord]:
    rows = conn.execute(
        select(children).where(
            children.c.grant_id == grant_id, children.c.conversation_id == conversation_id
        )
    )
    return [_record(row) for row in rows]


def by_state(conn: Connection, state: str) -> list[ChildRecord]:
    rows = conn.execute(select(children).where(children.c.state == state).order_by(children.c.id))
    return [_record(row) for row in rows]


def was_purged(conn: Connection, grant_id: str, conversation_id: str, run_id: str) -> bool:
    """Whether an execution under this grant was purged after retention."""
    query = select(purged.c.run_id).where(
        purged.c.grant_id == grant_id, purged.c.conversation_id == conversation_id
    )
    if run_id:
        query = query.where(purged.c.run_id == run_id)
    return conn.execute(query.limit(1)).first() is not None


def count_of_grant(conn: Connection, grant_id: str) -> int:
    query = select(func.count()).where(children.c.grant_id == grant_id)
    return int(conn.execute(query).scalar_one())


def executions(conn: Connection, conversation_id: str) -> list[ChildRecord]:
    rows = conn.execute(
        select(children)
        .where(children.c.conversation_id == conversation_id)
        .order_by(children.c.id)
    )
    return [_record(row) for row in rows]


def depth_of_run(conn: Connection, run_id: str) -> int:
    """The nesting depth of a run: a child's own depth, or 0 for a top-level run."""
    depth = conn.execute(select(children.c.depth).where(children.c.run_id == run_id)).scalar()
    return int(depth or 0)


def insert_child(conn: Connection, **values: Any) -> int:
    values.setdefault("state", State.PREPARED.value)
    values.setdefault("updated_at", values["created_at"])
    result = conn.execute(insert(children).values(**values))
    key = result.inserted_primary_key
    assert key is not None
    return int(key[0])


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
    result = conn.execute(
        update(children)
        .where(
            children.c.id == child_id,
            children.c.state.in_([s.value for s in machine.sources(trigger)]),
        )
        .values(**values)
    )
    if result.rowcount != 1:
        current = conn.execute(select(children.c.state).where(children.c.id == child_id)).scalar()
        raise errors.IllegalTransition(
            f"child state transition {trigger.value} is not allowed from {current or 'nowhere'}"
        )
    return to


def request_cancel(
    conn: Connection, child_ids: Iterable[int], now: float, reason: str
) -> list[int]:
    """Record a durable cancellation request on the unfinished children among ``child_ids``.

    An earlier request keeps its reason. Returns every unfinished child of the set,
    whether its request is new or not.
    """
    ids = list(child_ids)
    if not ids:
        return []
    conn.execute(
        update(children)
        .where(
            children.c.id.in_(ids),
            children.c.state.in_(ACTIVE_STATES),
            children.c.cancel_requested_at.is_(None),
        )
        .values(cancel_requested_at=now, cancel_reason=reason, updated_at=now)
    )
    return active_ids(conn, children.c.id.in_(ids))


def active_ids(conn: Connection, *conditions: Any) -> list[int]:
    query = select(children.c.id).where(children.c.state.in_(ACTIVE_STATES), *conditions)
    return list(conn.execute(query).scalars())


def active_of_grants(conn: Connection, grant_ids: Iterable[str]) -> list[int]:
    return active_ids(conn, children.c.grant_id.in_(list(grant_ids)))


def pending_first_admissions(conn: Connection, tool_ids: Iterable[str]) -> list[int]:
    """Unadmitted children that these tools authorized under a not-yet-activated lease."""
    query = (
        select(children.c.id)
        .join(grants, grants.c.id == children.c.grant_id)
        .where(
            children.c.origin_grant_id.in_(list(tool_ids)),
            children.c.state == State.PREPARED.value,
            grants.c.kind == "lease",
            grants.c.activated_at.is_(None),
        )
    )
    return list(conn.execute(query).scalars())


def listing(
    conn: Connection,
    *,
    state: str | None = None,
    lease_id: str | None = None,
    parent_run_id: str | None = None,
    parent_conversation_id: str | None = None,
    limit: int = 100,
) -> list[ChildRecord]:
    query = select(children)
    for column, value in (
        (children.c.state, state),
        (children.c.lease_id, lease_id),
        (children.c.parent_run_id, parent_run_id),
        (children.c.parent_conversation_id, parent_conversation_id),
    ):
        if value is not None:
            query = query.where(column == value)
    rows = conn.execute(query.order_by(children.c.id.desc()).limit(limit))
    return [_record(row) for row in rows]
