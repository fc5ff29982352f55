"""A bad stored row fails its child, not the host (design §18).

A real engine leaves leased children to resume, a raw connection then spoils one row
(its request, preset or options no longer decode; on SQLite, times stored as text), and
a real host boots over it: that child ends ``done`` with "stored child record is
unreadable" (logged, ``child_unreadable``), every other child resumes and finishes, and
no command, read model or method answers with a traceback. A boot that fails gives the
host lock back: the process ends, and the next host opens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from delegation import ChildContext, Engine, EngineConfig, Event, errors
from delegation.clock import ManualClock
from tests.harness import browser, rows
from tests.harness.page import get
from tests.harness.pg_cli import cli
from tests.harness.refusing import Refusing
from tests.harness.serving import host
from tests.harness.support import (
    ScriptRunner,
    finish_after_admit,
    hold,
    open_harness,
    wait_terminal,
)
from tests.harness.terminal import in_process

ROOT = Path(__file__).resolve().parents[2]
UNREADABLE = "stored child record is unreadable"
LEASE = "lease-1"

# What a spoiled row holds instead of what its start stored.
SPOILED = {
    "garbage-request": ("request", b"\xff\x00 not json"),
    "request-of-another-shape": ("request", b'{"requestId": 5, "profile": [], "message": {}}'),
    "request-not-an-object": ("request", b"[1, 2, 3]"),
    "preset-missing-fields": ("preset", b'{"name": "worker"}'),
    "garbage-options": ("options", b'{"maxTokens": "many"}'),
}


def spoil(url: str, conversation_id: str, column: str, value: Any) -> None:
    """Write ``value`` into one child's ``column`` through a raw connection."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(f"UPDATE children SET {column} = :value WHERE conversation_id = :c"),
                {"value": value, "c": conversation_id},
            )
    finally:
        engine.dispose()


async def leave_two_to_resume(
    url: str, workspace: Path, clock: ManualClock, message: str = "do the task"
) -> tuple[Any, Any]:
    """A host that starts two leased children and closes while they run: both are left
    ``running`` to resume at the next boot."""
    runner = ScriptRunner(script=hold(asyncio.Event()))
    async with Engine(url, runner=runner, clock=clock) as engine:
        h = await open_harness(engine, runner, workspace)
        bad = await h.start("q-bad", lease_id=LEASE, message=message)
        good = await h.start("q-good", lease_id=LEASE, message=message)
    return bad, good


@pytest.mark.parametrize("spoiled", list(SPOILED))
async def test_an_unreadable_child_ends_at_boot_and_the_rest_resume(
    db_url: str,
    workspace: Path,
    clock: ManualClock,
    spoiled: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad, good = await leave_two_to_resume(db_url, workspace, clock)
    spoil(db_url, bad.conversation_id, *SPOILED[spoiled])
    runner = ScriptRunner()
    caplog.set_level(logging.INFO, logger="delegation")
    async with Engine(db_url, runner=runner, clock=clock) as engine:
        failed = await wait_terminal(engine, bad.conversation_id)
        resumed = await wait_terminal(engine, good.conversation_id)
        assert (failed.state, failed.error, failed.output) == ("done", UNREADABLE, "")
        assert (resumed.state, resumed.error, resumed.output) == ("done", "", "done: do the task")
        assert [p.identity.conversation_id for p in runner.prepared] == [good.conversation_id]
        # It was ended, not resumed: no recovery event, and never prepared.
        kinds = [event.kind for event in await engine.events(bad.conversation_id)]
        assert kinds == ["text"]
        logged = [r for r in caplog.records if getattr(r, "action", "") == "child_unreadable"]
        assert [getattr(r, "run_id", None) for r in logged] == [bad.run_id]
        # Every read of it answers as for any child that ended with an error.
        h = await open_harness(engine, runner, workspace)
        read = await h.read(bad.conversation_id, lease_id=LEASE)
        assert (read.done, read.cancelled, read.error) == (True, False, UNREADABLE)
        listed = {c.conversation_id: c for c in await engine.list_children()}
        assert listed[bad.conversation_id].error == UNREADABLE
        followed = [event async for event in engine.follow(bad.conversation_id)]
        assert [event.kind for event in followed] == ["text"]
        # A follow-up of its conversation is refused, not an internal error.
        prepared = len(runner.prepared)
        with pytest.raises(errors.ChildUnreadable) as refused:
            await h.start("q-followup", resume=bad.conversation_id)
        assert (refused.value.reason, str(refused.value)) == ("child_unreadable", UNREADABLE)
        assert len(runner.prepared) == prepared


async def test_a_host_boots_over_an_unreadable_child_and_gives_the_database_back(
    db_url: str, workspace: Path, clock: ManualClock
) -> None:
    """``delegation serve`` over a database with one unreadable child: it boots, resumes
    the other, logs ``child_unreadable``, exits at the end of its input, and the next
    host opens; the inspection commands show the child (it used to print a traceback and
    hang holding the host lock, so the next host got ``host_conflict``)."""
    bad, good = await leave_two_to_resume(db_url, workspace, clock, "work in 1 step")
    spoil(db_url, bad.conversation_id, *SPOILED["garbage-request"])
    proc = await host("--stdio", "--db", db_url, "--runner", "scripted", "--log-json")
    assert proc.stdin is not None
    try:
        state = "SELECT state, error FROM children WHERE conversation_id = :c"
        for _ in range(6000):
            now = [rows.rows(db_url, state, {"c": c.conversation_id}) for c in (bad, good)]
            if now == [[("done", UNREADABLE)], [("done", "")]]:
                break
            await asyncio.sleep(0.01)
        assert now == [[("done", UNREADABLE)], [("done", "")]]
    finally:
        proc.stdin.close()
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:  # it hung: not left behind the test
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, stderr
    logged = [json.loads(line) for line in stderr.decode().splitlines()]
    assert any(
        record.get("action") == "child_unreadable" and record.get("run_id") == bad.run_id
        for record in logged
    ), stderr
    assert b"Traceback" not in stderr
    async with Engine(db_url, runner=ScriptRunner()):  # the lock was given back
        pass
    for argv in (["children"], ["show", bad.conversation_id], ["events", bad.conversation_id]):
        done = cli(*argv, "--db", db_url)
        assert (done.returncode, done.stderr) == (0, ""), argv
    assert UNREADABLE in cli("show", bad.conversation_id, "--db", db_url).stdout


_FAILING_HOST = """
import asyncio, sys
from delegation import Engine
from tests.harness.refusing import Refusing

asyncio.run(Engine(sys.argv[1], runner=Refusing()).open())
"""


async def test_a_boot_that_fails_gives_the_host_lock_back(db_url: str) -> None:
    """A host whose boot fails after it took the database ends (it used to hang, holding
    the lock), and the next host opens; in one process, an engine may try again."""
    failing = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _FAILING_HOST, db_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failing.returncode == 1
    assert failing.stderr.rstrip().endswith("RuntimeError: cannot protect the database")
    with pytest.raises(RuntimeError, match="cannot protect"):
        await Engine(db_url, runner=Refusing()).open()
    async with Engine(db_url, runner=ScriptRunner()) as engine:
        assert engine.is_open


async def record_a_step(ctx: ChildContext) -> None:
    await ctx.admit()
    await ctx.step("plan", asyncio.sleep, 0, "a plan")
    ctx.emit(Event(kind="result", text="planned"))


@pytest.mark.sqlite_only
async def test_times_stored_as_text_are_shown_unreadable(
    db_url: str,
    workspace: Path,
    clock: ManualClock,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SQLite keeps text in a REAL column: every command, the page's answers and the
    engine's read models show such a time as unreadable (null in JSON), and a host
    boots over it (``children`` and ``show`` used to print a traceback)."""
    runner = ScriptRunner(script=record_a_step)
    async with Engine(db_url, runner=runner, clock=clock) as engine:
        h = await open_harness(engine, runner, workspace)
        finished = await h.start("q1", lease_id=LEASE)
        await h.wait_done(finished.conversation_id)
        runner.script = hold(asyncio.Event())
        running = await h.start("q2", lease_id=LEASE)
    conversation = finished.conversation_id
    for column in ("created_at", "updated_at", "admitted_at", "finished_at"):
        spoil(db_url, conversation, column, "yesterday")
    spoil(db_url, running.conversation_id, "admitted_at", "noon")
    engine_ = create_engine(db_url)
    try:
        with engine_.begin() as conn:
            conn.execute(text("UPDATE grants SET created_at = 'then', activated_at = 'x'"))
            conn.execute(text("UPDATE steps SET recorded_at = 'now'"))
    finally:
        engine_.dispose()

    run = in_process(capsys, db_url)
    for argv, marked in (
        (["children"], True),  # its age
        (["children", "--wide"], True),
        (["show", conversation], True),
        (["events", conversation], False),
        (["steps", conversation], True),
        (["leases"], False),  # no time but the expiry, which is a number
        (["leases", "--wide"], True),
    ):
        code, out, err = run(*argv)
        assert (code, err) == (0, ""), argv
        assert ("unreadable" in out) == marked, (argv, out)
    code, out, _ = run("children", "--json")
    document = {c["conversationId"]: c for c in json.loads(out)}[conversation]
    assert (document["createdAt"], document["finishedAt"]) == (None, None)
    code, out, _ = run("show", conversation, "--json")
    assert json.loads(out)["recentSteps"][0]["recordedAt"] is None
    code, out, _ = run("leases", "--json")
    assert json.loads(out)[0]["createdAt"] is None

    with browser.web(db_url) as page:
        for path in ("api/children", "api/leases", f"api/children/{conversation}/steps"):
            status, _, body = await asyncio.to_thread(get, page.link(path))
            assert status == 200, (path, body)
        listed = json.loads(get(page.link("api/children"))[2])
        shown = {c["conversationId"]: c for c in listed["children"]}[conversation]
        assert shown["createdAt"] is None

    runner = ScriptRunner(script=finish_after_admit)
    config = EngineConfig(max_run_s=3600)  # its deadline counts from an unreadable time
    async with Engine(db_url, runner=runner, clock=clock, config=config) as engine:
        resumed = await wait_terminal(engine, running.conversation_id)
        assert (resumed.state, resumed.error) == ("done", "")
        record = await engine.get_child(conversation)
        assert record is not None and math.isnan(record.created_at)
