"""A typed API, push instead of polling, recovery with history, control from outside
(design §11): the engine's typed methods and ``follow``, delivered steers after a
SIGKILL, and ``delegation cancel``/``steer`` acting on a live host's child, on either
store (PostgreSQL's host hears a control request through ``LISTEN``/``NOTIFY``)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest

from delegation import (
    ChildContext,
    Engine,
    EngineConfig,
    Event,
    Result,
    SteerResult,
    encode,
    errors,
)
from delegation.runners.scripted import ScriptedRunner
from delegation.store import controls
from delegation.store.stores import write_once
from tests.harness import rows
from tests.harness.operators import operator
from tests.harness.serving import OWNER, Client, host, start_params
from tests.harness.support import Harness, hold

# --- typed methods ---------------------------------------------------------------------


async def test_typed_methods_take_params_json_or_a_dict_of_wire_names(harness: Harness) -> None:
    harness.runner.script = hold(asyncio.Event())
    as_params = harness.start_params("q1", lease_id="L1")
    started = await harness.engine.start(harness.conn, as_params)
    assert isinstance(started, Result) and not started.done
    wire = {**OWNER, "runId": "parent-run", "generation": 7, "leaseId": "L1"}
    handle = {**wire, "childId": started.conversation_id}
    read = await harness.engine.read(harness.conn, json.dumps(handle))
    assert read.conversation_id == started.conversation_id
    steer = {**handle, "requestId": "s1", "message": "left"}
    steered = await harness.engine.steer(harness.conn, steer)
    assert steered == SteerResult(outcome="injected")
    again = await harness.engine.start(harness.conn, encode(as_params))  # a replay
    assert again.run_id == started.run_id
    cancelled = await harness.engine.cancel(harness.conn, handle)
    assert cancelled.conversation_id == started.conversation_id
    released = await harness.engine.release(harness.conn, wire)
    assert released.done
    with pytest.raises(errors.MalformedInput, match="apiKey"):
        await harness.engine.read(harness.conn, {**handle, "apiKey": "sk-1"})
    with pytest.raises(errors.MalformedInput):
        await harness.engine.read(harness.conn, {**handle, "after": None})


# --- follow -------------------------------------------------------------------------------


async def test_follow_gives_every_committed_event_once_in_order_then_ends(
    harness: Harness,
) -> None:
    gate = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for n in range(1, 301):  # more than two pages
            ctx.emit(Event(kind="text", text=f"e{n}"))
            if n % 50 == 0:
                await ctx.flush()
                await gate.wait()
        ctx.emit(Event(kind="result", text="end"))

    harness.runner.script = run
    child = await harness.start("q1")
    seen: list[Event] = []

    async def consume() -> None:
        async for event in harness.engine.follow(child.conversation_id):
            seen.append(event)

    store = harness.engine._db
    assert store.on_events is None, "nobody follows: the store announces nothing"
    follower = asyncio.create_task(consume())
    while len(seen) < 50:
        await asyncio.sleep(0.01)
    assert not follower.done(), "it waits for more while the child runs"
    assert store.on_events is not None
    gate.set()
    await asyncio.wait_for(follower, 10)
    assert [e.sequence for e in seen] == list(range(1, 302))
    assert seen[-1].text == "end"
    assert store.on_events is None, "the last follower gone, announcements stop"
    later = [e.sequence async for e in harness.engine.follow(child.conversation_id, after=299)]
    assert later == [300, 301], "a finished child: the rest, then the end"
    with pytest.raises(errors.ChildNotFound):
        async for _ in harness.engine.follow("c-unknown"):
            pass


async def test_follow_ends_with_the_engine(harness: Harness) -> None:
    harness.runner.script = hold(asyncio.Event())
    child = await harness.start("q1", lease_id="L1")
    events: list[int] = []

    async def consume() -> None:
        async for event in harness.engine.follow(child.conversation_id):
            events.append(event.sequence)

    follower = asyncio.create_task(consume())
    while not events:
        await asyncio.sleep(0.01)
    await harness.engine.close()
    with pytest.raises(errors.HostClosing):
        await asyncio.wait_for(follower, 5)


# --- recovery with history --------------------------------------------------------------


async def test_a_resumed_scripted_child_keeps_its_steered_heading_after_sigkill(
    db_url: str, workspace: Path
) -> None:
    """Issue 14: the demo went back to its original heading after the kill."""
    proc = await host("--stdio", "--db", db_url)
    assert proc.stdin is not None and proc.stdout is not None
    client = Client(proc.stdout, proc.stdin)
    try:
        await client.setup(workspace)
        started = await client.ok(
            "child.start", start_params("q1", "work in 200 steps", leaseId="L1")
        )
        handle = {**OWNER, "childId": started["conversationId"], "leaseId": "L1"}
        steer = {**handle, "requestId": "s1", "message": "durability first"}
        assert (await client.ok("child.steer", steer))["outcome"] == "injected"
        texts: list[str] = []
        while not any("thinking about durability first" in t for t in texts):
            page = await client.ok("child.read", {**handle, "after": len(texts)})
            texts += [e.get("text", "") for e in page.get("events", [])]
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    finally:
        await client.close()
    runner = ScriptedRunner(delay=0.01)
    config = EngineConfig(release_drain_s=2.0)
    async with Engine(db_url, runner=runner, config=config) as engine:
        headings: list[str] = []
        after_recovery = False
        async for event in engine.follow(started["conversationId"], after=len(texts)):
            after_recovery = after_recovery or event.kind == "recovery"
            if after_recovery and event.text.startswith("step "):
                headings.append(event.text.split("thinking about ", 1)[1])
            if len(headings) == 3:
                break
        assert headings == ["durability first"] * 3
        await engine.cancel_child(started["conversationId"])


# --- operator control from another process ----------------------------------------------


async def test_an_operator_cancels_and_steers_a_live_hosts_child(
    harness: Harness, db_url: str
) -> None:
    heard: list[str] = []

    async def listen(ctx: ChildContext) -> None:
        await ctx.admit()
        while True:
            message = await ctx.wait_steer()
            assert message is not None
            heard.append(message)
            ctx.emit(Event(kind="text", text=f"heard {message}"))

    harness.runner.script = listen
    child = await harness.start("q1", lease_id="L1")
    code, out, err = await operator("steer", child.conversation_id, "go left", "--json", db=db_url)
    assert code == 0, err
    steered = json.loads(out)
    assert (steered["applied"], steered["outcome"]) == (True, "injected")
    assert heard == ["go left"]
    code, out, err = await operator("cancel", child.conversation_id, "--wait", "--json", db=db_url)
    assert code == 0, err
    document = json.loads(out)
    assert document["applied"] is True and document["runId"] == child.run_id
    assert (document["state"], document["error"]) == ("cancelled", "cancelled by operator")
    record = await harness.engine.get_child(child.conversation_id)
    assert record is not None and record.state == "cancelled"
    # A finished child and an unknown one: clear errors, nothing recorded.
    code, _, err = await operator("cancel", child.conversation_id, db=db_url)
    assert code == 1 and "has already ended (cancelled)" in err
    code, _, err = await operator("steer", "c-unknown", "hello", db=db_url)
    assert (code, err.strip()) == (1, "delegation: no child c-unknown")


async def test_a_cancel_with_no_live_host_is_applied_at_the_next_boot(
    db_url: str, workspace: Path
) -> None:
    from tests.harness.support import ScriptRunner, open_harness

    runner = ScriptRunner(hold(asyncio.Event()))
    async with Engine(db_url, runner=runner) as engine:
        h = await open_harness(engine, runner, workspace)
        child = await h.start("q1", lease_id="L1")
    code, out, err = await operator("cancel", child.conversation_id, db=db_url)
    assert code == 0, err
    assert "is queued: no live host applied it" in out
    resumed = ScriptRunner(hold(asyncio.Event()))
    async with Engine(db_url, runner=resumed) as engine:
        for _ in range(300):
            record = await engine.get_child(child.conversation_id)
            if record is not None and record.terminal:
                break
            await asyncio.sleep(0.01)
        assert record is not None
        assert (record.state, record.error) == ("cancelled", "cancelled by operator")


async def test_a_control_request_reaches_a_live_host_within_a_second(
    harness: Harness, db_url: str
) -> None:
    """What ``delegation steer`` records beside the host (``stores.write_once``, on a
    connection of its own) is applied by the host within 1 s (design §12)."""
    heard: list[float] = []

    async def listen(ctx: ChildContext) -> None:
        await ctx.admit()
        while (message := await ctx.wait_steer()) is not None:
            heard.append(time.monotonic())
            ctx.emit(Event(kind="text", text=f"heard {message}"))

    harness.runner.script = listen
    child = await harness.start("q1", lease_id="L1")
    for n in range(3):
        begun = time.monotonic()
        await asyncio.to_thread(
            write_once,
            db_url,
            lambda c, n=n: controls.submit(
                c, child.conversation_id, child.run_id, "steer", f"turn {n}", f"op-{n}",
                time.time(),
            ),
        )  # fmt: skip
        while len(heard) <= n and time.monotonic() - begun < 60:
            await asyncio.sleep(0.005)
        assert len(heard) == n + 1, "the live host never applied the steer"


async def test_an_operator_reaches_a_serve_host_in_another_process(
    db_url: str, workspace: Path
) -> None:
    """``delegation serve`` in one process, the operator in others: a control request is
    applied within 1 s (PostgreSQL: ``NOTIFY`` to the host's ``LISTEN``), and the real
    ``steer`` and ``cancel --wait`` commands act on the host's child."""
    proc = await host("--stdio", "--db", db_url)
    assert proc.stdin is not None and proc.stdout is not None
    client = Client(proc.stdout, proc.stdin)
    try:
        await client.setup(workspace)
        started = await client.ok("child.start", start_params("q1", "work in 500 steps"))
        child = started["conversationId"]
        for n in range(3):
            begun = time.monotonic()
            control = await asyncio.to_thread(
                write_once,
                db_url,
                lambda c, n=n: controls.submit(
                    c, child, started["runId"], "steer", f"turn {n}", f"op-{n}", time.time()
                ),
            )
            applied = None
            while applied is None and time.monotonic() - begun < 60:
                applied = rows.scalar(
                    db_url, "SELECT applied_at FROM controls WHERE id = :id", {"id": control}
                )
                await asyncio.sleep(0.005)
            assert applied is not None, "the live host never applied the steer"
        code, out, err = await operator("steer", child, "durability first", "--json", db=db_url)
        assert code == 0, err
        assert (json.loads(out)["applied"], json.loads(out)["outcome"]) == (True, "injected")
        code, out, err = await operator("cancel", child, "--wait", "--json", db=db_url)
        assert code == 0, err
        document = json.loads(out)
        assert (document["applied"], document["state"]) == (True, "cancelled"), document
        result, events = await client.read_until_done({**OWNER, "childId": child})
        assert result["cancelled"] is True
        texts = [e.get("text", "") for e in events]
        assert "steered: turn 0" in texts and "steered: durability first" in texts, texts
    finally:
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        await client.close()
