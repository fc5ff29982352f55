"""The step journal (design §15): each step an execution recorded, by child and name.

The statements are plain SQL both stores spell alike (named parameters, ``ON CONFLICT``
as SQLite and PostgreSQL both write it).
"""

from __future__ import annotations

from sqlalchemy import Connection, text

from delegation import errors
from delegation.records import RecordedStep, StepRow
from delegation.store.sql import stored_time

_RECORD = text(
    "INSERT INTO steps (child_id, name, ordinal, raw, value, recorded_at)"
    " VALUES (:child_id, :name, :ordinal, :raw, :value, :now)"
    " ON CONFLICT (child_id, name) DO NOTHING"
)
_VALUE = text("SELECT raw, value FROM steps WHERE child_id = :child_id AND name = :name")
_NAMES = text("SELECT name FROM steps WHERE child_id = :child_id ORDER BY ordinal")
_LIST = text(
    "SELECT name, ordinal, length(value), recorded_at FROM steps"
    " WHERE child_id = :child_id ORDER BY ordinal LIMIT :limit"
)
_LATEST = text(
    "SELECT name, ordinal, length(value), recorded_at FROM steps"
    " WHERE child_id = :child_id ORDER BY ordinal DESC LIMIT :limit"
)
_OF_RUN = text(
    "SELECT s.raw, s.value FROM steps s JOIN children c ON c.id = s.child_id"
    " WHERE c.run_id = :run_id AND c.conversation_id = :conversation AND s.name = :name"
)
_RUN_OF = text("SELECT 1 FROM children WHERE run_id = :run_id AND conversation_id = :conversation")
_PREVIOUS = text(
    "SELECT run_id FROM children WHERE conversation_id = :conversation AND id < :child_id"
    " ORDER BY id DESC LIMIT 1"
)
_COUNT = text("SELECT count(*) FROM steps WHERE child_id = :child_id")


def record(
    conn: Connection, child_id: int, name: str, ordinal: int, step: RecordedStep, now: float
) -> RecordedStep:
    """Record a step; what is recorded under the name: this one, or (if another
    process recorded the name first) that one — a step is recorded at most once."""
    params = {
        "child_id": child_id,
        "name": name,
        "ordinal": ordinal,
        "raw": int(step.raw),
        "value": step.value,
        "now": now,
    }
    if conn.execute(_RECORD, params).rowcount == 1:
        return step
    first = value(conn, child_id, name)
    assert first is not None  # the conflict was this row; steps leave only with the child
    return first


def value(conn: Connection, child_id: int, name: str) -> RecordedStep | None:
    row = conn.execute(_VALUE, {"child_id": child_id, "name": name}).first()
    return None if row is None else RecordedStep(bool(row[0]), bytes(row[1]))


def of_run(conn: Connection, conversation_id: str, run_id: str, name: str) -> RecordedStep | None:
    """A step of the execution ``run_id`` of the conversation (a follow-up's history).

    Raises:
        errors.ChildNotFound: no execution ``run_id`` in this conversation.
    """
    params = {"run_id": run_id, "conversation": conversation_id, "name": name}
    row = conn.execute(_OF_RUN, params).first()
    if row is not None:
        return RecordedStep(bool(row[0]), bytes(row[1]))
    if conn.execute(_RUN_OF, params).first() is None:
        raise errors.ChildNotFound(f"child not found: no execution {run_id} in this conversation")
    return None


def previous_run_id(conn: Connection, conversation_id: str, child_id: int) -> str | None:
    """The execution of the conversation before ``child_id``'s, if any."""
    params = {"conversation": conversation_id, "child_id": child_id}
    return conn.execute(_PREVIOUS, params).scalar()


def names(conn: Connection, child_id: int) -> list[str]:
    """The names an execution recorded, in the order it recorded them."""
    return [name for (name,) in conn.execute(_NAMES, {"child_id": child_id})]


def count(conn: Connection, child_id: int) -> int:
    return int(conn.execute(_COUNT, {"child_id": child_id}).scalar_one())


def listing(conn: Connection, child_id: int, limit: int = 10_000) -> list[StepRow]:
    """Each step's name, place, size and time (never its value), oldest first."""
    rows = conn.execute(_LIST, {"child_id": child_id, "limit": limit})
    return [StepRow(name, ordinal, int(size), stored_time(at)) for name, ordinal, size, at in rows]


def latest(conn: Connection, child_id: int, limit: int) -> list[StepRow]:
    """The last ``limit`` steps of :func:`listing`, oldest first (what an execution
    did last, when it recorded more than an operator's view shows)."""
    rows = conn.execute(_LATEST, {"child_id": child_id, "limit": limit})
    found = [StepRow(name, ordinal, int(size), stored_time(at)) for name, ordinal, size, at in rows]
    return found[::-1]
