"""A host process for the waiting crash tests (design §21): a leased child that takes a
step, then waits (``ask``: for a person's answer; ``sleep``: for a time), then takes a
second step. Each step appends a line to a log file (its effect outside the database),
so a test can count how often each ran.

    python tests/harness/wait_host.py URL LOG ask|sleep [--start] [--hold S] [--sleep S]

The host prints ``STARTED <conversation>`` once it started the child (``--start``),
``STEP <name>`` when a step's function runs, ``WOKE <seconds>`` when a sleep returns
(how long after the first attempt began it), ``DONE <conversation>`` when the run
returns, and ``INSTANCE <id>`` and ``READY`` once open.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from hosting import (  # this script's own directory is first on sys.path
    open_tool,
    ready,
    say,
    start_child,
)

from delegation import ChildContext, Engine, EngineConfig, Event, Preset, Request

LEASE = "lease-wait"


class WaitRunner:
    def __init__(self, log: str, how: str, sleep_s: float) -> None:
        self.log, self.how, self.sleep_s = log, how, sleep_s

    async def prepare(self, request: Request, preset: Preset, identity: object, recovery: object):  # type: ignore[no-untyped-def]
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        began = await ctx.step("began", time.time)
        await ctx.step("before", self.work, "before")
        if self.how == "ask":
            answer = await ctx.ask("go-ahead", "may I go on?", kind="approval")
            ctx.emit(Event(kind="text", text=f"answered {answer}"))
        else:
            await ctx.sleep("nap", self.sleep_s)
            say(f"WOKE {time.time() - began:.3f}")
        await ctx.step("after", self.work, "after")
        ctx.emit(Event(kind="result", text="finished"))
        say(f"DONE {ctx.identity.conversation_id}")

    def work(self, name: str) -> str:
        with open(self.log, "a") as log:  # the step's effect outside the database
            log.write(f"{name}\n")
            log.flush()
            os.fsync(log.fileno())
        say(f"STEP {name}")
        return name


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(lease_lifetime_s=3600.0, hold_s=args.hold)
    runner = WaitRunner(args.log, args.how, args.sleep)
    engine = Engine(args.url, runner=runner, config=config)
    await engine.open()
    say(f"INSTANCE {engine.instance_id}")
    if args.start:
        conn = await open_tool(engine)
        result = await start_child(engine, conn, "q-wait", "wait", LEASE)
        say(f"STARTED {result.conversation_id}")
    await ready()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("log")
    parser.add_argument("how", choices=["ask", "sleep"])
    parser.add_argument("--start", action="store_true")
    parser.add_argument("--hold", type=float, default=0.2)
    parser.add_argument("--sleep", type=float, default=4.0)
    asyncio.run(main(parser.parse_args()))
