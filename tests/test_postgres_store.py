"""What only the PostgreSQL store has: a server that can drop a connection, NOTIFY."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from psycopg import pq
from sqlalchemy import Connection, create_engine, text

from delegation import Engine, EngineConfig, errors, maintenance
from delegation.store import dbapi, run, stores
from delegation.store.events import EventRow, insert_events
from delegation.store.postgres.connect import libpq
from tests import rows
from tests.support import ScriptRunner, open_harness


def _terminate(url: str, application: str) -> int:
    """End the server's backends of ``application`` on this database, as a server
    restart or an administrator would."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            sql = (
                "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = :name"
            )
            return int(conn.execute(text(sql), {"name": application}).scalar_one())
    finally:
        admin.dispose()


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


async def test_a_batch_sends_many_rows_as_one_statement(postgres_db: str, tmp_path: Path) -> None:
    """Many rows (events, outputs) go to the server as one statement each, never as
    psycopg's pipelined ``executemany``: a host stopped (SIGSTOP) between two rows of a
    pipeline leaves the server waiting for the next, and that session is not idle in
    its transaction, so the server never ends it; its locks (its own instance's row
    among them) kept every other host from taking it over for as long as it was stopped.
    A NUL in an array's text is sent as U+FFFD, as in a lone parameter."""
    store = stores.open_store(postgres_db, synchronous="FULL", busy_timeout_ms=5000)
    store.open(asyncio.get_running_loop())
    trace = tmp_path / "libpq.trace"
    bodies = [f'{{"sequence":{n},"kind":"text","text":"t{n}"}}'.encode() for n in (1, 2, 3)]

    def write(conn: Connection) -> list[int]:
        run(
            conn,
            "INSERT INTO grants (id, kind, runner_id, extension_id, lease_id, run_id, presets,"
            " created_at, expires_at) VALUES ('g', 'lease', 'rn', 'e', 'L', 'pr', ?, 1, 9)",
            (b"",),
        )
        ids = []
        for n in range(3):
            run(
                conn,
                "INSERT INTO children (conversation_id, run_id, request_id, runner_id,"
                " runner_host_instance_id, parent_conversation_id, parent_run_id, extension_id,"
                " profile, generation, request, preset, cwd, depth, state, created_at,"
                " updated_at, grant_id) VALUES (?, ?, ?, 'rn', 'h', 'pc', 'pr', 'e', 'p', 1,"
                " ?, ?, '/', 1, 'prepared', 1, 1, 'g')",
                (f"c{n}", f"r{n}", f"q{n}", b"", b""),
            )
            ids.append(
                run(conn, "SELECT id FROM children WHERE run_id = ?", (f"r{n}",)).fetchone()[0]
            )
        pgconn = dbapi(conn).pgconn
        with trace.open("w") as sink:
            pgconn.trace(sink.fileno())
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            try:
                insert_events(
                    conn,
                    [EventRow(ids[0], n, body, None) for n, body in enumerate(bodies, 1)]
                    + [
                        EventRow(ids[1], 1, bodies[0], "out 1"),
                        EventRow(ids[2], 1, bodies[0], "out\x00 2"),
                    ],
                )
            finally:
                pgconn.untrace()
        return ids

    try:
        ids = await store.write(write)
    finally:
        await store.aclose()
    sent = [
        line.split("\t")[2] for line in trace.read_text().splitlines() if line.startswith("F\t")
    ]
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
    store = stores.open_store(postgres_db, synchronous="FULL", busy_timeout_ms=5000)
    store.open(asyncio.get_running_loop())

    def setting(conn: Connection) -> str:
        return str(conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar())

    try:
        seen = [
            await store.read(setting),
            await store.read_now(setting),
            await store.write(setting),
            await store.submit(setting, durable=False),
        ]
    finally:
        await store.aclose()
    assert seen == ["5s"] * 4


def _dead_instance_child(conn: Connection) -> int:
    """Instances 'me' and 'dead' (no heartbeat: dead), and a child of 'dead'; its id."""
    run(conn, "INSERT INTO engine_instances (id, started_at) VALUES ('me', 1), ('dead', 1)")
    cursor = run(
        conn,
        "INSERT INTO children (conversation_id, run_id, request_id, runner_id,"
        " runner_host_instance_id, parent_conversation_id, parent_run_id, extension_id,"
        " profile, generation, request, preset, cwd, depth, state, created_at, updated_at,"
        " engine_instance_id) VALUES ('c', 'r', 'q', 'rn', 'h', 'pc', 'pr', 'e', 'p', 1,"
        " ?, ?, '/', 1, 'prepared', 1, 1, 'dead') RETURNING id",
        (b"", b""),
    )
    return int(cursor.fetchone()[0])


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

    store = stores.open_store(postgres_db, synchronous="FULL", busy_timeout_ms=300)
    store.open(asyncio.get_running_loop())
    try:
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
    finally:
        await store.aclose()


async def test_a_heartbeats_takeover_waits_the_busy_timeout_before_the_next_beat(
    postgres_db: str,
) -> None:
    """A beat committed on the loop's thread waits for a lock only 20 ms: a takeover
    that meets a held row there goes to the writer, which waits the whole busy timeout
    (5 s), and takes over in the same beat once the row is free (here after 0.5 s),
    instead of leaving it to the next beat."""
    import psycopg

    store = stores.open_store(postgres_db, synchronous="FULL", busy_timeout_ms=5000)
    store.open(asyncio.get_running_loop())
    try:
        child = await store.write(_dead_instance_child)
        store.claim("me")
        with psycopg.connect(libpq(postgres_db)) as holder:
            holder.execute("SELECT id FROM children WHERE id = %s FOR UPDATE", (child,))
            asyncio.get_running_loop().call_later(0.5, holder.rollback)
            beat = await store.write(_beat)
        assert beat.taken == ["dead"] and not beat.deferred
        assert _taken_by(postgres_db, "dead") == "me"
    finally:
        await store.aclose()


async def test_many_rows_go_as_array_statements_of_bounded_size(
    postgres_db: str, tmp_path: Path
) -> None:
    """2,500 events of one batch go as three statements (at most 1,000 rows each, as
    bounded in bytes too), and every one is stored."""
    store = stores.open_store(postgres_db, synchronous="FULL", busy_timeout_ms=5000)
    store.open(asyncio.get_running_loop())
    trace = tmp_path / "libpq.trace"
    total = 2500

    def write(conn: Connection) -> None:
        child = _dead_instance_child(conn)
        pgconn = dbapi(conn).pgconn
        with trace.open("w") as sink:
            pgconn.trace(sink.fileno())
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            try:
                insert_events(conn, [EventRow(child, n, b"{}", None) for n in range(1, total + 1)])
            finally:
                pgconn.untrace()

    try:
        await store.write(write)
    finally:
        await store.aclose()
    sent = [
        line.split("\t")[2] for line in trace.read_text().splitlines() if line.startswith("F\t")
    ]
    assert sent.count("Execute") == 3, sent.count("Execute")
    stored = rows.rows(postgres_db, "SELECT COUNT(*), MIN(sequence), MAX(sequence) FROM events")
    assert stored == [(total, 1, total)]
