"""Host processes for the one-owner test (design §9): two hosts on one SQLite file.

    python tests/harness/lock_host.py first DB_URL WORKSPACE   # starts a leased child, streams
    python tests/harness/lock_host.py second DB_URL            # retries opening until it may
    python tests/harness/lock_host.py hold DB_URL              # holds the file, writes nothing

``first`` prints ``STARTED <conversationId>`` once its leased child streams, then
runs until killed, or until its file is replaced (design §18): then it prints ``RUN
STOPPED`` as its run is cancelled, ``FAILED <reason> <message>`` once the engine has
stopped, and ``CLOSED <reason>`` as its close refuses, and exits. ``second`` prints
``REFUSED <reason>`` at its first refusal, keeps trying every 20 ms, then prints
``OPENED`` and ``RESUMED <conversationId> <attempt>`` when it has taken the child over,
and exits once the child is done. ``hold`` prints ``HOLDING`` once open.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from delegation import ChildContext, Engine, EngineConfig, Event, Params, Preset, Request, errors

PRESET = Preset(name="worker", extension_id="ext", generation=7)
LEASE = "lease-1"


def say(line: str) -> None:
    print(line, flush=True)


class Streaming:
    """The first host's run: it emits and flushes until it is killed."""

    async def prepare(self, request: Any, preset: Any, identity: Any, recovery: Any) -> Any:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            step = 0
            try:
                while True:
                    step += 1
                    ctx.emit(Event(kind="text", text=f"step {step}"))
                    await ctx.flush()
                    await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                say("RUN STOPPED")
                raise

        return run


class Finishing:
    """The second host's run: it says which attempt resumed it, and ends."""

    async def prepare(self, request: Any, preset: Any, identity: Any, recovery: Any) -> Any:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            say(f"RESUMED {identity.conversation_id} {recovery.attempt if recovery else 0}")
            ctx.emit(Event(kind="result", text="finished by the second host"))

        return run


async def first(url: str, workspace: str) -> None:
    engine = Engine(url, runner=Streaming(), config=EngineConfig(release_drain_s=1.0))
    await engine.open()
    conn = await engine.connect("runner-1", "host-a")
    await engine.open_tool(
        conn,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-1",
        extension_id="ext",
        presets=[PRESET],
        workspace=workspace,
    )
    request = Request(request_id="q1", profile="worker", message="stream", lease_id=LEASE)
    params = Params(
        run_id="parent-run",
        tool_call_id="call-1",
        extension_id="ext",
        generation=7,
        lease_id=LEASE,
        request=request,
    )
    result = await engine.call(conn, "child.start", params)
    say(f"STARTED {result.conversation_id}")
    failure = await engine.failed()
    say(f"FAILED {failure.reason} {failure}")
    try:
        await engine.close()
    except errors.DelegationError as exc:
        say(f"CLOSED {exc.reason}")


async def hold(url: str) -> None:
    engine = Engine(url, runner=Finishing())
    await engine.open()
    say("HOLDING")
    await asyncio.Event().wait()


async def second(url: str) -> None:
    refused = False
    while True:
        engine = Engine(url, runner=Finishing(), config=EngineConfig(release_drain_s=1.0))
        try:
            await engine.open()
            break
        except errors.HostConflict as exc:
            if not refused:
                say(f"REFUSED {exc.reason} {exc}")
                refused = True
            await asyncio.sleep(0.02)
    say("OPENED")
    try:
        while True:
            children = await engine.list_children()
            if children and all(child.terminal for child in children):
                return
            await asyncio.sleep(0.02)
    finally:
        await engine.close()


if __name__ == "__main__":
    if sys.argv[1] == "first":
        asyncio.run(first(sys.argv[2], sys.argv[3]))
    elif sys.argv[1] == "hold":
        asyncio.run(hold(sys.argv[2]))
    else:
        asyncio.run(second(sys.argv[2]))
