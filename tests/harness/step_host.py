"""A host process for the step journal's crash tests (design §15): a leased child that
takes six journaled steps, each of which appends a line to a log file (its effect
outside the database), so a test can count how often each step's function ran.

    python tests/harness/step_host.py URL NAME LOG STOP [--start] [--beat S --dead S]

``STOP`` says where a first attempt stops so the test can kill the host there with
SIGKILL: ``between`` (after step 3 is recorded), ``inside`` (in step 3's function,
after its effect), or ``none``. A resumed attempt never stops. The host prints
``RECORDED <conversation> <n>`` after each step, ``AT <where>`` where it stops,
``DONE <conversation>`` when the child's run returns, and ``INSTANCE <id>``/``READY``.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from hosting import (  # this script's own directory is first on sys.path
    open_tool,
    ready,
    say,
    start_child,
)

from delegation import ChildContext, Engine, EngineConfig, Event, Preset, Request

LEASE = "lease-steps"
STEPS = 6


class StepRunner:
    def __init__(self, name: str, log: str, stop: str) -> None:
        self.name, self.log, self.stop = name, log, stop

    async def prepare(self, request: Request, preset: Preset, identity: object, recovery: object):  # type: ignore[no-untyped-def]
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        conversation = ctx.identity.conversation_id
        first = ctx.recovery is None
        for n in range(1, STEPS + 1):
            ctx.emit(Event(kind="text", text=f"before {n}"))
            value = await ctx.step(f"s{n}", self.work, n, first)
            assert value == n * n
            say(f"RECORDED {conversation} {n}")
            if first and self.stop == "between" and n == 3:
                say("AT between")
                await asyncio.Event().wait()
        ctx.emit(Event(kind="result", text="six steps"))
        say(f"DONE {conversation}")

    async def work(self, n: int, first: bool) -> int:
        with open(self.log, "a") as log:  # the step's effect outside the database
            log.write(f"{self.name} {n}\n")
            log.flush()
            os.fsync(log.fileno())
        if first and self.stop == "inside" and n == 3:
            say("AT inside")
            await asyncio.Event().wait()
        return n * n


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(
        lease_lifetime_s=3600.0,
        release_drain_s=5.0,
        host_heartbeat_s=args.beat,
        host_timeout_s=args.dead,
    )
    engine = Engine(args.url, runner=StepRunner(args.name, args.log, args.stop), config=config)
    await engine.open()
    say(f"INSTANCE {engine.instance_id}")
    if args.start:
        conn = await open_tool(engine)
        result = await start_child(engine, conn, "q-steps", "six", LEASE)
        say(f"STARTED {result.conversation_id}")
    await ready()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("log")
    parser.add_argument("stop", choices=["between", "inside", "none"])
    parser.add_argument("--start", action="store_true")
    parser.add_argument("--beat", type=float, default=2.0)
    parser.add_argument("--dead", type=float, default=10.0)
    asyncio.run(main(parser.parse_args()))
