"""A start under a tool call an earlier start found open (design §5, §12).

On PostgreSQL such a start reads nothing first: it is checked against the runner and
the tool grant as the earlier start read them, and reserved by one statement that
inserts only if neither row has changed since (``reservation.reserve_start``). These tests
change what a start depends on between two starts under one tool call, from this host
and from outside it, and expect the answer a start that read everything would give.
The same tests run on SQLite, where every start reads first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text

from delegation import Engine, EngineConfig, errors
from delegation.records import GrantRecord, RunnerRecord
from delegation.store import grants, stores
from delegation.store.postgres.spelling import _SPELLINGS
from delegation.store.sql import run
from delegation.usecases.reservation import SeenTools
from tests.harness import rows
from tests.harness.support import PRESET, Harness, ScriptRunner, hold, open_harness

Change = Callable[[Harness], Awaitable[Any]]


async def close_tool(h: Harness) -> None:
    await h.engine.close_tool(h.tool)


async def reconnect_runner(h: Harness) -> None:
    await h.engine.connect(h.conn.runner_id, "host-b")  # h.conn is no longer current


async def disconnect_runner(h: Harness) -> None:
    await h.engine.disconnect(h.conn)


@contextlib.asynccontextmanager
async def seen(
    url: str, workspace: Path, config: EngineConfig | None = None
) -> AsyncIterator[Harness]:
    """An engine whose runner started ``q1`` then ``q2`` under one tool call: on
    PostgreSQL the second from the rows as the first read them."""
    runner = ScriptRunner()
    async with Engine(url, runner=runner, config=config or EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        await h.start("q1")
        await h.start("q2")
        yield h


def started(url: str) -> list[str]:
    return [row[0] for row in rows.rows(url, "SELECT request_id FROM children ORDER BY id")]


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (close_tool, errors.NotOwned),
        (reconnect_runner, errors.StaleConnection),
        (disconnect_runner, errors.RunnerNotFound),
    ],
)
async def test_a_start_after_its_tool_call_or_runner_changed_is_refused(
    db_url: str, workspace: Path, change: Change, refusal: type[Exception]
) -> None:
    async with seen(db_url, workspace) as h:
        await change(h)
        with pytest.raises(refusal):
            await h.start("q3")
        assert started(db_url) == ["q1", "q2"]


async def test_the_cap_and_a_retried_request_hold_for_starts_that_read_nothing_first(
    db_url: str, workspace: Path
) -> None:
    async with seen(db_url, workspace, EngineConfig(max_children_per_grant=3)) as h:
        again = await h.start("q1")  # a retry: the same child, nothing new
        (first,) = rows.rows(db_url, "SELECT conversation_id FROM children WHERE request_id = 'q1'")
        assert again.conversation_id == first[0]
        await h.start("q3")
        with pytest.raises(errors.SubmissionLimit):
            await h.start("q4")
        assert started(db_url) == ["q1", "q2", "q3"]


def _write(url: str, sql: str) -> None:
    """A write from outside this host (another host, an operator)."""
    outside = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with outside.connect() as conn:
            assert conn.execute(text(sql)).rowcount >= 1
    finally:
        outside.dispose()


@pytest.mark.parametrize(
    ("sql", "refusal"),
    [
        # Another host ended the tool call: this host never heard of it.
        ("UPDATE grants SET closed_at = 1 WHERE kind = 'tool'", errors.NotOwned),
        # Another host took the runner's connection.
        ("UPDATE runners SET connection_id = 'elsewhere'", errors.StaleConnection),
        # A write that changes nothing a start checks: the start reads again, and goes on.
        ("UPDATE grants SET depth = depth WHERE kind = 'tool'", None),
        ("UPDATE runners SET generation = generation", None),
    ],
)
async def test_a_change_made_by_another_host_between_two_starts_is_seen_by_the_second(
    postgres_db: str, workspace: Path, sql: str, refusal: type[Exception] | None
) -> None:
    async with seen(postgres_db, workspace) as h:
        _write(postgres_db, sql)
        if refusal is not None:
            with pytest.raises(refusal):
                await h.start("q3")
            assert started(postgres_db) == ["q1", "q2"]
        else:
            await h.start("q3")  # read again, then seen again
            await h.start("q4")
            assert started(postgres_db) == ["q1", "q2", "q3", "q4"]


async def test_a_child_inserted_by_another_host_counts_toward_the_cap(
    postgres_db: str, workspace: Path
) -> None:
    async with seen(postgres_db, workspace, EngineConfig(max_children_per_grant=3)) as h:
        copy = (
            "INSERT INTO children (conversation_id, run_id, grant_id, lease_id, request_id,"
            " runner_id, runner_host_instance_id, parent_conversation_id, parent_run_id,"
            " extension_id, profile, generation, request, preset, cwd, depth, followup, state,"
            " error, output, recovery_attempts, created_at, updated_at, finished_at)"
            " SELECT 'c-other', 'r-other', grant_id, lease_id, 'elsewhere', runner_id,"
            " runner_host_instance_id, parent_conversation_id, parent_run_id, extension_id,"
            " profile, generation, request, preset, cwd, depth, followup, 'done', '', '', 0,"
            " created_at, updated_at, created_at FROM children WHERE request_id = 'q1'"
        )
        _write(postgres_db, copy)
        with pytest.raises(errors.SubmissionLimit):
            await h.start("q3")


async def test_the_second_start_under_a_tool_call_reads_nothing_first(
    postgres_db: str, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL the rows as seen are used (the tests above would pass if they
    never were): every start after the first is one guarded INSERT that inserted."""
    inserted: list[bool] = []
    insert_as_seen = grants.insert_child_as_seen

    def counted(*args: Any, **values: Any) -> Any:
        child = insert_as_seen(*args, **values)
        inserted.append(child is not None)
        return child

    monkeypatch.setattr(grants, "insert_child_as_seen", counted)
    async with seen(postgres_db, workspace) as h:
        await h.start("q3")
    assert inserted == [True, True]  # q2 and q3; q1 read first


async def test_rows_as_seen_that_refuse_give_way_to_rows_as_they_are(
    db_url: str, workspace: Path
) -> None:
    """The runner reconnected and opened the same tool call again: the rows as seen
    (the old connection, the old grant) refuse; the rows as they are accept."""
    async with seen(db_url, workspace) as h:
        conn = await h.engine.connect(h.conn.runner_id, "host-b")
        tool = h.tool
        await h.engine.open_tool(
            conn,
            run_id=tool.run_id,
            conversation_id=tool.conversation_id,
            tool_call_id=tool.tool_call_id,
            extension_id=tool.extension_id,
            presets=[PRESET],
            workspace=h.workspace,
        )
        params = h.start_params("q3")
        await h.engine.call(conn, "child.start", params)
        assert started(db_url) == ["q1", "q2", "q3"]


async def test_two_versions_of_a_row_one_transaction_wrote_are_told_apart(
    postgres_db: str, workspace: Path
) -> None:
    """A batch of jobs is one transaction: a start may see a row that a later job of
    the same batch changes again (the same transaction id, xmin, on both versions)."""
    async with seen(postgres_db, workspace) as h:
        outside = create_engine(postgres_db)
        try:
            with outside.connect() as conn:
                conn.execute(text("UPDATE grants SET depth = depth WHERE kind = 'tool'"))
                reads = grants.runner_tool_and_request(
                    conn, h.conn.runner_id, h.tool.run_id, h.tool.tool_call_id, "q3"
                )
                conn.execute(text("UPDATE grants SET closed_at = 1 WHERE kind = 'tool'"))
                conn.commit()
                assert reads.seen is not None
                (row,) = conn.execute(
                    text(f"SELECT {_COPIED} FROM children WHERE request_id = 'q1'")
                )
                values = dict(zip(_COPIED.split(", "), row, strict=True))
                values.update(conversation_id="c-new", run_id="r-new", request_id="q3")
                assert grants.insert_child_as_seen(conn, reads.seen, 64, **values) is None
                conn.commit()
        finally:
            outside.dispose()
        assert started(postgres_db) == ["q1", "q2"]


_COPIED = (
    "conversation_id, run_id, grant_id, request_id, runner_id, runner_host_instance_id,"
    " parent_conversation_id, parent_run_id, extension_id, profile, generation, request,"
    " preset, cwd, depth, engine_instance_id, created_at"
)


# --- the plans of prepared statements --------------------------------------------------

# Tables that grow with use: a statement of a hot path must never scan one whole.
_GROWING = ("children", "events", "steers", "purged", "controls", "grants", "connections")


async def test_no_statement_of_a_hot_path_plans_a_scan_of_a_growing_table(
    postgres_db: str, workspace: Path
) -> None:
    """On a new database a prepared statement's generic plan is made while its tables
    hold a few rows, where reading a whole table is the cheapest plan; PostgreSQL
    keeps it while the table grows. Every plain statement the engine's calls to
    start, read and run is planned here as it would be then, with a few children."""
    runner = ScriptRunner()
    _SPELLINGS.clear()  # a memo of spellings: from now on, what this test's calls run
    async with Engine(postgres_db, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        for i in range(5):
            child = await h.start(f"q{i}")
            await h.wait_done(child.conversation_id)
            await h.read(child.conversation_id)
        runner.script = hold(asyncio.Event())
        for i in range(5):
            child = await h.start(f"held{i}")
            await h.engine.call(h.conn, "child.cancel", h.params(child_id=child.conversation_id))
    assert len(_SPELLINGS) >= 5
    scans: list[str] = []
    with psycopg.connect(stores.libpq(stores.normalize(postgres_db)), autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        for index, sql in enumerate(sorted(set(_SPELLINGS.values()))):
            numbered, count = _numbered(sql)
            conn.execute(f"PREPARE s{index} AS {numbered}")
            nulls = ", ".join(["NULL"] * count)
            plan = "\n".join(
                str(row[0])
                for row in conn.execute(
                    f"EXPLAIN EXECUTE s{index}" + (f"({nulls})" if count else "")
                )
            )
            scanned = set(re.findall(r"Seq Scan on (\w+)", plan)) & set(_GROWING)
            if scanned:
                scans.append(f"{sorted(scanned)}: {sql[:160]}")
    assert not scans, "\n".join(scans)


def _numbered(sql: str) -> tuple[str, int]:
    """``sql`` with psycopg's ``%s`` markers as ``$1``, ``$2``…, and how many."""
    count = 0

    def number(_: re.Match[str]) -> str:
        nonlocal count
        count += 1
        return f"${count}"

    return re.sub("%s", number, sql), count


# --- what a host keeps of the rows it saw ----------------------------------------------


def _seen_tool(runner_id: str) -> grants.SeenTool:
    runner = RunnerRecord(runner_id, "host-a", 1, "conn-1")
    tool = dataclasses.replace(TOOL, runner_id=runner_id)
    return grants.SeenTool(runner, tool, ("10", "11"))


TOOL = GrantRecord(
    id="g1",
    kind="tool",
    runner_id="r",
    connection_id="conn-1",
    run_id="run",
    conversation_id="conv",
    tool_call_id="call",
    extension_id="ext",
    lease_id=None,
    origin_grant_id=None,
    workspace="/",
    presets=(),
    generations=frozenset({1}),
    depth=1,
    created_at=0.0,
    expires_at=None,
    closed_at=None,
    activated_at=None,
    revoked_at=None,
    revoke_reason=None,
)


def test_the_rows_a_host_saw_are_kept_for_so_many_calls_and_so_long() -> None:
    kept = SeenTools(size=2)
    for runner_id in ("a", "b", "c"):
        kept.put((runner_id, "run", "call"), _seen_tool(runner_id))
    assert kept.get(("a", "run", "call")) is None  # the oldest went first
    assert kept.get(("c", "run", "call")) == _seen_tool("c")
    kept.drop(("c", "run", "call"))
    assert kept.get(("c", "run", "call")) is None
    brief = SeenTools(max_age_s=0.0)
    brief.put(("a", "run", "call"), _seen_tool("a"))
    time.sleep(0.001)
    assert brief.get(("a", "run", "call")) is None  # older than its age: read again


def test_an_operators_query_is_planned_anew_each_time_a_hot_one_once(postgres_db: str) -> None:
    """psycopg prepares a statement the fifth time a connection runs it; a listing
    (``planned_each_time``) never is, so PostgreSQL never keeps a plan made for a small
    table for it."""
    engine = create_engine(postgres_db)
    listing = "SELECT id FROM children WHERE state = ? ORDER BY id DESC LIMIT ?"
    hot = "SELECT id FROM children WHERE id = ?"
    try:
        with engine.connect() as conn:
            for _ in range(8):
                run(conn, listing, ("done", 10), planned_each_time=True).fetchall()
                run(conn, hot, (1,)).fetchall()
            kept = [
                row[0]
                for row in run(conn, "SELECT statement FROM pg_prepared_statements").fetchall()
            ]
    finally:
        engine.dispose()
    assert any("WHERE id = " in sql for sql in kept), kept
    assert not any("ORDER BY id DESC" in sql for sql in kept), kept
