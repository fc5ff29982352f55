"""The one way to SQLite: group commit, isolation of a failing job, commit-before-answer."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import Connection

from delegation import errors
from delegation.store import children, dbapi, grants, steers
from delegation.store.database import Database
from delegation.store.events import EventRow
from tests.rows import rows, url_of


def instances(path: Path) -> set[str]:
    return {row[0] for row in rows(url_of(path), "SELECT id FROM host_instances")}


def insert(name: str, *, then: BaseException | None = None):  # type: ignore[no-untyped-def]
    def job(conn: Connection) -> str:
        conn.exec_driver_sql("INSERT INTO host_instances (id, started_at) VALUES (?, 1)", (name,))
        if then is not None:
            raise then
        return name

    return job


def refuse(conn: Connection) -> None:
    raise errors.NotOwned()


@pytest.fixture
async def database(db_path: Path) -> Database:
    db = Database(f"sqlite:///{db_path}")
    db.open(asyncio.get_running_loop())
    yield db  # type: ignore[misc]
    db.close()


async def test_a_job_that_fails_after_writing_leaves_nothing_and_spares_its_batch(
    database: Database, db_path: Path
) -> None:
    outcomes = await asyncio.gather(
        database.write(insert("a")),
        database.write(insert("b", then=ValueError("boom"))),
        database.write(refuse),
        database.write(insert("c")),
        return_exceptions=True,
    )
    assert outcomes[0] == "a"
    assert isinstance(outcomes[1], errors.InternalError)
    assert isinstance(outcomes[2], errors.NotOwned)
    assert outcomes[3] == "c"
    assert instances(db_path) == {"a", "c"}


async def test_a_lone_failing_job_rolls_back_its_writes(database: Database, db_path: Path) -> None:
    with pytest.raises(errors.InternalError):
        await database.write(insert("x", then=RuntimeError("late failure")))
    assert await database.write(insert("y")) == "y"
    assert instances(db_path) == {"y"}


async def test_concurrent_jobs_share_commits(database: Database, db_path: Path) -> None:
    names = [f"h{n}" for n in range(200)]
    assert await asyncio.gather(*(database.write(insert(n)) for n in names)) == names
    assert instances(db_path) == set(names)


@pytest.mark.sqlite_only  # the child is inserted behind the engine's back, through sqlite3
async def test_an_answer_comes_only_after_commit(database: Database, db_path: Path) -> None:
    await database.write(insert("owner"))
    with sqlite3.connect(db_path) as conn:
        conn.execute(
            "INSERT INTO children (conversation_id, run_id, request_id, runner_id,"
            " runner_host_instance_id, parent_conversation_id, parent_run_id, extension_id,"
            " profile, generation, request, preset, cwd, depth, state, created_at, updated_at)"
            " VALUES ('c', 'r', 'q', 'rn', 'h', 'pc', 'pr', 'e', 'p', 1, x'', x'', '/', 1,"
            " 'prepared', 1, 1)"
        )
    child = 1
    for sequence in range(1, 51):
        database.append_event(EventRow(child, sequence, b'{"kind":"text"}', None))
    await database.barrier()
    assert rows(url_of(db_path), "SELECT COUNT(*) FROM events") == [(50,)]


# --- the commit hook: what must follow a commit, whoever still waits for it ------------


@pytest.mark.parametrize("crowd", [1, 20], ids=["inline", "writer"])
async def test_the_commit_hook_runs_on_the_loop_before_the_answer(
    crowd: int, database: Database
) -> None:
    get_ident = threading.get_ident
    loop_thread = get_ident()
    seen: list[tuple[str, int]] = []
    futures = [
        database.submit(
            insert(f"h{n}"), committed=lambda v: seen.append((v, threading.get_ident()))
        )
        for n in range(crowd)
    ]
    first = futures[0]
    first.add_done_callback(lambda _: seen.append(("answered", get_ident())))
    assert await asyncio.gather(*futures) == [f"h{n}" for n in range(crowd)]
    assert seen[: crowd + 1] == [
        *((f"h{n}", loop_thread) for n in range(crowd)),
        ("answered", loop_thread),
    ]


async def test_the_commit_hook_runs_even_when_the_caller_went_away(
    database: Database, db_path: Path
) -> None:
    committed = asyncio.Event()

    async def caller() -> str:
        return await database.submit(insert("kept"), committed=lambda _: committed.set())

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0)  # the caller has queued its job and awaits the commit
    task.cancel()
    await asyncio.wait_for(committed.wait(), 5)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert instances(db_path) == {"kept"}


async def test_the_commit_hook_is_skipped_for_a_refused_job_and_a_failing_hook_is_contained(
    database: Database, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[object] = []
    with pytest.raises(errors.NotOwned):
        await database.submit(refuse, committed=calls.append)
    assert calls == []

    def broken(_: object) -> None:
        raise RuntimeError("hook broke")

    assert await database.submit(insert("still"), committed=broken) == "still"
    assert "commit hook failed" in caplog.text
    assert await database.write(insert("after")) == "after"
    assert instances(db_path) == {"still", "after"}


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
    db = Database(f"sqlite:///{db_path}", busy_timeout_ms=20_000)
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


@pytest.mark.sqlite_only  # SQLite's bind limit; the children are inserted through sqlite3
async def test_set_operations_take_more_ids_than_sqlite_binds_in_one_statement(
    database: Database, db_path: Path
) -> None:
    """A runner back under another hostInstanceId revokes up to 1024 leases of 64
    children each: more ids than SQLite's 32,766 variables per statement."""
    count = 40_000
    with sqlite3.connect(db_path) as conn:
        conn.executemany(
            "INSERT INTO children (conversation_id, run_id, request_id, runner_id,"
            " runner_host_instance_id, parent_conversation_id, parent_run_id, extension_id,"
            " profile, generation, request, preset, cwd, depth, state, created_at, updated_at,"
            " grant_id) VALUES (?, ?, 'q', 'rn', 'h', 'pc', 'pr', 'e', 'p', 1, x'', x'', '/', 1,"
            " 'prepared', 1, 1, ?)",
            ((f"c{n}", f"r{n}", f"g{n}") for n in range(count)),
        )
    ids = list(range(1, count + 1))
    grant_ids = [f"g{n}" for n in range(count)]

    assert len(await database.write(lambda c: children.active_of_grants(c, grant_ids))) == count
    cancelled = await database.write(lambda c: children.request_cancel(c, ids, 5.0, "why"))
    assert sorted(cancelled) == ids
    assert await database.write(lambda c: grants.close_tools(c, grant_ids, 5.0)) == []
    await database.write(lambda c: grants.revoke_leases(c, grant_ids, 5.0, "why"))
    assert await database.write(lambda c: grants.tools_of_connections(c, grant_ids)) == []
    await database.write(lambda c: steers.mark_delivered(c, ids, 5.0))
    assert rows(
        url_of(db_path),
        "SELECT COUNT(*) FROM children WHERE cancel_requested_at = 5.0 AND cancel_reason = 'why'",
    ) == [(count,)]


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
        other.execute("INSERT INTO host_instances (id, started_at) VALUES ('other', 1)")
        other.commit()
    finally:
        other.close()
    assert instances(db_path) == {"after", "other"}


async def test_an_event_a_constraint_refuses_does_not_fail_every_later_batch(
    database: Database, db_path: Path
) -> None:
    database.append_event(EventRow(12345, 1, b"{}", None))  # no such child
    with pytest.raises(errors.StoreError):
        await database.barrier()
    assert await database.write(insert("later")) == "later"
    assert instances(db_path) == {"later"}


@pytest.mark.sqlite_only  # another connection takes SQLite's write lock
async def test_an_inline_job_that_fails_after_writing_is_redone_off_the_loop(
    db_path: Path,
) -> None:
    """The redo takes the write lock again: on the writer thread, never on the loop's."""
    db = Database(f"sqlite:///{db_path}", busy_timeout_ms=20_000)
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
                threading.Timer(3, lambda: holder.execute("COMMIT")).start()

    raw.set_trace_callback(trace)
    try:
        begun = time.monotonic()
        with pytest.raises(errors.InternalError):
            await db.write(insert("x", then=RuntimeError("after writing")))
        assert time.monotonic() - begun < 2.5
        assert len(begins) == 1
    finally:
        raw.set_trace_callback(None)
        holder.close()
        db.close()
    assert instances(db_path) == set()
