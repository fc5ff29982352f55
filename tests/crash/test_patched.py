"""Patches (design §34): ``ctx.patched(name)`` is True at an execution's live frontier and
False for one that went past the patch on older code, recorded once as a step of a
reserved kind, stable across a second kill; removing the call later breaks nothing.
Each recorded step keeps the runner version that recorded it and the newest attempt
that asked for it.

The kill tests run hosts of two versions (tests/harness/patch_host.py) and SIGKILL them, as
tests/crash/test_step_crash.py does; the rest runs in this process.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from delegation import ChildContext, EngineConfig, Event
from delegation.clock import ManualClock
from delegation.store.steps import PATCH_PREFIX
from tests.harness import rows
from tests.harness import step_hosts as crash
from tests.harness.restarts import LEASE, restarted, until_event
from tests.harness.step_hosts import Host
from tests.harness.support import Harness, ScriptRunner

HOST = Path(__file__).resolve().parents[1] / "harness" / "patch_host.py"
hosts = crash.hosts  # the fixture: every host started is stopped after the test


class PatchHost(Host):
    script = HOST


def launch(started: list[Host], *args: str) -> PatchHost:
    host = PatchHost(*args)
    started.append(host)
    host.wait(lambda lines: "READY" in lines, 60, "READY")
    return host


def steps_of(url: str, conversation: str | None = None) -> list[tuple[str, str | None, int]]:
    """(name, version, asked attempt) of each step of the child, oldest first."""
    where = "" if conversation is None else " WHERE c.conversation_id = :conv"
    sql = (
        "SELECT s.name, s.version, s.asked_attempt FROM steps s"
        f" JOIN children c ON c.id = s.child_id{where} ORDER BY s.ordinal"
    )
    return [(n, v, a) for n, v, a in rows.rows(url, sql, {"conv": conversation})]


def done(url: str, conversation: str) -> str:
    """The child's state once it ended (DONE is printed just before its end commits)."""
    until = time.monotonic() + 30
    while True:
        state = rows.scalar(
            url, "SELECT state FROM children WHERE conversation_id = :c", {"c": conversation}
        )
        if state in ("done", "cancelled") or time.monotonic() > until:
            return str(state)
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_patched_is_false_for_an_execution_that_went_past_it_and_stays_so(
    db_url: str, hosts: list[Host]
) -> None:
    old = launch(hosts, db_url, "old", "v1", "--start", "q-1", "--stop")
    old.wait(lambda lines: "AT stop" in lines, 60, "AT stop")
    (conversation,) = [line.split()[1] for line in old.saw("STARTED")]
    old.kill()
    # New code asks patched("p") before a: the execution recorded a and b on old code.
    second = launch(hosts, db_url, "new", "v2", "--stop")
    second.wait(lambda lines: "AT stop" in lines, 60, "AT stop")
    assert second.saw("PATCHED") == ["PATCHED p False"]
    second.kill()
    # Killed again and resumed: the recorded value, never recomputed (now at the frontier).
    third = launch(hosts, db_url, "new", "v2")
    third.wait(lambda lines: bool(third.saw("DONE")), 60, "DONE")
    assert third.saw("PATCHED") == ["PATCHED p False"]
    assert done(db_url, conversation) == "done"
    marker = PATCH_PREFIX + "p"
    # Each step keeps the version that recorded it and the newest attempt that asked.
    assert steps_of(db_url, conversation) == [
        ("a", "v1", 2),
        ("b", "v1", 2),
        (marker, "v2", 2),
        ("c", "v2", 2),
    ]
    value = rows.scalar(db_url, "SELECT value FROM steps WHERE name = :n", {"n": marker})
    assert json.loads(bytes(value)) is False


@pytest.mark.timeout(240)
def test_removing_a_patched_call_later_breaks_nothing(db_url: str, hosts: list[Host]) -> None:
    first = launch(hosts, db_url, "new", "v2", "--start", "q-1", "--stop")
    first.wait(lambda lines: "AT stop" in lines, 60, "AT stop")
    assert first.saw("PATCHED") == ["PATCHED p True"]  # a fresh child: at its frontier
    (conversation,) = [line.split()[1] for line in first.saw("STARTED")]
    first.kill()
    # The call is gone: the marker is asked by nothing, replays nothing, and does not
    # keep a later patch from the frontier.
    later = launch(hosts, db_url, "removed", "v3")
    later.wait(lambda lines: bool(later.saw("DONE")), 60, "DONE")
    assert later.saw("PATCHED") == ["PATCHED q True"]
    assert done(db_url, conversation) == "done"
    names = [(name, version) for name, version, _ in steps_of(db_url, conversation)]
    marker = PATCH_PREFIX
    assert names == [(marker + "p", "v2"), ("a", "v2"), ("b", "v2"), (marker + "q", "v3"),
                     ("c", "v3")]  # fmt: skip


# --- in this process -----------------------------------------------------------------


async def test_patched_is_true_at_the_frontier_of_a_first_run_and_recorded_once(
    harness: Harness, db_url: str
) -> None:
    seen: list[bool] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        seen.append(await ctx.patched("p"))
        await ctx.step("a", lambda: 1)
        seen.append(await ctx.patched("p"))  # recorded: the same value
        seen.append(await ctx.patched("later"))  # a first run is always at its frontier
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    await harness.wait_done(started.conversation_id)
    assert seen == [True, True, True]
    names = [name for name, _, _ in steps_of(db_url, started.conversation_id)]
    assert names == [PATCH_PREFIX + "p", "a", PATCH_PREFIX + "later"]


async def test_a_patch_marker_never_collides_with_a_step_of_the_same_name(
    harness: Harness, db_url: str
) -> None:
    errors: list[str] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        assert await ctx.step("p", lambda: "the user's p") == "the user's p"
        assert await ctx.patched("p") is True  # its own record, not the step's value
        for bad in (PATCH_PREFIX + "p", "\x1fanything"):
            try:
                await ctx.step(bad, lambda: 1)
            except ValueError as exc:
                errors.append(str(exc))
        for name in ("", "n" * 1025):
            try:
                await ctx.patched(name)
            except ValueError as exc:
                errors.append(str(exc))
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    record = await harness.wait_done(started.conversation_id)
    assert (record.state, record.error) == ("done", "")
    assert len(errors) == 4 and "reserved for patches" in errors[0]
    names = [name for name, _, _ in steps_of(db_url, started.conversation_id)]
    assert names == ["p", PATCH_PREFIX + "p"]


async def test_replayed_steps_are_marked_asked_in_one_write_with_the_next_record(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    finished = asyncio.Event()
    values: list[bool] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        if ctx.recovery is not None:
            values.append(await ctx.patched("p"))  # before a: a and b lie ahead
        for name in ("a", "b"):
            ctx.emit(Event(kind="text", text=name))
            await ctx.step(name, lambda name=name: name)
        if ctx.recovery is None:
            await asyncio.Event().wait()  # the host closes here
        values.append(await ctx.patched("q"))  # after b: at the frontier
        await ctx.step("c", lambda: "c")
        finished.set()
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start(lease_id=LEASE)
    await until_event(harness.engine, started.conversation_id, "b")
    await asyncio.sleep(0.2)  # b commits just after its event
    await harness.engine.close()
    assert [a for _, _, a in steps_of(db_url, started.conversation_id)] == [0, 0]
    fresh = ScriptRunner(script=run)
    async with restarted(harness, db_url, fresh, config, clock) as h:
        await asyncio.wait_for(finished.wait(), 10)
        await h.wait_done(started.conversation_id)
    assert values == [False, True]
    marks = steps_of(db_url, started.conversation_id)
    assert [(name, attempt) for name, _, attempt in marks] == [
        ("a", 0 + 1),
        ("b", 1),
        (PATCH_PREFIX + "p", 1),
        (PATCH_PREFIX + "q", 1),
        ("c", 1),
    ]
