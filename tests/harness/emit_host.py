"""A host process for the exact-emits crash tests (design §26): a leased child whose run
emits after each of its five journaled steps, the natural pattern, or (``--command``) a
command child that prints five lines and, on its first attempt, stops after the third.

    python tests/harness/emit_host.py URL STOP [--start] [--command] [--workspace DIR]

``STOP`` says where a first attempt stops so that the test can kill the host there with
SIGKILL: ``after-step`` (step 3 recorded, its emit not made), ``after-emit`` (step 3's
emit committed, step 4 not begun), ``unflushed`` (step 3's emit made, maybe committed),
or ``none``. A resumed attempt never stops. The host prints ``AT <where>`` where it
stops, ``DONE`` when the child's run returns, and ``READY`` once it is up.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from hosting import (  # this script's own directory is first on sys.path
    open_tool,
    ready,
    say,
    start_child,
)

from delegation import ChildContext, Engine, EngineConfig, Event, Preset, Request
from delegation.runners.command import CommandRunner

LEASE = "lease-emits"
STEPS = 5
# The command child: five lines, the first attempt stopping (for ever) after the third.
LINES = """
import os, time
first = "DELEGATION_RECOVERY_ATTEMPT" not in os.environ
for n in range(1, 6):
    print(f"line {n}", flush=True)
    if first and n == 3:
        time.sleep(600)
print('{"kind": "result", "text": "five lines"}', flush=True)
"""


class EmitRunner:
    def __init__(self, stop: str) -> None:
        self.stop = stop

    async def prepare(self, request: Request, preset: Preset, identity: object, recovery: object):  # type: ignore[no-untyped-def]
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        first = ctx.recovery is None
        ctx.emit(Event(kind="progress", text="begin"))
        for n in range(1, STEPS + 1):
            out = await ctx.step(f"s{n}", square, n)
            if first and self.stop == "after-step" and n == 3:
                await self.halt()
            ctx.emit(Event(kind="progress", text=f"after {n}: {out}"))
            if first and self.stop == "after-emit" and n == 3:
                await ctx.flush()
                await self.halt()
            if first and self.stop == "unflushed" and n == 3:
                await self.halt()
        ctx.emit(Event(kind="result", text="five steps"))
        say("DONE")

    async def halt(self) -> None:
        say(f"AT {self.stop}")
        await asyncio.Event().wait()


def square(n: int) -> int:
    return n * n


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(lease_lifetime_s=3600.0, release_drain_s=5.0)
    runner: object
    if args.command:
        # Braces doubled: the template's placeholders are filled in (none is used here).
        source = LINES.replace("{", "{{").replace("}", "}}")
        runner = CommandRunner({"worker": [sys.executable, "-c", source]}, grace_s=0.5)
    else:
        runner = EmitRunner(args.stop)
    engine = Engine(args.url, runner=runner, config=config)
    await engine.open()
    if args.start:
        conn = await open_tool(engine, args.workspace)
        result = await start_child(engine, conn, "q-emits", "go", LEASE)
        say(f"STARTED {result.conversation_id}")
    await ready()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("stop", choices=["after-step", "after-emit", "unflushed", "none"])
    parser.add_argument("--start", action="store_true")
    parser.add_argument("--command", action="store_true")
    parser.add_argument("--workspace", default="/tmp")  # none that holds the database
    asyncio.run(main(parser.parse_args()))
