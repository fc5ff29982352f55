"""Steer receipts (idempotent per child and requestId) and the durable steer queue."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Connection, func, insert, select, update

from delegation.store import chunks
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
