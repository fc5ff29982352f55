"""A run's emits (design §26): a run cannot forge the engine's event kinds, and a resumed
run's emits are matched with what its execution committed, in order, the engine's own
events (``recovery``, ``input-required``) left out; the first emit that differs, and
every later one, is written. The kill tests are in ``test_emit_crash.py``; here a host
is closed gracefully and a second opened on the same database (a resume all the same).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from delegation import ChildContext, Engine, EngineConfig, Event
from delegation.records import ENGINE_KINDS
from delegation.run.emits import Committed, digest
from delegation.runners.command import CommandRunner
from tests.harness import rows
from tests.harness.support import ScriptRunner, open_harness, wait_terminal

Script = Callable[[ChildContext], Awaitable[None]]


def own_events(db_url: str) -> list[tuple[int, str, str]]:
    """The one child's events as (sequence, kind, text), oldest first."""
    bodies = rows.rows(db_url, "SELECT body FROM events ORDER BY sequence", {})
    events = [json.loads(bytes(body)) for (body,) in bodies]
    return [(e["sequence"], e["kind"], e.get("text", "")) for e in events]


# --- forged kinds -----------------------------------------------------------------------


async def test_a_run_may_not_emit_the_engine_s_kinds(db_url: str, workspace: Path) -> None:
    refused: list[str] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for kind in [*sorted(ENGINE_KINDS), " Recovery", "INPUT-REQUIRED\n"]:
            with pytest.raises(ValueError, match="engine's event kind") as caught:
                ctx.emit(Event(kind=kind, text="forged"))
            refused.append(str(caught.value))
        assert ctx.emit(Event(kind="text", text="mine")) == 1  # no sequence was used
        assert ctx.emit(Event(kind="recovery-notes", text="a kind of its own")) == 2
        ctx.emit(Event(kind="result", text="done"))

    runner = ScriptRunner(script=run)
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        done = await h.wait_done(started.conversation_id)
    assert (done.state, done.error, done.output) == ("done", "", "done")
    assert len(refused) == 5
    assert own_events(db_url) == [
        (1, "text", "mine"),
        (2, "recovery-notes", "a kind of its own"),
        (3, "result", "done"),
    ]


FORGER = """
    import json
    print("before")
    for kind in ("recovery", "input-required", "rewind", " Rewind "):
        print(json.dumps({"kind": kind, "text": "forged"}))
    print(json.dumps({"kind": "result", "text": "after"}))
"""


async def test_a_command_child_s_line_of_an_engine_kind_is_dropped_with_a_note(
    db_url: str, workspace: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = textwrap.dedent(FORGER).replace("{", "{{").replace("}", "}}")
    runner = CommandRunner(profiles={"worker": [sys.executable, "-c", source]})
    caplog.set_level(logging.WARNING, logger="delegation.runners.command")
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        done = await h.wait_done(started.conversation_id)
    assert (done.state, done.error, done.output) == ("done", "", "after")
    assert own_events(db_url) == [(1, "text", "before"), (2, "result", "after")]
    notes = [r for r in caplog.records if getattr(r, "action", "") == "event_kind_refused"]
    assert [r.getMessage().split(" wrote ")[1] for r in notes] == [
        "an event of the engine's kind 'recovery': dropped",
        "4 events of the engine's kinds in all: dropped",
    ]
    assert {getattr(r, "run_id", "") for r in notes} == {started.run_id}


# --- matched on a resume ----------------------------------------------------------------


async def resumed(db_url: str, workspace: Path, first: Script, then: Script) -> int:
    """Start a leased child running ``first`` until it says ``HOLD`` (an event), close the
    host, and run the child on with ``then`` on a new host; the child's id."""
    held = asyncio.Event()

    async def opening(ctx: ChildContext) -> None:
        await first(ctx)
        held.set()
        await asyncio.Event().wait()

    runner = ScriptRunner(script=opening)
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start(lease_id="lease-1")
        await asyncio.wait_for(held.wait(), 30)
    again = ScriptRunner(script=then)
    async with Engine(db_url, runner=again, config=EngineConfig()) as engine:
        await open_harness(engine, again, workspace)
        done = await wait_terminal(engine, started.conversation_id)
    assert (done.state, done.error) == ("done", "")
    assert again.prepared[0].recovery is not None
    return int(done.id)


async def test_a_resumed_run_writes_only_what_its_execution_did_not_commit(
    db_url: str, workspace: Path
) -> None:
    async def first(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="progress", text="a"))
        await ctx.step("s1", lambda: 1)
        ctx.emit(Event(kind="progress", text="b"))
        await ctx.flush()

    sequences: list[int] = []

    async def then(ctx: ChildContext) -> None:
        sequences.append(ctx.emit(Event(kind="progress", text="a")))
        await ctx.step("s1", lambda: 1)
        sequences.append(ctx.emit(Event(kind="progress", text="b")))
        sequences.append(ctx.emit(Event(kind="result", text="c")))

    await resumed(db_url, workspace, first, then)
    events = own_events(db_url)
    assert [(s, k, t) for s, k, t in events if k != "recovery"] == [
        (1, "progress", "a"),
        (2, "progress", "b"),
        (4, "result", "c"),
    ]
    assert events[2][1] == "recovery"
    assert sequences == [1, 2, 4]  # emit returns the committed event's sequence


async def test_a_resumed_run_that_emits_otherwise_is_written_from_where_it_differs(
    db_url: str, workspace: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def first(ctx: ChildContext) -> None:
        await ctx.admit()
        for text in ("a", "b", "c"):
            ctx.emit(Event(kind="progress", text=text))
        await ctx.flush()

    async def then(ctx: ChildContext) -> None:
        for text in ("a", "B", "c"):  # as a step under a new name runs anew
            ctx.emit(Event(kind="progress", text=text))
        ctx.emit(Event(kind="result", text="done"))

    caplog.set_level(logging.WARNING, logger="delegation.engine")
    await resumed(db_url, workspace, first, then)
    assert [t for _, k, t in own_events(db_url) if k != "recovery"] == [
        "a", "b", "c", "B", "c", "done",
    ]  # fmt: skip
    diverged = [r for r in caplog.records if getattr(r, "action", "") == "emits_diverged"]
    assert len(diverged) == 1


async def test_an_input_request_is_the_engine_s_not_one_of_the_run_s_emits(
    db_url: str, workspace: Path
) -> None:
    async def run(ctx: ChildContext) -> None:  # suspended at the ask, woken by its answer
        await ctx.admit()
        ctx.emit(Event(kind="progress", text="asking"))
        name = await ctx.ask("name", "its name?")
        ctx.emit(Event(kind="result", text=name))

    runner = ScriptRunner(script=run)
    config = EngineConfig(hold_s=0.1)
    async with Engine(db_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        while (record := await engine.get_child(cid)) is None or record.state != "waiting":
            await asyncio.sleep(0.02)
        await engine.answer_input(cid, "name", text="Ada")
        done = await h.wait_done(cid)
    assert (done.state, done.output) == ("done", "Ada")
    assert runner.prepared[-1].recovery is not None  # woken: a resume
    assert [(k, t) for _, k, t in own_events(db_url) if k != "recovery"] == [
        ("progress", "asking"),
        ("input-required", "its name?"),
        ("result", "Ada"),
    ]


def test_a_committed_event_is_matched_as_stored_but_for_its_sequence() -> None:
    committed = Committed("run-1")
    stored = Event(sequence=7, kind="progress", text="a")
    committed.add(7, json.dumps({"sequence": 7, "kind": "recovery"}).encode())
    committed.add(8, b"not an event")
    assert len(committed) == 1  # the engine's recovery left out
    committed = Committed("run-1")
    committed.add(7, json.dumps({"sequence": 7, "kind": "progress", "text": "a"}).encode())
    assert digest(stored) == digest(Event(sequence=99, kind="progress", text="a"))
    assert committed.match(Event(sequence=12, kind="progress", text="a")) == 7
    assert committed.match(Event(sequence=12, kind="progress", text="a")) is None  # past them


async def test_what_a_step_s_function_emits_is_never_taken_for_an_earlier_step_s(
    db_url: str, workspace: Path
) -> None:
    def ticking(ctx: ChildContext) -> Callable[[], int]:
        def fn() -> int:
            ctx.emit(Event(kind="progress", text="tick"))  # the same event in every step
            return 1

        return fn

    async def first(ctx: ChildContext) -> None:
        await ctx.admit()
        for name in ("s1", "s2"):
            await ctx.step(name, ticking(ctx))
        await ctx.flush()

    async def then(ctx: ChildContext) -> None:
        for name in ("s1", "s2", "s3"):  # s1 and s2 replay without emitting; s3 runs
            await ctx.step(name, ticking(ctx))
        ctx.emit(Event(kind="result", text="done"))

    await resumed(db_url, workspace, first, then)
    assert [t for _, k, t in own_events(db_url) if k != "recovery"] == [
        "tick", "tick", "tick", "done",
    ]  # fmt: skip


async def test_what_a_replayed_step_emitted_does_not_unmatch_the_emits_after_it(
    db_url: str, workspace: Path
) -> None:
    """A recorded step keeps where its function's own events lie (migration 0018): its
    replay, which emits none of them, leaves the emits between steps matched."""

    def inside(ctx: ChildContext, name: str) -> Callable[[], str]:
        def fn() -> str:
            ctx.emit(Event(kind="progress", text=f"inside {name}"))
            return name

        return fn

    async def first(ctx: ChildContext) -> None:
        await ctx.admit()
        for name in ("s1", "s2"):
            await ctx.step(name, inside(ctx, name))
            ctx.emit(Event(kind="progress", text=f"after {name}"))
        await ctx.flush()

    async def then(ctx: ChildContext) -> None:
        for name in ("s1", "s2", "s3"):
            await ctx.step(name, inside(ctx, name))
            ctx.emit(Event(kind="progress", text=f"after {name}"))
        ctx.emit(Event(kind="result", text="done"))

    await resumed(db_url, workspace, first, then)
    assert [t for _, k, t in own_events(db_url) if k != "recovery"] == [
        "inside s1", "after s1", "inside s2", "after s2", "inside s3", "after s3", "done",
    ]  # fmt: skip
