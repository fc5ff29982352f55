"""tests.harness.rows reads either store, sees what was committed, and never writes."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import DBAPIError

from delegation.store import migrate
from tests.harness import rows


def _write(url: str, sql: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(sql)
    finally:
        engine.dispose()


def _reads_and_never_writes(url: str) -> None:
    before = rows.snapshot(url)
    assert before["alembic_version"] == [(migrate.head(),)]
    assert set(before) >= {"children", "events", "grants", "engine_instances"}
    _write(url, "INSERT INTO engine_instances (id, started_at) VALUES ('h-1', 1)")
    after = rows.snapshot(url)
    assert after != before, "the snapshot sees a committed write"
    assert after["engine_instances"] == rows.rows(
        url,
        "SELECT id, started_at, closed_at, taken_by, runner_version FROM engine_instances"
        " WHERE id = :id",
        {"id": "h-1"},
    )
    assert rows.scalar(url, "SELECT COUNT(*) FROM engine_instances WHERE id LIKE 'h-%'") == 1
    with pytest.raises(DBAPIError, match=r"(?i)read-?only"):
        rows.rows(url, "DELETE FROM engine_instances")
    assert rows.snapshot(url) == after


def test_rows_of_a_sqlite_file(db_url: str) -> None:
    _reads_and_never_writes(db_url)


def test_rows_of_a_postgresql_database(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    try:
        with engine.begin() as conn:
            migrate.upgrade(conn)
    finally:
        engine.dispose()
    _reads_and_never_writes(postgres_url)
