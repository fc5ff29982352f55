"""What only the SQLite store does: its write lock, its PRAGMAs, its writer thread.

What every store promises (a failing job, order, commit before answer, hooks, events,
reads, ownership, errors) is tests/store/test_store_contract.py, on SQLite and PostgreSQL.
These tests look at SQLite itself (``db_path``), so they run on SQLite only.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import Connection

from delegation import errors
from delegation.store.database import Database
from delegation.store.sql import dbapi
from delegation.store.sqlite.dialect import SqliteDialect
from tests.harness.rows import rows, url_of


def _sqlite(path: Path, *, busy_timeout_ms: int = 5000) -> Database:
    """The writer composed with SQLite's dialect, as ``stores.open_store`` makes it."""
    url = f"sqlite:///{path}"
    return Database(url, SqliteDialect(url, busy_timeout_ms=busy_timeout_ms))


def instances(path: Path) -> set[str]:
    return {row[0] for row in rows(url_of(path), "SELECT id FROM engine_instances")}


def insert(name: str, *, then: BaseException | None = None):  # type: ignore[no-untyped-def]
    def job(conn: Connection) -> str:
        conn.exec_driver_sql("INSERT INTO engine_instances (id, started_at) VALUES (?, 1)", (name,))
        if then is not None:
            raise then
        return name

    return job


@pytest.fixture
async def database(db_path: Path) -> Database:
    db = _sqlite(db_path)
    db.open(asyncio.get_running_loop())
    yield db  # type: ignore[misc]
    db.close()


def where_and_how(conn: Connection) -> tuple[int, int]:
    """The thread a job ran on and the ``synchronous`` level its batch commits at."""
    level = conn.exec_driver_sql("PRAGMA synchronous").scalar_one()
    return threading.get_ident(), int(level)


FULL, NORMAL = 2, 1


async def test_a_lone_job_commits_on_the_loop_and_a_crowd_on_the_writer(
    database: Database, db_path: Path
) -> None:
    loop_thread = threading.get_ident()
    thread, _ = await database.write(where_and_how)
    assert thread == loop_thread
    crowd = await asyncio.gather(*(database.write(where_and_how) for _ in range(20)))
    assert {thread for thread, _ in crowd} == {next(iter(crowd))[0]} != {loop_thread}
    assert await database.write(insert("after")) == "after"
    assert instances(db_path) == {"after"}


async def test_only_a_batch_nobody_was_answered_for_skips_the_disk_sync(
    database: Database,
) -> None:
    assert (await database.write(where_and_how))[1] == FULL
    assert (await database.submit(where_and_how, durable=False))[1] == NORMAL
    # Queued in the same turn, the two share a batch, and one durable job syncs it.
    mixed = await asyncio.gather(
        database.submit(where_and_how, durable=False), database.submit(where_and_how)
    )
    assert [level for _, level in mixed] == [FULL, FULL]
    assert (await database.write(where_and_how))[1] == FULL


@pytest.mark.sqlite_only  # another connection holds SQLite's write lock
async def test_the_loop_never_waits_for_another_process_holding_the_write_lock(
    db_path: Path,
) -> None:
    db = _sqlite(db_path, busy_timeout_ms=20_000)
    db.open(asyncio.get_running_loop())
    holder = sqlite3.connect(db_path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        loop_thread = threading.get_ident()
        begun = time.monotonic()
        pending = asyncio.ensure_future(db.write(where_and_how))
        for _ in range(20):  # the loop keeps turning while the job waits for the lock
            await asyncio.sleep(0.01)
        assert not pending.done()
        assert time.monotonic() - begun < 10  # far below the 20 s busy timeout
        holder.execute("COMMIT")
        thread, level = await asyncio.wait_for(pending, 10)
        assert thread != loop_thread and level == FULL
    finally:
        holder.close()
        db.close()


@pytest.mark.sqlite_only  # a deferred SQLite PRAGMA; another sqlite3 connection then writes
async def test_a_commit_that_fails_gives_the_write_lock_back(
    database: Database, db_path: Path
) -> None:
    def commit_fails(conn: Connection) -> None:  # a deferred check fails at COMMIT
        raw = dbapi(conn)
        raw.execute("PRAGMA defer_foreign_keys=ON")
        raw.execute("INSERT INTO events (child_id, sequence, body) VALUES (999, 1, x'')")

    with pytest.raises(errors.StoreError):
        await database.write(commit_fails)
    assert await database.write(insert("after")) == "after"
    other = sqlite3.connect(db_path, timeout=0.5)
    try:
        other.execute("INSERT INTO engine_instances (id, started_at) VALUES ('other', 1)")
        other.commit()
    finally:
        other.close()
    assert instances(db_path) == {"after", "other"}


@pytest.mark.sqlite_only  # another connection takes SQLite's write lock
async def test_an_inline_job_that_fails_after_writing_is_redone_off_the_loop(
    db_path: Path,
) -> None:
    """The redo takes the write lock again: on the writer thread, never on the loop's."""
    db = _sqlite(db_path, busy_timeout_ms=20_000)
    db.open(asyncio.get_running_loop())
    holder = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    assert db._conn is not None
    raw = dbapi(db._conn)
    loop_thread = threading.get_ident()
    begins: list[str] = []

    def trace(sql: str) -> None:
        if sql.startswith("BEGIN IMMEDIATE") and threading.get_ident() == loop_thread:
            begins.append(sql)
            if len(begins) == 2:  # a redo on the loop: another process got in first
                holder.execute("BEGIN IMMEDIATE")
                threading.Timer(30, lambda: holder.execute("COMMIT")).start()

    raw.set_trace_callback(trace)
    try:
        begun = time.monotonic()
        with pytest.raises(errors.InternalError):
            await db.write(insert("x", then=RuntimeError("after writing")))
        assert time.monotonic() - begun < 20  # not after the other's 30 s transaction
        assert len(begins) == 1
    finally:
        raw.set_trace_callback(None)
        holder.close()
        db.close()
    assert instances(db_path) == set()


@pytest.mark.sqlite_only  # SQLite's journal mode
async def test_a_file_sqlite_will_not_keep_in_wal_mode_is_refused_at_open(
    db_path: Path,
) -> None:
    """Without WAL a COMMIT waits for readers, and the write connection has no busy
    handler (the writer waits only for BEGIN): such a file is refused, not half-served.
    SQLite answers a mode other than WAL on a file system without shared memory; here
    the engine's own pragma asks for another mode to make SQLite answer it."""
    dialect = SqliteDialect(f"sqlite:///{db_path}")
    dialect._pragmas["journal_mode"] = "DELETE"
    db = Database(dialect.url, dialect)
    with pytest.raises(errors.StoreError) as info:
        db.open(asyncio.get_running_loop())
    assert "needs SQLite's WAL journal mode" in str(info.value)
    assert "in delete mode" in str(info.value)
    assert not any(t.name == "delegation-writer" for t in threading.enumerate())
