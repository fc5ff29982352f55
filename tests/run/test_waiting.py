"""A child may wait (design §21): for a person (``ctx.ask``), a time (``ctx.sleep``) or an
event (``ctx.wait_event``), in memory for ``hold_s``, then suspended as ``waiting`` with
no task, no process and no slot, and woken as a resume. On both stores, one host
process; hosts killed while a child waits are in ``test_waiting_crash.py``, several
PostgreSQL hosts in ``test_several_hosts.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from delegation import ChildContext, Event, Params, errors
from delegation.codec import encode
from tests.harness import rows
from tests.harness.support import Harness
from tests.harness.waits import hosted, state_is, until


def run_tasks(run_id: str) -> list[asyncio.Task[Any]]:
    """The tasks of a child's run alive in this process."""
    return [t for t in asyncio.all_tasks() if t.get_name() == f"delegation-child-{run_id}"]


def input_params(h: Harness, child_id: str, **changes: Any) -> Params:
    values: dict[str, Any] = {"child_id": child_id, "request_id": "answer-1", **changes}
    return h.params(lease_id="lease-1", tool_call_id="", **values)


class Calls:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def step(self, name: str) -> Callable[[], str]:
        def fn() -> str:
            self.seen.append(name)
            return name

        return fn


# --- asking ---------------------------------------------------------------------------


async def test_a_child_that_asks_waits_holding_nothing_and_its_answer_wakes_it(
    db_url: str, workspace: Path
) -> None:
    calls = Calls()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await ctx.step("before", calls.step("before"))
        answer = await ctx.ask(
            "deploy", "deploy to production?", kind="approval", tool_name="deploy",
            tool_call_id="t-1", input={"env": "prod"},
        )  # fmt: skip
        calls.seen.append(f"answer {answer}")
        await ctx.step("after", calls.step("after"))
        ctx.emit(Event(kind="result", text=answer))

    async with hosted(db_url, workspace, run) as h:
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        await state_is(h, cid, "waiting")
        record = await h.engine.get_child(cid)
        assert record is not None
        assert run_tasks(record.run_id) == []  # no task of its run is alive
        assert h.engine._supervisor.runs.get(record.id) is None
        read = await h.engine.read(h.conn, input_params(h, cid))
        (ask,) = read.input_requests.values()
        assert read.input_requests == {"deploy": ask}
        assert (ask.kind, ask.prompt, ask.tool_name, ask.tool_call_id, ask.options) == (
            "approval", "deploy to production?", "deploy", "t-1", ["approve", "deny"],
        )  # fmt: skip
        assert json.loads(ask.input) == {"env": "prod"} and ask.expires_at == ""
        wire = json.loads(encode(read))
        assert wire["inputRequests"]["deploy"]["toolName"] == "deploy"

        answered = await h.engine.input(h.conn, input_params(h, cid, input_id="deploy",
                                                              decision="approve"))  # fmt: skip
        assert answered.input_requests == {} and "inputRequests" not in json.loads(encode(answered))
        again = await h.engine.input(h.conn, input_params(h, cid, input_id="deploy",
                                                           decision="approve"))  # fmt: skip
        assert again.conversation_id == cid  # the same requestId: the same answer, once
        with pytest.raises(errors.InputAnswered):
            await h.engine.input(
                h.conn,
                input_params(h, cid, input_id="deploy", decision="deny", request_id="answer-2"),
            )
        done = await h.wait_done(cid)
    assert (done.state, done.output) == ("done", "approve")
    assert calls.seen == ["before", "answer approve", "after"]
    kinds = [e.kind for e in await _events(db_url, done.id)]
    assert kinds == ["input-required", "recovery", "result"]


async def _events(db_url: str, child_id: int) -> list[Event]:
    sql = "SELECT body FROM events WHERE child_id = :c ORDER BY sequence"
    bodies = [bytes(row[0]) for row in rows.rows(db_url, sql, {"c": child_id})]
    return [msgspec.json.decode(body, type=Event) for body in bodies]


async def test_an_answer_within_hold_s_costs_no_suspension(db_url: str, workspace: Path) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        text = await ctx.ask("name", "what is its name?")
        ctx.emit(Event(kind="result", text=text))

    async with hosted(db_url, workspace, run, hold_s=30.0) as h:
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id

        async def asked() -> bool:
            read = await h.engine.read(h.conn, input_params(h, cid))
            return bool(read.input_requests)

        await until(asked)
        await h.engine.answer_input(cid, "name", text="Ada")
        done = await h.wait_done(cid)
    assert done.output == "Ada"
    assert [e.kind for e in await _events(db_url, done.id)] == ["input-required", "result"]


async def test_every_refusal_of_child_input(db_url: str, workspace: Path) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await ctx.ask("pick", "which one?", options=["red", "blue"])
        await ctx.ask("free", "say something")
        with contextlib.suppress(errors.InputTimeout):
            await ctx.ask("late", "too late", timeout=0.05)
        await asyncio.Event().wait()

    async with hosted(db_url, workspace, run) as h:
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        await state_is(h, cid, "waiting")
        refusals = {
            errors.InputUnknown: dict(input_id="nothing", decision="red"),
            errors.InputInvalid: dict(input_id="pick", decision="green"),
        }
        for refusal, fields in refusals.items():
            with pytest.raises(refusal) as caught:
                await h.engine.input(h.conn, input_params(h, cid, **fields))
            assert caught.value.reason == refusal.reason
        await h.engine.input(h.conn, input_params(h, cid, input_id="pick", decision="blue"))
        with pytest.raises(errors.InputAnswered):
            await h.engine.input(
                h.conn, input_params(h, cid, input_id="pick", decision="red", request_id="x2")
            )

        async def asked(name: str) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                read = await h.engine.read(h.conn, input_params(h, cid))
                return name in read.input_requests

            return check

        await until(await asked("free"))
        with pytest.raises(errors.InputInvalid):  # a text request takes no decision
            await h.engine.input(h.conn, input_params(h, cid, input_id="free", decision="x",
                                                       request_id="x3"))  # fmt: skip
        await h.engine.input(h.conn, input_params(h, cid, input_id="free", message="hello",
                                                   request_id="x4"))  # fmt: skip
        await until(await asked("late"))
        await asyncio.sleep(0.1)  # past its timeout
        with pytest.raises(errors.InputClosed):
            await h.engine.input(h.conn, input_params(h, cid, input_id="late", message="hi",
                                                       request_id="x5"))  # fmt: skip
        await h.engine.cancel_child(cid)
        with pytest.raises(errors.InputClosed):  # ended: it waits for nothing
            await h.engine.answer_input(cid, "free", text="again")
    assert str(errors.InputUnknown()) == "child input request not found"
    assert str(errors.InputAnswered()) == "child input was already answered"
    assert str(errors.InputClosed()) == "child is not waiting for input"


async def test_a_timeout_is_raised_at_the_resumed_ask(db_url: str, workspace: Path) -> None:
    seen: list[str] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        try:
            await ctx.ask("q", "anyone?", timeout=0.6)
        except errors.InputTimeout as exc:
            seen.append(f"{exc.reason} at attempt {ctx.recovery.attempt if ctx.recovery else 0}")
        ctx.emit(Event(kind="result", text="gave up"))

    async with hosted(db_url, workspace, run) as h:
        started = await h.start(lease_id="lease-1")
        await state_is(h, started.conversation_id, "waiting")  # past hold_s: suspended
        done = await h.wait_done(started.conversation_id)
    assert seen == ["input_timeout at attempt 1"]  # raised in the run woken for it
    assert done.output == "gave up"


async def test_a_cancel_ends_a_waiting_child(db_url: str, workspace: Path) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await ctx.ask("q", "anyone?")

    async with hosted(db_url, workspace, run) as h:
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        await state_is(h, cid, "waiting")
        result = await h.engine.cancel(h.conn, input_params(h, cid))
        assert result.cancelled and result.error == "cancelled: cancel requested"
        assert result.input_requests == {}  # it waits for nothing now
        record = await h.engine.get_child(cid)
        assert record is not None and record.state == "cancelled"


# --- sleeping and events ----------------------------------------------------------------


async def test_a_sleep_wakes_on_time_after_a_suspension(db_url: str, workspace: Path) -> None:
    woke: list[float] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        started = await ctx.step("t0", lambda: ctx_now())
        await ctx.sleep("nap", 1.0)
        woke.append(ctx_now() - started)
        ctx.emit(Event(kind="result", text="rested"))

    async with hosted(db_url, workspace, run) as h:
        begun = await h.start(lease_id="lease-1")
        await state_is(h, begun.conversation_id, "waiting")
        done = await h.wait_done(begun.conversation_id)
    assert done.output == "rested"
    assert 1.0 <= woke[0] < 2.5, woke  # its own timer woke it, not a late sweep


def ctx_now() -> float:
    import time

    return time.time()


async def test_an_event_sent_before_the_wait_and_one_sent_after(
    db_url: str, workspace: Path
) -> None:
    got: list[Any] = []
    asked = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        got.clear()  # what this attempt saw (a replay sees the first event again)
        got.append(await ctx.wait_event("first", "go"))  # sent before: taken at once
        ctx.emit(Event(kind="text", text="took the first"))
        got.append(await ctx.wait_event("second", "go"))  # sent after it waited
        ctx.emit(Event(kind="result", text="both"))

    async with hosted(db_url, workspace, run) as h:
        # A child that has not run yet: a conversation exists once started.
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        assert await h.engine.send_event(cid, "go", {"n": 1}, idempotency_key="e1") in (True,)
        await state_is(h, cid, "waiting")
        assert await h.engine.send_event(cid, "go", {"n": 2}, idempotency_key="e2")
        assert not await h.engine.send_event(cid, "go", {"n": 2}, idempotency_key="e2")
        done = await h.wait_done(cid)
    assert got == [{"n": 1}, {"n": 2}] and done.output == "both" and not asked.is_set()


async def test_the_first_event_sent_with_a_key_wins_until_taken(
    db_url: str, workspace: Path
) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await asyncio.sleep(0.3)
        first = await ctx.wait_event("w", "k")
        ctx.emit(Event(kind="result", text=json.dumps(first)))

    async with hosted(db_url, workspace, run) as h:
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        assert await h.engine.send_event(cid, "k", "one")
        assert not await h.engine.send_event(cid, "k", "two")  # one with the key waits
        done = await h.wait_done(cid)
    assert done.output == '"one"'


async def test_an_event_wait_times_out_at_the_resumed_wait(db_url: str, workspace: Path) -> None:
    seen: list[str] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        try:
            await ctx.wait_event("w", "never", timeout=0.5)
        except errors.EventTimeout as exc:
            seen.append(exc.reason)
        ctx.emit(Event(kind="result", text="ok"))

    async with hosted(db_url, workspace, run) as h:
        started = await h.start(lease_id="lease-1")
        await h.wait_done(started.conversation_id)
    assert seen == ["event_timeout"]


# --- bounds -------------------------------------------------------------------------------


async def test_the_bounds_of_what_waits(db_url: str, workspace: Path) -> None:
    refused: list[str] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        asks = [asyncio.create_task(ctx.ask(f"q{n}", "?")) for n in range(3)]
        await asyncio.sleep(0.05)
        try:
            await ctx.ask("one-too-many", "?")
        except errors.InputLimit as exc:
            refused.append(exc.reason)
        for ask in asks:
            ask.cancel()
        await asyncio.Event().wait()

    async with hosted(db_url, workspace, run, max_open_inputs=3, max_buffered_events=2,
                      max_step_bytes=64, hold_s=30.0) as h:  # fmt: skip
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id

        async def limited() -> bool:
            return bool(refused)

        await until(limited)
        assert refused == ["input_limit"]
        assert await h.engine.send_event(cid, "a", 1)
        assert await h.engine.send_event(cid, "b", 2)
        with pytest.raises(errors.EventBufferFull):
            await h.engine.send_event(cid, "c", 3)
        with pytest.raises(errors.EventTooLarge):
            await h.engine.send_event(cid, "d", "x" * 100)
        with pytest.raises(errors.ChildNotFound):
            await h.engine.send_event("c-nobody", "a", 1)
        await h.engine.cancel_child(cid)


async def test_a_child_that_never_waits_shows_the_seeds_shapes(harness: Harness) -> None:
    """Go-era compatibility: no new Result field, no new event kind."""
    started = await harness.start()
    done = await harness.wait_done(started.conversation_id)
    read = await harness.read(started.conversation_id)
    wire = json.loads(encode(read))
    assert "inputRequests" not in wire and done.inputs_open == 0
    assert {e["kind"] for e in wire["events"]} <= {"result", "text", "start"}


async def test_ask_before_admit_and_bad_arguments_are_refused(harness: Harness) -> None:
    caught: list[str] = []

    async def run(ctx: ChildContext) -> None:
        try:
            await ctx.ask("q", "?")
        except RuntimeError as exc:
            caught.append(str(exc))
        await ctx.admit()
        for call in (
            lambda: ctx.ask("q", "?", kind="poll"),
            lambda: ctx.ask("q", "?", options=["a", "a"]),
            lambda: ctx.ask("q", "?", timeout=0),
            lambda: ctx.sleep("s", -1),
            lambda: ctx.wait_event("w", ""),
        ):
            try:
                await call()
            except ValueError as exc:
                caught.append(type(exc).__name__)
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    await harness.wait_done(started.conversation_id)
    assert caught == [
        "a run waits only once admitted: call admit() first",
        *["ValueError"] * 5,
    ]


# --- the operator's commands ------------------------------------------------------------


async def test_delegation_input_and_send_from_another_process(db_url: str, workspace: Path) -> None:
    from tests.harness.operators import operator

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        pick = await ctx.ask("pick", "which?", options=["red", "blue"])
        word = await ctx.ask("word", "say a word")
        sent = await ctx.wait_event("sig", "go")
        ctx.emit(Event(kind="result", text=f"{pick} {word} {json.dumps(sent)}"))

    async with hosted(db_url, workspace, run) as h:
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        await state_is(h, cid, "waiting")
        code, out, err = await operator("input", cid, "pick", "--decision", "green", db=db_url)
        assert (code, out) == (1, "") and "not one of its options (input_invalid)" not in out
        assert err.strip() == "delegation: child input decision is not one of its options"
        code, out, err = await operator("input", cid, "pick", "--decision", "blue", "--json",
                                        db=db_url)  # fmt: skip
        assert code == 0, err
        assert json.loads(out) == {
            "action": "input", "conversationId": cid, "runId": started.run_id, "applied": True,
            "state": "running",
        }  # fmt: skip

        async def asked() -> bool:
            record = await h.engine.get_child(cid)
            return record is not None and record.inputs_open == 1

        await until(asked)
        code, out, err = await operator("input", cid, "word", "--text", "hello", db=db_url)
        assert code == 0 and out.startswith(f"answered word of {cid}"), (out, err)
        code, out, err = await operator("send", cid, "go", "--data", "{nope", db=db_url)
        assert code == 2 and "argument --data: '{nope' is not JSON" in err  # a usage error
        code, out, err = await operator("send", cid, "go", "--data", '{"n": 1}', "--id", "s1",
                                        db=db_url)  # fmt: skip
        assert code == 0 and out.strip() == f"event go to {cid}: sent", (out, err)
        done = await h.wait_done(cid)
        # Ended, the conversation takes no event (design §33): refused, nothing kept.
        code, out, err = await operator("send", cid, "go", "--data", "2", "--id", "s2", db=db_url)
        assert (code, out) == (1, ""), (out, err)
        assert err == "delegation: child conversation has no live execution\n"
    assert done.output == 'blue hello {"n": 1}'
