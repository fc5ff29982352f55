"""What only the PostgreSQL store has: a server that can drop a connection, NOTIFY."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from psycopg import pq
from sqlalchemy import Connection

from delegation import Engine, EngineConfig, errors
from delegation.store import stores
from delegation.store.events import EventRow, insert_events
from delegation.store.interface import Store
from delegation.store.postgres.connect import libpq
from delegation.store.sql import dbapi, run
from delegation.usecases import maintenance
from tests.harness import rows
from tests.harness.pg_sessions import _terminate
from tests.harness.support import ScriptRunner, open_harness


async def test_a_dropped_connection_fails_one_call_at_most_then_the_store_connects_again(
    postgres_db: str, workspace: Path
) -> None:
    runner = ScriptRunner()
    async with Engine(postgres_db, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        first = await h.start("q1")
        await h.wait_done(first.conversation_id)
        assert _terminate(postgres_db, "delegation-writer") == 1
        assert _terminate(postgres_db, "delegation-reader") == 1
        failures = 0
        for attempt in range(3):
            try:
                child = await h.start(f"q-after-{attempt}")
                done = await h.wait_done(child.conversation_id)
                assert done.state == "done"
                break
            except errors.StoreError:
                failures += 1
                await asyncio.sleep(0.05)
        assert failures <= 2, "the store connected again"
        again = await engine.get_child(first.conversation_id)
        assert again is not None and again.state == "done"


@contextlib.asynccontextmanager
async def _opened(url: str, busy_timeout_ms: int = 5000) -> AsyncIterator[Store]:
    store = stores.open_store(url, synchronous="FULL", busy_timeout_ms=busy_timeout_ms)
    store.open(asyncio.get_running_loop())
    try:
        yield store
    finally:
        await store.aclose()


def _child(conn: Connection, name: str, instance: str | None = None) -> int:
    """A bare child row (of host instance ``instance``); its id."""
    cursor = run(
        conn,
        "INSERT INTO children (conversation_id, run_id, request_id, runner_id,"
        " runner_host_instance_id, parent_conversation_id, parent_run_id, extension_id,"
        " profile, generation, request, preset, cwd, depth, state, created_at, updated_at,"
        " engine_instance_id) VALUES (?, ?, ?, 'rn', 'h', 'pc', 'pr', 'e', 'p', 1,"
        " ?, ?, '/', 1, 'prepared', 1, 1, ?) RETURNING id",
        (f"c-{name}", f"r-{name}", f"q-{name}", b"", b"", instance),
    )
    return int(cursor.fetchone()[0])


def _insert_traced(conn: Connection, trace: Path, events: list[EventRow]) -> None:
    """``insert_events`` with libpq's trace of what the connection sent in ``trace``."""
    pgconn = dbapi(conn).pgconn
    with trace.open("w") as sink:
        pgconn.trace(sink.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            insert_events(conn, events)
        finally:
            pgconn.untrace()


def _sent(trace: Path) -> list[str]:
    """The kinds of the messages the client sent (Parse, Bind, Execute, Sync …)."""
    lines = trace.read_text().splitlines()
    return [line.split("\t")[2] for line in lines if line.startswith("F\t")]


async def test_a_batch_sends_many_rows_as_one_statement(postgres_db: str, tmp_path: Path) -> None:
    """Many rows (events, outputs) go to the server as one statement each, never as
    psycopg's pipelined ``executemany``: a host stopped (SIGSTOP) between two rows of a
    pipeline leaves the server waiting for the next, and that session is not idle in
    its transaction, so the server never ends it; its locks (its own instance's row
    among them) kept every other host from taking it over for as long as it was stopped.
    A NUL in an array's text is sent as U+FFFD, as in a lone parameter."""
    trace = tmp_path / "libpq.trace"
    bodies = [f'{{"sequence":{n},"kind":"text","text":"t{n}"}}'.encode() for n in (1, 2, 3)]

    def write(conn: Connection) -> list[int]:
        ids = [_child(conn, str(n)) for n in range(3)]
        _insert_traced(
            conn,
            trace,
            [EventRow(ids[0], n, body, None) for n, body in enumerate(bodies, 1)]
            + [
                EventRow(ids[1], 1, bodies[0], "out 1"),
                EventRow(ids[2], 1, bodies[0], "out\x00 2"),
            ],
        )
        return ids

    async with _opened(postgres_db) as store:
        ids = await store.write(write)
    sent = _sent(trace)
    assert sent.count("Execute") == 2, sent  # the events' insert, the outputs' update
    assert sent.count("Sync") == 2, sent
    stored = rows.rows(postgres_db, "SELECT child_id, sequence, body FROM events ORDER BY 1, 2")
    assert [(c, s, bytes(b)) for c, s, b in stored] == [
        (ids[0], 1, bodies[0]),
        (ids[0], 2, bodies[1]),
        (ids[0], 3, bodies[2]),
        (ids[1], 1, bodies[0]),
        (ids[2], 1, bodies[0]),
    ]
    outputs = rows.rows(postgres_db, "SELECT id, output FROM children ORDER BY id")
    assert outputs == [(ids[0], ""), (ids[1], "out 1"), (ids[2], "out\ufffd 2")]


async def test_every_session_of_a_host_is_ended_when_left_in_a_transaction(
    postgres_db: str,
) -> None:
    """Reads, writes and the writes committed without a flush all run on sessions the
    server ends once left in a transaction 5 s (its host stopped, or starved): a stopped
    reader's share locks would otherwise queue a migration's lock, and every other
    host's statements behind it, for as long as the host is stopped."""

    def setting(conn: Connection) -> str:
        return str(conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar())

    async with _opened(postgres_db) as store:
        seen = [
            await store.read(setting),
            await store.read_now(setting),
            await store.write(setting),
            await store.submit(setting, durable=False),
        ]
    assert seen == ["5s"] * 4


def _dead_instance_child(conn: Connection) -> int:
    """Instances 'me' and 'dead' (no heartbeat: dead), and a child of 'dead'; its id."""
    run(conn, "INSERT INTO engine_instances (id, started_at) VALUES ('me', 1), ('dead', 1)")
    return _child(conn, "lost", "dead")


def _beat(conn: Connection) -> maintenance.Takeover:
    return maintenance.heartbeat(conn, time.time(), EngineConfig(), "me", True, lambda: False)


def _taken_by(url: str, instance: str) -> str | None:
    found = rows.rows(url, "SELECT taken_by FROM engine_instances WHERE id = :i", {"i": instance})
    return found[0][0]


async def test_a_heartbeat_commits_when_its_takeover_meets_a_locked_row(postgres_db: str) -> None:
    """A takeover that meets a row another transaction holds past the busy timeout (or
    deadlocks with another host's bulk update) is undone alone and tried at the next
    beat: the heartbeat still commits. It used to fail with it, beat after beat, until
    the live host cut itself off and was taken over."""
    import psycopg

    async with _opened(postgres_db, busy_timeout_ms=300) as store:
        child = await store.write(_dead_instance_child)
        store.claim("me")
        with psycopg.connect(libpq(postgres_db)) as holder:  # a transaction until rollback
            holder.execute("SELECT id FROM children WHERE id = %s FOR UPDATE", (child,))
            first = await store.write(_beat)
            assert first.taken == [] and first.deferred
            beaten = rows.rows(
                postgres_db, "SELECT heartbeat_at FROM engine_instances WHERE id = 'me'"
            )
            assert beaten[0][0] is not None, "the beat committed"
            assert _taken_by(postgres_db, "dead") is None, "the takeover was undone"
            holder.rollback()
        second = await store.write(_beat)
        assert second.taken == ["dead"] and not second.deferred


async def test_a_heartbeats_takeover_waits_the_busy_timeout_before_the_next_beat(
    postgres_db: str,
) -> None:
    """A beat committed on the loop's thread waits for a lock only 20 ms: a takeover
    that meets a held row there goes to the writer, which waits the whole busy timeout
    (5 s), and takes over in the same beat once the row is free (here after 0.5 s),
    instead of leaving it to the next beat."""
    import psycopg

    async with _opened(postgres_db) as store:
        child = await store.write(_dead_instance_child)
        store.claim("me")
        with psycopg.connect(libpq(postgres_db)) as holder:
            holder.execute("SELECT id FROM children WHERE id = %s FOR UPDATE", (child,))
            asyncio.get_running_loop().call_later(0.5, holder.rollback)
            beat = await store.write(_beat)
        assert beat.taken == ["dead"] and not beat.deferred
        assert _taken_by(postgres_db, "dead") == "me"


async def test_many_rows_go_as_array_statements_of_bounded_size(
    postgres_db: str, tmp_path: Path
) -> None:
    """2,500 events of one batch go as three statements (at most 1,000 rows each, as
    bounded in bytes too), and every one is stored."""
    trace = tmp_path / "libpq.trace"
    total = 2500

    def write(conn: Connection) -> None:
        child = _child(conn, "many")
        _insert_traced(conn, trace, [EventRow(child, n, b"{}", None) for n in range(1, total + 1)])

    async with _opened(postgres_db) as store:
        await store.write(write)
    sent = _sent(trace)
    assert sent.count("Execute") == 3, sent.count("Execute")
    stored = rows.rows(postgres_db, "SELECT COUNT(*), MIN(sequence), MAX(sequence) FROM events")
    assert stored == [(total, 1, total)]


async def test_a_beat_that_ends_after_the_store_closed_opens_no_session(postgres_db: str) -> None:
    """An engine's close cancels its heartbeat task, but the beat's keep_lock runs on in
    an executor thread. Once the store is closed it must not connect again: that session
    would hold the instance's lock, and nothing would close it but the garbage collector
    (the CI of 3ebca07 met psycopg's warning for such a connection after a cut)."""
    async with _opened(postgres_db) as store:
        store.claim("me")
        assert _terminate(postgres_db, "delegation-host") == 1  # lost, as in a cut
    with pytest.raises(errors.StoreError, match="child store is closed"):
        await asyncio.get_running_loop().run_in_executor(None, store.keep_lock)
    rows.no_sessions_of(postgres_db, "delegation-host")
