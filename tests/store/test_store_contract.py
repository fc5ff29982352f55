"""One contract suite for every store (design §12, ``delegation.store.interface``).

Each test runs on SQLite and on PostgreSQL (``db_url``), against the store
``stores.open_store`` gives for the URL, as the engine opens it. Only what provokes a
situation differs by store (another connection holding what a write needs: SQLite's
write lock, a PostgreSQL row or table lock); what the store then does is the same.
What only one store has (SQLite's PRAGMAs, its write lock and file lock; PostgreSQL's
lost connections) is tested in tests/store/test_store.py and below, marked as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, func, make_url, select
from sqlalchemy.pool import NullPool

from delegation import errors
from delegation.store import children, grants, migrate, steers, stores, tables
from delegation.store.events import EventRow
from delegation.store.interface import Store
from delegation.store.sql import run, run_many
from tests.harness import rows

BUSY_MS = 300  # the busy timeout of the stores that meet another connection's lock


def open_store(url: str, busy_timeout_ms: int = 5000) -> Store:
    store = stores.open_store(url, synchronous="FULL", busy_timeout_ms=busy_timeout_ms)
    store.open(asyncio.get_running_loop())
    return store


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    opened = open_store(db_url)
    yield opened
    await opened.aclose()  # a second close (a test closed it) does nothing


# --- jobs and rows --------------------------------------------------------------------


def insert(name: str, *, then: BaseException | None = None) -> Callable[[Connection], str]:
    """A job inserting one engine_instances row, then raising ``then`` (after writing)."""

    def job(conn: Connection) -> str:
        run(conn, "INSERT INTO engine_instances (id, started_at) VALUES (?, 1)", (name,))
        if then is not None:
            raise then
        return name

    return job


def ordered(name: str) -> Callable[[Connection], str]:
    """A job inserting a row that records how many rows were there before it."""

    def job(conn: Connection) -> str:
        run(
            conn,
            "INSERT INTO engine_instances (id, started_at)"
            " SELECT ?, COUNT(*) FROM engine_instances",
            (name,),
        )
        return name

    return job


def refuse(conn: Connection) -> None:
    raise errors.NotOwned()


def count(conn: Connection) -> int:
    return int(run(conn, "SELECT COUNT(*) FROM engine_instances").fetchone()[0])


def count_events(conn: Connection) -> int:
    return int(run(conn, "SELECT COUNT(*) FROM events").fetchone()[0])


def add_child(conn: Connection, name: str = "c") -> int:
    """A bare child row for events to belong to; its id."""
    cursor = run(
        conn,
        "INSERT INTO children (conversation_id, run_id, request_id, runner_id,"
        " runner_host_instance_id, parent_conversation_id, parent_run_id, extension_id,"
        " profile, generation, request, preset, cwd, depth, state, created_at, updated_at)"
        " VALUES (?, ?, 'q', 'rn', 'h', 'pc', 'pr', 'e', 'p', 1, ?, ?, '/', 1,"
        " 'prepared', 1, 1) RETURNING id",
        (name, f"run-{name}", b"", b""),
    )
    return int(cursor.fetchone()[0])


def event(child_id: int, sequence: int) -> EventRow:
    return EventRow(child_id, sequence, b'{"kind":"text"}', None)


def instances(url: str) -> set[str]:
    """The engine_instances ids, read from outside the store (another connection)."""
    return {row[0] for row in rows.rows(url, "SELECT id FROM engine_instances")}


def events_of(url: str) -> list[int]:
    return [row[0] for row in rows.rows(url, "SELECT sequence FROM events ORDER BY sequence")]


def domain(exc: BaseException) -> bool:
    """Whether ``exc`` is one of the library's errors, not a driver's or SQLAlchemy's."""
    family = type(exc).__module__
    return isinstance(exc, errors.DelegationError) and family.startswith("delegation.errors.")


# --- another connection in the way (how differs by store) -----------------------------


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextlib.contextmanager
def holding(url: str, *, row: str | None = None, table: str | None = None) -> Iterator[None]:
    """Another connection holds what the store's next write needs, until the block ends.

    SQLite: the database's write lock (``BEGIN IMMEDIATE``): every write waits. PostgreSQL
    has no such lock: the ``engine_instances`` row ``row`` is locked by an uncommitted
    update, or ``table`` by an ``EXCLUSIVE`` table lock (reads go on, writes wait).
    """
    if rows.is_sqlite(url):
        holder = sqlite3.connect(make_url(url).database or "", isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            yield
            holder.execute("ROLLBACK")
        finally:
            holder.close()
        return
    import psycopg

    with psycopg.connect(_libpq(url)) as conn:  # a transaction until the block ends
        if row is not None:
            conn.execute("UPDATE engine_instances SET closed_at = 1 WHERE id = %s", (row,))
        if table is not None:
            conn.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
        yield
        conn.rollback()


def foreign_database(url: str) -> None:
    """Make the (empty) database at ``url`` another application's: a table of its own."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE accounts (id INTEGER PRIMARY KEY)")
    finally:
        engine.dispose()


@pytest.fixture
def empty_url(db_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A database of the same store with nothing in it (no schema)."""
    if rows.is_sqlite(db_url):
        return rows.url_of(tmp_path / "empty.db")
    return str(request.getfixturevalue("postgres_url"))


# --- transactions ---------------------------------------------------------------------


async def test_a_failing_job_writes_nothing_and_its_neighbours_commit(
    store: Store, db_url: str
) -> None:
    outcomes = await asyncio.gather(
        store.write(insert("a")),
        store.write(insert("b", then=ValueError("boom"))),  # fails after writing
        store.write(refuse),  # refuses before writing
        store.write(insert("a")),  # a constraint refuses it
        store.write(insert("c")),
        return_exceptions=True,
    )
    assert outcomes[0] == "a"
    assert type(outcomes[1]) is errors.InternalError, "a bug's exception is not shown"
    assert type(outcomes[2]) is errors.NotOwned, "a domain refusal is given as raised"
    assert type(outcomes[3]) is errors.StoreError, repr(outcomes[3])
    assert outcomes[4] == "c"
    assert instances(db_url) == {"a", "c"}


async def test_a_lone_failing_job_rolls_back_its_writes(store: Store, db_url: str) -> None:
    with pytest.raises(errors.InternalError):
        await store.write(insert("x", then=RuntimeError("late failure")))
    assert await store.write(insert("y")) == "y"
    assert instances(db_url) == {"y"}


async def test_concurrent_jobs_share_commits(store: Store, db_url: str) -> None:
    names = [f"h{n}" for n in range(200)]
    assert await asyncio.gather(*(store.write(insert(n)) for n in names)) == names
    assert instances(db_url) == set(names)


async def test_jobs_run_in_the_order_they_were_queued(store: Store, db_url: str) -> None:
    names = [f"h{n:03}" for n in range(60)]
    futures: list[asyncio.Future[Any]] = []
    for n, name in enumerate(names):
        futures.append(store.submit(ordered(name), durable=n % 2 == 0))
        if n % 5 == 0:
            # A failing neighbour: on PostgreSQL its batch is redone with savepoints.
            futures.append(store.submit(insert(f"x{n}", then=ValueError("no"))))
        if n % 11 == 0:
            await asyncio.sleep(0)  # some turns hand over one job, some many
    await asyncio.gather(*futures, return_exceptions=True)
    await store.barrier()
    committed = rows.rows(db_url, "SELECT id, started_at FROM engine_instances ORDER BY started_at")
    assert [name for name, _ in committed] == names
    assert [int(before) for _, before in committed] == list(range(len(names)))


async def test_a_constraint_violation_is_a_store_error_never_a_drivers(
    store: Store, db_url: str
) -> None:
    await store.write(insert("dup"))
    with pytest.raises(errors.StoreError) as duplicate:
        await store.write(insert("dup"))
    assert domain(duplicate.value), repr(duplicate.value)

    def null(conn: Connection) -> None:
        run(conn, "INSERT INTO engine_instances (id, started_at) VALUES ('n', NULL)")

    def broken_sql(conn: Connection) -> None:
        run(conn, "INSERT INTO no_such_table VALUES (1)")

    failures = await asyncio.gather(
        store.write(null), store.write(broken_sql), store.write(insert("ok")),
        return_exceptions=True,
    )  # fmt: skip
    assert [type(f) for f in failures] == [errors.StoreError, errors.StoreError, str]
    assert instances(db_url) == {"dup", "ok"}
    with pytest.raises(errors.StoreError) as read_failure:
        await store.read(lambda c: run(c, "SELECT * FROM no_such_table").fetchall())
    assert domain(read_failure.value)
    with pytest.raises(errors.StoreError):
        await store.read_now(lambda c: run(c, "SELECT * FROM no_such_table").fetchall())
    assert await store.read(count) == 2, "the reader goes on after a failed read"
    assert await store.read_now(count) == 2


# --- answers are commits --------------------------------------------------------------


@pytest.mark.parametrize("crowd", [1, 20], ids=["inline", "writer"])
async def test_an_answer_and_a_commit_hook_come_only_after_the_commit(
    crowd: int, store: Store, db_url: str
) -> None:
    """Another connection already sees the row when the hook runs and when the caller
    is answered (durable or not)."""
    seen: list[tuple[str, str, bool]] = []

    def look(when: str, name: str) -> None:
        seen.append((when, name, name in instances(db_url)))

    futures = []
    for n in range(crowd):
        name = f"h{n}"
        future = store.submit(insert(name), durable=n % 2 == 0, committed=lambda v: look("hook", v))
        future.add_done_callback(lambda f: look("answer", f.result()))
        futures.append(future)
    await asyncio.gather(*futures)
    await asyncio.sleep(0)  # the done callbacks run a turn later
    assert sorted(seen) == sorted(
        (when, f"h{n}", True) for n in range(crowd) for when in ("hook", "answer")
    )


@pytest.mark.parametrize("crowd", [1, 20], ids=["inline", "writer"])
async def test_the_commit_hook_runs_on_the_loop_before_the_answer(crowd: int, store: Store) -> None:
    get_ident = threading.get_ident
    loop_thread = get_ident()
    seen: list[tuple[str, int]] = []
    futures = [
        store.submit(insert(f"h{n}"), committed=lambda v: seen.append((v, get_ident())))
        for n in range(crowd)
    ]
    futures[0].add_done_callback(lambda _: seen.append(("answered", get_ident())))
    assert await asyncio.gather(*futures) == [f"h{n}" for n in range(crowd)]
    assert seen[: crowd + 1] == [
        *((f"h{n}", loop_thread) for n in range(crowd)),
        ("answered", loop_thread),
    ]


async def test_the_commit_hook_runs_even_when_the_caller_went_away(
    store: Store, db_url: str
) -> None:
    committed = asyncio.Event()

    async def caller() -> str:
        return await store.submit(insert("kept"), committed=lambda _: committed.set())

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0)  # the caller has queued its job and awaits the commit
    task.cancel()
    await asyncio.wait_for(committed.wait(), 5)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert instances(db_url) == {"kept"}


async def test_the_commit_hook_is_skipped_for_a_refused_job_and_a_failing_hook_is_contained(
    store: Store, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[object] = []
    with pytest.raises(errors.NotOwned):
        await store.submit(refuse, committed=calls.append)
    with pytest.raises(errors.StoreError):
        await store.submit(insert("x", then=errors.StoreError("late")), committed=calls.append)
    assert calls == []

    def broken(_: object) -> None:
        raise RuntimeError("hook broke")

    assert await store.submit(insert("still"), committed=broken) == "still"
    assert "commit hook failed" in caplog.text
    assert await store.write(insert("after")) == "after"
    assert instances(db_url) == {"still", "after"}


# --- events ---------------------------------------------------------------------------


async def test_events_commit_with_or_before_the_next_job_and_barrier_is_a_flush(
    store: Store, db_url: str
) -> None:
    child = await store.write(add_child)
    for sequence in range(1, 51):
        store.append_event(event(child, sequence))  # never blocks, never raises
    # A job queued after the events sees them in its own transaction.
    assert await store.write(count_events) == 50
    for sequence in range(51, 101):
        store.append_event(event(child, sequence))
    await store.barrier()  # nothing but a flush
    assert events_of(db_url) == list(range(1, 101))


async def test_an_event_a_constraint_refuses_is_dropped_alone(store: Store, db_url: str) -> None:
    """An event whose child is gone (purged, say) is refused by the foreign key: it is
    dropped, and neither the jobs nor the events beside it in its batch fail, nor do
    later batches."""
    child = await store.write(add_child)
    store.append_event(event(child, 1))
    store.append_event(event(12345, 1))  # no such child
    store.append_event(event(child, 2))
    assert await store.write(insert("beside")) == "beside", "a job in the same batch"
    await store.barrier()
    assert await store.write(insert("later")) == "later"
    await store.barrier()
    assert instances(db_url) == {"beside", "later"}
    assert events_of(db_url) == [1, 2]


async def test_a_batch_that_fails_keeps_its_events_for_the_next(db_url: str) -> None:
    store = open_store(db_url, busy_timeout_ms=BUSY_MS)
    try:
        child = await store.write(add_child)
        with holding(db_url, table="events"):
            for sequence in range(1, 11):
                store.append_event(event(child, sequence))
            with pytest.raises(errors.DatabaseBusy):
                await store.barrier()
            assert events_of(db_url) == []
        store.append_event(event(child, 11))
        await store.barrier()
        assert events_of(db_url) == list(range(1, 12)), "no gap: the failed batch's events too"
    finally:
        await store.aclose()


async def test_on_events_names_the_children_a_batch_committed_events_of(
    store: Store, db_url: str
) -> None:
    loop_thread = threading.get_ident()
    notices: list[tuple[set[int], int, list[int]]] = []

    def on_events(child_ids: set[int]) -> None:
        notices.append((child_ids, threading.get_ident(), events_of(db_url)))

    first = await store.write(add_child)
    second = await store.write(lambda c: add_child(c, "c2"))
    store.on_events = on_events
    await store.write(insert("no events"))
    store.append_event(event(first, 1))
    store.append_event(event(second, 1))
    await store.barrier()
    for _ in range(100):
        if notices:
            break
        await asyncio.sleep(0.01)
    assert notices == [({first, second}, loop_thread, [1, 1])], "after the commit, on the loop"
    store.on_events = None
    store.append_event(event(first, 2))
    await store.barrier()
    await asyncio.sleep(0.05)
    assert len(notices) == 1


# --- reads ----------------------------------------------------------------------------


async def test_read_is_one_snapshot_and_read_now_sees_the_newest_commit(
    store: Store, db_url: str
) -> None:
    await store.write(insert("first"))

    def twice(conn: Connection) -> tuple[int, int]:
        before = count(conn)
        stores.write_once(db_url, insert(f"other{before}"))  # another connection commits
        return before, count(conn)

    assert await store.read(twice) == (1, 1), "read: one snapshot"
    assert await store.read_now(twice) == (2, 3), "read_now: each statement the newest"
    assert await store.read(count) == 3


WRITES = [
    "INSERT INTO engine_instances (id, started_at) VALUES ('from-a-read', 1)",
    "UPDATE engine_instances SET started_at = 2",
]


@pytest.mark.parametrize("sql", WRITES)
async def test_a_read_cannot_write(store: Store, db_url: str, sql: str) -> None:
    # On PostgreSQL each read is a read-only transaction (design §19), not a session
    # started read-only, which target_session_attrs=read-write would refuse.
    await store.write(insert("first"))
    with pytest.raises(errors.StoreError) as in_read:
        await store.read(lambda conn: run(conn, sql))
    assert domain(in_read.value), repr(in_read.value)
    with pytest.raises(errors.StoreError) as in_read_now:
        await store.read_now(lambda conn: run(conn, sql))
    assert domain(in_read_now.value), repr(in_read_now.value)
    written = rows.rows(db_url, "SELECT id, started_at FROM engine_instances")
    assert [tuple(row) for row in written] == [("first", 1)]
    assert await store.read(count) == 1, "the reader goes on"
    assert await store.read_now(count) == 1


async def test_reads_see_only_commits_and_never_wait_for_the_writer(
    store: Store, db_url: str
) -> None:
    started, release = threading.Event(), threading.Event()

    def slow(conn: Connection) -> str:
        insert("uncommitted")(conn)
        started.set()
        assert release.wait(60), "the test never let the writer go"
        return "slow"

    # Queued in one turn, the two go to the writer thread, off the loop.
    pending = asyncio.gather(store.write(slow), store.write(insert("next")))
    try:
        while not started.is_set():
            await asyncio.sleep(0.01)
        begun = time.monotonic()
        assert await store.read(count) == 0
        assert await store.read_now(count) == 0
        assert time.monotonic() - begun < 30, "a read waited for the writer"
    finally:
        release.set()
    assert await pending == ["slow", "next"]
    assert await store.read(count) == 2


# --- busy -----------------------------------------------------------------------------


async def test_a_write_that_waits_past_the_busy_timeout_is_database_busy(db_url: str) -> None:
    store = open_store(db_url, busy_timeout_ms=BUSY_MS)
    try:
        await store.write(insert("held"))

        def touch(conn: Connection) -> int:
            return int(
                run(conn, "UPDATE engine_instances SET closed_at = 2 WHERE id = 'held'").rowcount
            )

        with holding(db_url, row="held"):
            begun = time.monotonic()
            with pytest.raises(errors.DatabaseBusy) as busy:
                await store.write(touch)
            waited = time.monotonic() - begun
        assert domain(busy.value), repr(busy.value)
        assert BUSY_MS / 1000 * 0.9 <= waited < 10
        assert await store.write(touch) == 1, "the retry commits once the lock is gone"
    finally:
        await store.aclose()


async def test_the_loop_keeps_turning_while_a_write_waits_for_a_lock(db_url: str) -> None:
    """What the SQLite store promises (database.py: "the loop never waits for another
    process's lock"), and design §12 asks of both: same guarantees."""
    store = open_store(db_url, busy_timeout_ms=2000)
    try:
        await store.write(insert("held"))
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            with holding(db_url, row="held"):
                pending = asyncio.ensure_future(
                    store.write(lambda c: run(c, "DELETE FROM engine_instances WHERE id = 'held'"))
                )
                begun = time.monotonic()
                while time.monotonic() - begun < 0.5:
                    await asyncio.sleep(0.01)
                stalled = ticks
            await asyncio.wait_for(pending, 10)
        finally:
            ticker.cancel()
        assert stalled >= 10, f"the loop turned {stalled} times in 0.5 s: it waited for a lock"
    finally:
        await store.aclose()


async def test_a_one_write_job_is_committed_when_its_answer_comes(
    store: Store, db_url: str
) -> None:
    """``one_write`` (a server store may commit the job as its statement's own
    transaction): its write is committed, and seen by others, once it is answered,
    also when a Core statement in it began a transaction; one that raises before
    writing leaves nothing."""

    def core_then_write(conn: Connection) -> str:
        conn.execute(select(func.count()).select_from(tables.engine_instances)).scalar()
        return insert("core")(conn)

    def refuse(conn: Connection) -> str:
        raise errors.LeaseNotActivated()

    for durable in (True, False):
        name = f"plain-{durable}"
        assert await store.submit(insert(name), durable=durable, one_write=True) == name
        assert name in instances(db_url)
    assert await store.submit(core_then_write, one_write=True) == "core"
    assert "core" in instances(db_url), "committed before it was answered"
    with pytest.raises(errors.LeaseNotActivated):
        await store.submit(refuse, one_write=True)
    assert await store.write(insert("after")) == "after"
    assert instances(db_url) == {"plain-True", "plain-False", "core", "after"}


# --- ownership ------------------------------------------------------------------------


async def test_a_second_host_is_refused_until_the_first_closes_unless_the_store_is_shared(
    store: Store, db_url: str
) -> None:
    """One host per SQLite file (its lock); a ``shared`` store (PostgreSQL, several hosts
    on one database, design §12) lets a second host open beside the first."""
    shared = getattr(store, "shared", False)
    second = stores.open_store(db_url, synchronous="FULL", busy_timeout_ms=5000)
    try:  # closing a store that never opened does nothing
        if not shared:
            with pytest.raises(errors.HostConflict):
                second.open(asyncio.get_running_loop())
            assert await store.write(insert("first")) == "first", "the first is untouched"
            await store.aclose()
        second.open(asyncio.get_running_loop())
        assert await second.write(insert("second")) == "second"
        if shared:
            assert await store.write(insert("first")) == "first", "both hosts write"
    finally:
        await second.aclose()
    assert instances(db_url) == {"first", "second"}


async def test_aclose_commits_what_is_queued_and_gives_everything_back(db_url: str) -> None:
    store = open_store(db_url)
    child = await store.write(add_child)
    futures = [store.submit(insert(f"h{n}")) for n in range(20)]
    for sequence in range(1, 31):
        store.append_event(event(child, sequence))
    background = store.submit(insert("background"))  # nobody waits for it: still committed
    await store.aclose()
    assert background.done()
    assert all(f.done() for f in futures)
    assert [f.result() for f in futures] == [f"h{n}" for n in range(20)]
    assert instances(db_url) == {f"h{n}" for n in range(20)} | {"background"}
    assert events_of(db_url) == list(range(1, 31))
    # Closed: refusals are the store's own errors; a late event is dropped, not raised.
    with pytest.raises(errors.StoreError):
        store.submit(insert("late"))
    with pytest.raises(errors.StoreError):
        await store.read(count)
    store.append_event(event(child, 31))
    # Everything was given back: another host opens at once.
    again = open_store(db_url)
    try:
        assert await again.read(count) == 21
    finally:
        await again.aclose()
    assert events_of(db_url) == list(range(1, 31))


async def test_open_migrates_a_new_database_to_head(empty_url: str) -> None:
    store = open_store(empty_url)
    try:
        assert await store.write(insert("fresh")) == "fresh"
    finally:
        await store.aclose()
    assert rows.scalar(empty_url, "SELECT version_num FROM alembic_version") == migrate.head()


async def test_open_refuses_another_applications_database(empty_url: str) -> None:
    foreign_database(empty_url)
    for _ in range(2):  # the refusal left no lock behind: the same answer again
        refused = stores.open_store(empty_url, synchronous="FULL", busy_timeout_ms=5000)
        with pytest.raises(errors.SchemaMismatch, match="accounts"):
            refused.open(asyncio.get_running_loop())
    assert rows.rows(empty_url, "SELECT COUNT(*) FROM accounts") == [(0,)]
    assert "alembic_version" not in rows.snapshot(empty_url), "nothing was written"


# --- notices across processes ---------------------------------------------------------


async def test_the_watch_sees_a_commit_another_connection_makes(store: Store, db_url: str) -> None:
    watch = store.watch(0.01)
    try:
        assert not watch.changed()
        stores.write_once(db_url, insert("operator"))
        assert await watch.wait(1.0), "not noticed within 1 s"
    finally:
        watch.close()


# --- the store's operations -----------------------------------------------------------


async def test_set_operations_take_more_ids_than_one_statement_binds(
    store: Store, db_url: str
) -> None:
    """A runner back under another hostInstanceId revokes up to 1024 leases of 64
    children each: more ids than SQLite binds in one statement (32,766). Every operation
    splits its ids in lists of ``IN_LIST_MAX`` on either store; on PostgreSQL (65,535
    binds) 5,000 ids take it through ten of them: 70,000 there took 37 s, mostly
    planning on tables bulk-loaded a moment before (no statistics yet)."""
    total = 40_000 if rows.is_sqlite(db_url) else 5_000

    def fill(conn: Connection) -> None:
        run_many(
            conn,
            "INSERT INTO grants (id, kind, runner_id, extension_id, lease_id, run_id, presets,"
            " created_at, expires_at) VALUES (?, 'lease', 'rn', 'e', ?, 'pr', ?, 1, 100)",
            ((f"g{n}", f"L{n}", b"") for n in range(total)),
        )
        run_many(
            conn,
            "INSERT INTO children (conversation_id, run_id, request_id, runner_id,"
            " runner_host_instance_id, parent_conversation_id, parent_run_id, extension_id,"
            " profile, generation, request, preset, cwd, depth, state, created_at, updated_at,"
            " grant_id) VALUES (?, ?, 'q', 'rn', 'h', 'pc', 'pr', 'e', 'p', 1, ?, ?, '/', 1,"
            " 'prepared', 1, 1, ?)",
            ((f"c{n}", f"r{n}", b"", b"", f"g{n}") for n in range(total)),
        )

    await store.write(fill)
    ids = list(range(1, total + 1))
    grant_ids = [f"g{n}" for n in range(total)]
    assert len(await store.write(lambda c: children.active_of_grants(c, grant_ids))) == total
    cancelled = await store.write(lambda c: children.request_cancel(c, ids, 5.0, "why"))
    assert sorted(cancelled) == ids
    assert len(await store.write(lambda c: grants.close_tools(c, grant_ids, 5.0))) == total
    await store.write(lambda c: grants.revoke_leases(c, grant_ids, 5.0, "why"))
    assert await store.write(lambda c: grants.tools_of_connections(c, grant_ids)) == []
    await store.write(lambda c: steers.mark_delivered(c, ids, 5.0))
    assert rows.rows(
        db_url,
        "SELECT COUNT(*) FROM children WHERE cancel_requested_at = 5.0 AND cancel_reason = 'why'",
    ) == [(total,)]
    assert rows.rows(db_url, "SELECT COUNT(*) FROM grants WHERE revoke_reason = 'why'") == [
        (total,)
    ]


# --- PostgreSQL only: a server that drops the store's connection ----------------------


def terminate(url: str, pid: int) -> None:
    """End one backend of the server, as a restart or an administrator would, and wait
    until it is gone."""
    import psycopg

    with psycopg.connect(_libpq(url), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        for _ in range(500):
            alive = admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
            if alive.fetchone() is None:
                return
            time.sleep(0.01)
    raise AssertionError(f"backend {pid} did not end")


def backend_pid(conn: Connection) -> int:
    return int(run(conn, "SELECT pg_backend_pid()").fetchone()[0])


@pytest.mark.parametrize("first", ["events", "lone job"])
async def test_a_write_connection_the_server_dropped_is_opened_again(
    first: str, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    if rows.is_sqlite(db_url):
        pytest.skip("a connection to a server: PostgreSQL's")
    store = open_store(db_url)
    try:
        child = await store.write(add_child)
        terminate(db_url, await store.write(backend_pid))
        if first == "events":
            for sequence in range(1, 6):
                store.append_event(event(child, sequence))
            with pytest.raises(errors.StoreError) as lost:
                await store.barrier()  # the batch that found the connection broken
            assert domain(lost.value), repr(lost.value)
            await store.barrier()
            assert events_of(db_url) == [1, 2, 3, 4, 5], "its events were kept"
        else:
            with contextlib.suppress(errors.StoreError):  # the batch that found it broken
                await store.write(insert("lone"))
        assert await store.write(insert("after")) == "after"
        assert "after" in instances(db_url)
    finally:
        await store.aclose()
    assert "Exception in callback" not in caplog.text, caplog.text


@pytest.mark.parametrize("one_write", [False, True])
@pytest.mark.parametrize("at", ["statement", "commit"])
async def test_a_session_the_server_ends_inside_a_batch_fails_that_batch_only(
    at: str, one_write: bool, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server ends the session after a job's Core statement (as
    ``idle_in_transaction_session_timeout`` does to a paused host), so the job's next
    statement or the COMMIT fails: SQLAlchemy marks the connection invalid with its
    transaction still to roll back. That job fails; the next ones commit on a new
    connection (one kept waiting for that rollback refused every later batch)."""
    if rows.is_sqlite(db_url):
        pytest.skip("a connection to a server: PostgreSQL's")
    store = open_store(db_url)
    try:

        def dies(conn: Connection) -> None:
            conn.execute(select(func.count()).select_from(tables.engine_instances))
            terminate(db_url, backend_pid(conn))
            if at == "statement":
                conn.execute(select(func.count()).select_from(tables.engine_instances))

        with pytest.raises(errors.StoreError):
            await store.submit(dies, one_write=one_write)
        for name in ("after", "again"):
            assert await store.write(insert(name)) == name
        assert {"after", "again"} <= set(instances(db_url))
    finally:
        await store.aclose()
    assert "Exception in callback" not in caplog.text, caplog.text


async def test_a_rejoin_refuses_what_the_earlier_instance_left_queued(db_url: str) -> None:
    """A fenced host claims a new instance: the events and jobs its earlier instance left
    queued are refused (``HostFenced``), not committed under the new one's fence, where
    an event would land beside the taking host's. The batch being committed when the
    claim came ends first, under the earlier fence."""
    if rows.is_sqlite(db_url):
        pytest.skip("a fence: several hosts share only a PostgreSQL database")
    import psycopg

    store = open_store(db_url)
    try:
        await store.write(insert("first"))
        store.claim("first")
        child = await store.write(add_child)
        with psycopg.connect(_libpq(db_url), autocommit=True) as blocker:
            blocker.execute("BEGIN")  # holds the writer at its fence, on the instance row
            blocker.execute("SELECT 1 FROM engine_instances WHERE id = 'first' FOR UPDATE")
            held = asyncio.ensure_future(store.write(insert("held")))
            waiting = "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            for _ in range(500):  # the writer took that batch alone and waits at its fence
                if rows.scalar(db_url, waiting):
                    break
                await asyncio.sleep(0.01)
            store.append_event(event(child, 1))
            flushed = asyncio.ensure_future(store.barrier())
            queued = asyncio.ensure_future(store.write(insert("queued")))
            await asyncio.sleep(0.1)
            claiming = asyncio.get_running_loop().run_in_executor(None, store.claim, "second")
            await asyncio.sleep(0.1)
            assert not claiming.done(), "the claim waits for the batch being committed"
            blocker.execute("ROLLBACK")
        assert await held == "held"
        await claiming
        for refused in (flushed, queued):
            with pytest.raises(errors.HostFenced):
                await refused
        assert events_of(db_url) == []
        assert "queued" not in instances(db_url)
        assert await store.write(insert("after")) == "after"
    finally:
        await store.aclose()
