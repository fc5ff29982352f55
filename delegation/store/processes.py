"""The recorded operating-system processes of child runs (design §10)."""

from __future__ import annotations

from sqlalchemy import Connection

from delegation.os_processes import ProcessId
from delegation.store.sql import chunks, run


def record(conn: Connection, child_id: int, process: ProcessId, now: float) -> None:
    """Record (or replace) the process a child's run started."""
    run(
        conn,
        "INSERT INTO processes (child_id, pid, start_ticks, boot_id, recorded_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (child_id) DO UPDATE SET pid = excluded.pid,"
        " start_ticks = excluded.start_ticks, boot_id = excluded.boot_id,"
        " recorded_at = excluded.recorded_at",
        (child_id, process.pid, process.start, process.boot, now),
    )


def forget(conn: Connection, child_ids: list[int]) -> None:
    """Forget the processes these children recorded (their runs reaped them)."""
    for part in chunks(child_ids):
        marks = ", ".join("?" for _ in part)
        run(conn, f"DELETE FROM processes WHERE child_id IN ({marks})", tuple(part))


def recorded(conn: Connection) -> list[ProcessId]:
    rows = run(conn, "SELECT pid, start_ticks, boot_id FROM processes ORDER BY child_id")
    return [ProcessId(pid, start, boot) for pid, start, boot in rows.fetchall()]
