"""The step journal (design §15): ``ctx.step`` runs a function at most once per execution
and name, commits its result after every event emitted before it, and hands the
recorded value back to a resumed execution without running it again.

Restarts here are graceful (a second ``Engine`` on the same database); hosts killed
with SIGKILL between and inside steps are in ``test_step_crash.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from delegation import ChildContext, Engine, EngineConfig, Event, errors
from delegation.clock import ManualClock
from tests.harness import rows as db
from tests.harness.restarts import LEASE, restarted, rows, until_event
from tests.harness.support import Harness, ScriptRunner, open_harness


class Point(msgspec.Struct):
    x: int
    y: int


class Calls:
    """Every call of the steps' functions, by name."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def fn(self, name: str, value: Any) -> Any:
        async def call(*args: Any) -> Any:
            self.calls.append(name)
            return value if not args else [value, *args]

        return call


def texts(db_url: str, child_id: int) -> list[str]:
    """The texts of the child's committed events, read by another connection."""
    sql = "SELECT body FROM events WHERE child_id = :c ORDER BY sequence"
    bodies = [bytes(row[0]) for row in db.rows(db_url, sql, {"c": child_id})]
    return [msgspec.json.decode(body).get("text", "") for body in bodies]


def step_names(db_url: str, child_id: int) -> list[str]:
    sql = "SELECT name FROM steps WHERE child_id = :c ORDER BY ordinal"
    return [row[0] for row in db.rows(db_url, sql, {"c": child_id})]


async def child_id(engine: Engine, conversation_id: str) -> int:
    record = await engine.get_child(conversation_id)
    assert record is not None
    return record.id


# --- one execution ----------------------------------------------------------------------


async def test_a_step_runs_once_and_its_result_is_committed_after_the_events_before_it(
    harness: Harness, db_url: str
) -> None:
    calls = Calls()
    seen: dict[str, Any] = {}
    checked = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="before a"))
        seen["a"] = await ctx.step("a", calls.fn("a", {"n": 1}))
        # Committed before step returned: another connection sees the step and the
        # event emitted before it.
        me = await child_id(harness.engine, ctx.identity.conversation_id)
        seen["rows"] = (step_names(db_url, me), texts(db_url, me))
        seen["again"] = await ctx.step("a", calls.fn("a-again", {"n": 2}))
        seen["args"] = await ctx.step("b", calls.fn("b", "x"), 1, 2)
        checked.set()
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    await asyncio.wait_for(checked.wait(), 5)
    await harness.wait_done(started.conversation_id)
    assert seen["a"] == {"n": 1}
    assert seen["rows"] == (["a"], ["before a"])
    assert seen["again"] == {"n": 1}  # the recorded value; its function not called
    assert seen["args"] == ["x", 1, 2]
    assert calls.calls == ["a", "b"]


async def test_a_raising_step_records_nothing_and_the_same_name_runs_again(
    harness: Harness, db_url: str
) -> None:
    outcome: dict[str, Any] = {}

    async def broken() -> int:
        raise LookupError("the tool failed")

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        with pytest.raises(LookupError, match="the tool failed"):
            await ctx.step("tool", broken)
        outcome["empty"] = step_names(
            db_url, await child_id(harness.engine, ctx.identity.conversation_id)
        )
        outcome["second"] = await ctx.step("tool", Calls().fn("tool", 7))
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    done = await harness.wait_done(started.conversation_id)
    assert done.error == ""
    assert outcome == {"empty": [], "second": 7}


async def test_concurrent_calls_of_one_name_run_its_function_once(harness: Harness) -> None:
    calls: list[int] = []
    gate = asyncio.Event()
    results: list[Any] = []

    async def slow() -> str:
        calls.append(1)
        await gate.wait()
        return "once"

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        first = asyncio.ensure_future(ctx.step("same", slow))
        second = asyncio.ensure_future(ctx.step("same", slow))
        await asyncio.sleep(0.05)
        gate.set()
        results.extend(await asyncio.gather(first, second))
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    await harness.wait_done(started.conversation_id)
    assert results == ["once", "once"]
    assert calls == [1]


async def test_type_decodes_a_recorded_value_and_bytes_stay_bytes(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    replayed: dict[str, Any] = {}
    resumed = asyncio.Event()

    async def point() -> Point:
        return Point(1, 2)

    async def raw() -> bytes:
        return b"\x00\xffbinary"

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        replayed["point"] = await ctx.step("point", point, type=Point)
        replayed["plain"] = await ctx.step("plain", point)
        replayed["raw"] = await ctx.step("raw", raw)
        if ctx.recovery is not None:
            resumed.set()
            ctx.emit(Event(kind="result", text="ok"))
            return
        ctx.emit(Event(kind="text", text="waiting"))
        await asyncio.Event().wait()

    harness.runner.script = run
    started = await harness.start(lease_id=LEASE)
    await until_event(harness.engine, started.conversation_id, "waiting")
    # The first run sees what a replay will (design §20): the recorded value, decoded.
    assert replayed == {"point": Point(1, 2), "plain": {"x": 1, "y": 2}, "raw": b"\x00\xffbinary"}
    await harness.engine.close()
    replayed.clear()
    fresh = ScriptRunner(script=run)
    async with restarted(harness, db_url, fresh, config, clock) as h:
        await asyncio.wait_for(resumed.wait(), 5)
        await h.wait_done(started.conversation_id)
        # Recorded values come back decoded: as the type asked for, else plain JSON.
        assert replayed == {
            "point": Point(1, 2),
            "plain": {"x": 1, "y": 2},
            "raw": b"\x00\xffbinary",
        }
        assert fresh.prepared[0].recovery is not None
        assert fresh.prepared[0].recovery.steps == 3


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "non-empty"),
        ("n" * 1025, "at most 1024 bytes"),
        ("é" * 513, "at most 1024 bytes"),
    ],
)
async def test_a_step_name_is_non_empty_and_at_most_1_kib(
    harness: Harness, name: str, message: str
) -> None:
    outcome: list[str] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        with pytest.raises(ValueError, match=message):
            await ctx.step(name, Calls().fn("x", 1))
        outcome.append(await ctx.step("n" * 1024, Calls().fn("x", "fits")))
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    await harness.wait_done(started.conversation_id)
    assert outcome == ["fits"]


async def test_a_step_result_past_max_step_bytes_is_refused_and_not_recorded(
    db_url: str, runner: ScriptRunner, clock: ManualClock, workspace: Any
) -> None:
    caught: list[errors.DelegationError] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        assert await ctx.step("fits", Calls().fn("f", "x" * 90)) == "x" * 90  # 92 bytes
        try:
            await ctx.step("big", Calls().fn("b", "x" * 99))  # 101 bytes of JSON
        except errors.StepTooLarge as exc:
            caught.append(exc)
        ctx.emit(Event(kind="result", text="ok"))

    runner.script = run
    config = EngineConfig(max_step_bytes=100)
    async with Engine(db_url, runner=runner, config=config, clock=clock) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        await h.wait_done(started.conversation_id)
        me = await child_id(engine, started.conversation_id)
        assert step_names(db_url, me) == ["fits"]
    (exc,) = caught
    assert (exc.reason, str(exc)) == ("step_too_large", "child step result exceeds its limit")


async def test_steps_past_max_steps_are_refused(
    db_url: str, runner: ScriptRunner, clock: ManualClock, workspace: Any
) -> None:
    caught: list[errors.DelegationError] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for n in range(3):
            await ctx.step(f"s{n}", Calls().fn("s", n))
        assert await ctx.step("s1", Calls().fn("again", 9)) == 1  # recorded: no new step
        try:
            await ctx.step("s3", Calls().fn("s", 3))
        except errors.StepLimit as exc:
            caught.append(exc)
        ctx.emit(Event(kind="result", text="ok"))

    runner.script = run
    async with Engine(
        db_url, runner=runner, config=EngineConfig(max_steps=3), clock=clock
    ) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        await h.wait_done(started.conversation_id)
        assert step_names(db_url, await child_id(engine, started.conversation_id)) == [
            "s0",
            "s1",
            "s2",
        ]
    (exc,) = caught
    assert (exc.reason, str(exc)) == ("step_limit", "child step limit exceeded")


def test_the_journal_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(max_steps=0)
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(max_step_bytes=0)


# --- resumed executions --------------------------------------------------------------------


async def test_a_resumed_execution_gets_recorded_steps_back_and_runs_only_the_rest(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    calls = Calls()
    finished = asyncio.Event()
    got: list[Any] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for n in range(1, 6):
            ctx.emit(Event(kind="text", text=f"turn {n}"))
            got.append(await ctx.step(f"turn {n}", calls.fn(f"turn {n}", n * 10)))
            if n == 3 and ctx.recovery is None:
                await asyncio.Event().wait()  # the host closes here
        finished.set()
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start(lease_id=LEASE)
    await until_event(harness.engine, started.conversation_id, "turn 3")
    await harness.engine.close()
    assert calls.calls == ["turn 1", "turn 2", "turn 3"]

    fresh = ScriptRunner(script=run)
    async with restarted(harness, db_url, fresh, config, clock) as h:
        await asyncio.wait_for(finished.wait(), 5)
        done = await h.wait_done(started.conversation_id)
        recovery = fresh.prepared[0].recovery
        assert recovery is not None and recovery.steps == 3
        # Every function ran once; the resumed run got the three recorded values back.
        assert calls.calls == [f"turn {n}" for n in range(1, 6)]
        assert got == [10, 20, 30, 10, 20, 30, 40, 50]
        assert step_names(db_url, done.id) == [f"turn {n}" for n in range(1, 6)]


async def test_a_follow_up_reads_the_steps_of_the_execution_it_continues(
    harness: Harness, db_url: str
) -> None:
    history: dict[str, Any] = {}

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        if ctx.request.message == "first":
            assert ctx.previous_run_id is None
            await ctx.step("answer", Calls().fn("answer", {"said": 42}))
            history["own"] = await ctx.recorded("answer")
            history["missing"] = await ctx.recorded("nothing")
        else:
            history["previous"] = ctx.previous_run_id
            history["answer"] = await ctx.recorded("answer", run_id=ctx.previous_run_id)
            history["mine"] = await ctx.recorded("answer")  # not recorded in this one
            try:
                await ctx.recorded("answer", run_id="r-not-of-this-conversation")
            except errors.ChildNotFound as exc:
                history["foreign"] = exc.reason
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    first = await harness.start("q1", message="first")
    await harness.wait_done(first.conversation_id)
    follow_up = await harness.start("q2", message="second", resume=first.conversation_id)
    await harness.wait_done(first.conversation_id, child_run_id=follow_up.run_id)
    assert history == {
        "own": {"said": 42},
        "missing": None,
        "previous": first.run_id,
        "answer": {"said": 42},
        "mine": None,
        "foreign": "child_not_found",
    }


async def test_steps_are_purged_with_their_child(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await ctx.step("kept until retention", Calls().fn("k", "v"))
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    done = await harness.wait_done(started.conversation_id)
    assert rows(db_url, "steps", done.id) == 1
    clock.advance(config.retention_s + 1)
    assert await harness.engine.purge() == 1
    assert rows(db_url, "steps", done.id) == 0
    assert await until_state_gone(harness.engine, started.conversation_id)


async def until_state_gone(engine: Engine, conversation_id: str) -> bool:
    return await engine.get_child(conversation_id) is None
