"""Registrations: the engine's instances, the runners registered with it and their
connections."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterable

from sqlalchemy import Connection, insert, select, update

from delegation.records import RunnerConnection, RunnerRecord
from delegation.store.sql import chunks, run
from delegation.store.tables import connections, engine_instances, runners


def insert_instance(
    conn: Connection, instance_id: str, now: float, runner_version: str | None = None
) -> None:
    conn.execute(
        insert(engine_instances).values(
            id=instance_id, started_at=now, runner_version=runner_version
        )
    )


def close_instance(conn: Connection, instance_id: str, now: float) -> None:
    conn.execute(
        update(engine_instances).where(engine_instances.c.id == instance_id).values(closed_at=now)
    )


def instance_is_live(conn: Connection, instance_id: str) -> bool:
    """Whether a host instance is still live: neither closed nor taken over."""
    row = run(
        conn,
        "SELECT closed_at IS NULL AND taken_by IS NULL FROM engine_instances WHERE id = ?",
        (instance_id,),
    ).fetchone()
    return bool(row and row[0])


def live_instances(conn: Connection, instance_ids: Iterable[str]) -> set[str]:
    """The live ones (:func:`instance_is_live`) among these host instances."""
    live: set[str] = set()
    for part in chunks(sorted(set(instance_ids))):
        marks = ", ".join("?" for _ in part)
        sql = (
            f"SELECT id FROM engine_instances WHERE id IN ({marks})"
            " AND closed_at IS NULL AND taken_by IS NULL"
        )
        live.update(row[0] for row in run(conn, sql, tuple(part)).fetchall())
    return live


# The record's fields in its own order, so a row becomes a record by position.
FIELDS = tuple(f.name for f in dataclasses.fields(RunnerRecord))


def get_runner(conn: Connection, runner_id: str) -> RunnerRecord | None:
    row = run(
        conn, f"SELECT {', '.join(FIELDS)} FROM runners WHERE runner_id = ?", (runner_id,)
    ).fetchone()
    return None if row is None else RunnerRecord(*row)


def register(
    conn: Connection, runner_id: str, host_instance_id: str, engine_instance_id: str, now: float
) -> tuple[RunnerConnection, RunnerRecord | None]:
    """Open a new connection one generation above the last; the previous one is closed."""
    previous = get_runner(conn, runner_id)
    generation = 1 if previous is None else previous.generation + 1
    connection_id = secrets.token_hex(16)
    values = {
        "host_instance_id": host_instance_id,
        "generation": generation,
        "connection_id": connection_id,
        "updated_at": now,
    }
    if previous is None:
        conn.execute(insert(runners).values(runner_id=runner_id, **values))
    else:
        conn.execute(update(runners).where(runners.c.runner_id == runner_id).values(**values))
        if previous.connection_id is not None:
            _close(conn, previous.connection_id, now)
    conn.execute(
        insert(connections).values(
            id=connection_id,
            runner_id=runner_id,
            generation=generation,
            host_instance_id=host_instance_id,
            engine_instance_id=engine_instance_id,
            opened_at=now,
        )
    )
    handle = RunnerConnection(connection_id, runner_id, host_instance_id, generation)
    return handle, previous


def disconnect(conn: Connection, connection_id: str, now: float) -> None:
    """Close the connection; the runner has no live connection until it registers again."""
    _close(conn, connection_id, now)
    conn.execute(
        update(runners)
        .where(runners.c.connection_id == connection_id)
        .values(connection_id=None, updated_at=now)
    )


def _close(conn: Connection, connection_id: str, now: float) -> None:
    conn.execute(
        update(connections)
        .where(connections.c.id == connection_id, connections.c.closed_at.is_(None))
        .values(closed_at=now)
    )


def open_connections(conn: Connection, engine_instance_id: str | None = None) -> list[str]:
    """Connections not yet closed (of one engine instance, or of every other one)."""
    query = select(connections.c.id).where(connections.c.closed_at.is_(None))
    if engine_instance_id is not None:
        query = query.where(connections.c.engine_instance_id == engine_instance_id)
    return list(conn.execute(query).scalars())


def open_connections_of_taken(conn: Connection) -> list[str]:
    """Open connections of instances another host took over: those taken right now, and
    any a fenced host opened under its old instance while it rejoined (its batches in
    that window are fenced on the instance it rejoins as)."""
    taken = select(engine_instances.c.id).where(engine_instances.c.taken_by.is_not(None))
    query = select(connections.c.id).where(
        connections.c.closed_at.is_(None), connections.c.engine_instance_id.in_(taken)
    )
    return list(conn.execute(query).scalars())
