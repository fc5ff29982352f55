"""Steer receipts (idempotent per child and requestId) and the durable steer queue."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Connection, func, insert, select, update

from delegation.store.sql import chunks, run
from delegation.store.tables import steers


def receipt(conn: Connection, child_id: int, request_id: str) -> tuple[str, str, str] | None:
    """The stored (message, outcome, reason) of a steer requestId, if any."""
    row = conn.execute(
        select(steers.c.message, steers.c.outcome, steers.c.reason).where(
            steers.c.child_id == child_id, steers.c.request_id == request_id
        )
    ).first()
    return None if row is None else (row.message, row.outcome, row.reason)


def count(conn: Connection, child_id: int) -> int:
    return int(conn.execute(select(func.count()).where(steers.c.child_id == child_id)).scalar_one())


def insert_receipt(
    conn: Connection,
    child_id: int,
    request_id: str,
    message: str,
    outcome: str,
    reason: str,
    now: float,
) -> int:
    result = conn.execute(
        insert(steers).values(
            child_id=child_id,
            request_id=request_id,
            message=message,
            outcome=outcome,
            reason=reason,
            created_at=now,
        )
    )
    key = result.inserted_primary_key
    assert key is not None
    return int(key[0])


def mark_delivered(conn: Connection, steer_ids: Iterable[int], now: float) -> None:
    for ids in chunks(steer_ids):
        conn.execute(
            update(steers)
            .where(steers.c.id.in_(ids), steers.c.delivered_at.is_(None))
            .values(delivered_at=now)
        )


def undelivered(conn: Connection, child_ids: list[int]) -> list[tuple[int, int, str]]:
    """Injected steers of these children not delivered yet, oldest first."""
    found: list[tuple[int, int, str]] = []
    for ids in chunks(child_ids):
        marks = ", ".join("?" for _ in ids)
        found += [
            (int(child), int(steer), str(message))
            for child, steer, message in run(
                conn,
                "SELECT child_id, id, message FROM steers WHERE outcome = 'injected'"
                f" AND delivered_at IS NULL AND child_id IN ({marks}) ORDER BY id",
                tuple(ids),
            ).fetchall()
        ]
    return found
