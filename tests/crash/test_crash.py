"""Durability, proven by killing a real host process and reopening its database.

Each test runs ``tests/harness/crash_host.py`` as a separate process that starts a leased child
and dies with ``os._exit`` at a named fault point. The test then opens a new engine on
the same file (a restart) and checks every invariant, that a replay of the requestId
answers the same child, that tombstones still fence, and that a resumed child finishes
with the right output.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from delegation import ChildContext, Engine, EngineConfig, Event, Params, Preset, Request, errors
from tests.harness.crash_host import CRASH, LEASE, REQUEST
from tests.harness.rows import is_sqlite, rows
from tests.harness.support import wait_terminal

HOST = Path(__file__).resolve().parents[1] / "harness" / "crash_host.py"
ROOT = HOST.parents[2]


def crash(db_url: str, workspace: Path, fault: str) -> list[str]:
    """Run the host until it dies at ``fault``; return what it printed."""
    proc = subprocess.run(
        [sys.executable, str(HOST), db_url, str(workspace), fault],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == CRASH, proc.stderr
    return proc.stdout.splitlines()


class ResumingRunner:
    """The restarted host's runner: it resumes a child and counts on from its events."""

    def __init__(self) -> None:
        self.recoveries: list[Any] = []

    async def prepare(self, request: Request, preset: Preset, identity: Any, recovery: Any) -> Any:
        self.recoveries.append(recovery)

        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            ctx.emit(Event(kind="text", text="carrying on"))
            ctx.emit(Event(kind="result", text=f"counted after attempt {recovery.attempt}"))

        return run


@pytest.fixture
async def reopen(db_url: str) -> AsyncIterator[Any]:
    engines: list[Engine] = []

    async def open_engine(runner: Any, **config: Any) -> Engine:
        engine = Engine(db_url, runner=runner, config=EngineConfig(**config))
        await engine.open()
        engines.append(engine)
        return engine

    yield open_engine
    for engine in engines:
        await engine.close()


def check_invariants(db_url: str) -> None:
    """Nothing impossible: valid states, gap-free events, nothing running on a dead host."""
    states = {s for (s,) in rows(db_url, "SELECT state FROM children")}
    assert states <= {"prepared", "admitted", "running", "done", "cancelled"}
    for child_id, count, top in rows(
        db_url, "SELECT child_id, COUNT(*), MAX(sequence) FROM events GROUP BY child_id"
    ):
        assert count == top, f"events of child {child_id} have a gap"
    dead_running = rows(
        db_url,
        "SELECT c.id FROM children c JOIN engine_instances h ON h.id = c.engine_instance_id"
        " WHERE c.state = 'running' AND h.closed_at IS NOT NULL",
    )
    assert dead_running == []
    if is_sqlite(db_url):  # SQLite's own checks of the file the killed host wrote
        assert rows(db_url, "PRAGMA integrity_check") == [("ok",)]
        assert rows(db_url, "PRAGMA foreign_key_check") == []


async def replay(engine: Engine) -> Any:
    conn = await engine.connect("runner-1", "host-a")
    params = Params(
        run_id="parent-run", extension_id="ext", generation=7, lease_id=LEASE, request=REQUEST
    )
    return await engine.call(conn, "child.start", params)


@pytest.mark.parametrize("fault", ["after_prepared_commit", "inside_prepare"])
async def test_crash_before_admission_ends_the_child_for_good(
    fault: str, db_url: str, workspace: Path, reopen: Any
) -> None:
    crash(db_url, workspace, fault)
    assert rows(db_url, "SELECT state FROM children") == [("prepared",)]
    runner = ResumingRunner()
    engine = await reopen(runner)
    check_invariants(db_url)
    (child,) = await engine.list_children()
    assert (child.state, child.error) == ("done", "child admission interrupted by host restart")
    with pytest.raises(errors.AdmissionFailed) as info:
        await replay(engine)
    assert str(info.value) == "child admission failed: child admission interrupted by host restart"
    assert runner.recoveries == [], "a never-admitted child is not resumed"
    assert rows(db_url, "SELECT COUNT(*) FROM children") == [(1,)], "the replay ran nothing"


async def test_crash_after_admission_commit_resumes_the_child(
    db_url: str, workspace: Path, reopen: Any
) -> None:
    crash(db_url, workspace, "after_admission_commit")
    assert rows(db_url, "SELECT state FROM children") == [("running",)]
    runner = ResumingRunner()
    engine = await reopen(runner)
    again = await replay(engine)
    (child,) = await engine.list_children()
    assert again.conversation_id == child.conversation_id
    assert again.run_id == child.run_id
    done = await wait_terminal(engine, child.conversation_id)
    assert (done.state, done.error, done.output) == ("done", "", "counted after attempt 1")
    events = await engine.events(child.conversation_id)
    assert [(e.sequence, e.kind) for e in events] == [(1, "recovery"), (2, "text"), (3, "result")]
    assert [(r.attempt, r.last_sequence) for r in runner.recoveries] == [(1, 1)]
    check_invariants(db_url)


async def test_crash_mid_stream_keeps_every_flushed_event(
    db_url: str, workspace: Path, reopen: Any
) -> None:
    printed = crash(db_url, workspace, "mid_stream")
    assert "FLUSHED 5" in printed
    runner = ResumingRunner()
    engine = await reopen(runner)
    (child,) = await engine.list_children()
    assert (await replay(engine)).run_id == child.run_id
    done = await wait_terminal(engine, child.conversation_id)
    events = await engine.events(child.conversation_id)
    texts = [e.text for e in events]
    assert texts[:5] == [f"step {n}" for n in range(1, 6)], "a flushed event was lost"
    recovery = next(e for e in events if e.kind == "recovery")
    assert recovery.sequence in (6, 7)  # 7 if the unflushed event happened to commit
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert runner.recoveries[0].last_sequence == recovery.sequence
    assert done.output == "counted after attempt 1"
    check_invariants(db_url)


async def test_crash_during_release_drain_keeps_the_tombstone(
    db_url: str, workspace: Path, reopen: Any
) -> None:
    crash(db_url, workspace, "during_release_drain")
    assert rows(db_url, "SELECT revoked_at IS NOT NULL FROM grants WHERE kind = 'lease'") == [(1,)]
    runner = ResumingRunner()
    engine = await reopen(runner)
    (child,) = await engine.list_children()
    assert (child.state, child.error) == ("cancelled", "cancelled: lease released")
    assert runner.recoveries == []
    with pytest.raises(errors.NotOwned):
        await replay(engine)  # the tombstone still fences the lease
    conn = await engine.connect("runner-1", "host-a")
    release = Params(run_id="parent-run", extension_id="ext", generation=7, lease_id=LEASE)
    confirmed = await engine.call(conn, "child.lease.release", release)
    assert confirmed.done
    check_invariants(db_url)


async def test_lease_that_expires_while_the_host_is_down_is_not_resumed(
    db_url: str, workspace: Path, reopen: Any
) -> None:
    crash(db_url, workspace, "lease_expires_while_down")
    (expires_at,) = rows(db_url, "SELECT expires_at FROM grants WHERE kind = 'lease'")[0]
    time.sleep(max(0.0, expires_at - time.time()) + 0.05)
    runner = ResumingRunner()
    engine = await reopen(runner)
    (child,) = await engine.list_children()
    assert (child.state, child.error) == ("cancelled", "cancelled: lease expired")
    assert runner.recoveries == []
    assert await engine.leases() == [], "an expired lease is removed"
    check_invariants(db_url)


async def test_two_crashes_resume_twice_then_give_up(
    db_url: str, workspace: Path, reopen: Any
) -> None:
    crash(db_url, workspace, "after_admission_commit")

    class Stuck:
        async def prepare(self, *args: Any) -> Any:
            async def run(ctx: ChildContext) -> None:
                await asyncio.sleep(3600)

            return run

    for attempt in (1, 2):
        engine = await reopen(Stuck(), max_recovery_attempts=2)
        for _ in range(500):
            (child,) = await engine.list_children()
            if child.state == "running":
                break
            await asyncio.sleep(0.01)
        assert (child.state, child.recovery_attempts) == ("running", attempt)
        await engine.close()
    engine = await reopen(ResumingRunner(), max_recovery_attempts=2)
    (child,) = await engine.list_children()
    assert (child.state, child.error) == ("done", "child interrupted by host restart")
    check_invariants(db_url)
