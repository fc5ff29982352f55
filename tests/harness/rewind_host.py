"""A host process for the rewind's crash test (design §35): a leased child takes six
journaled steps, each appending a line to a log file (its effect outside the database);
a rewind of it runs again from a step, and its first run stops after step 4 so the test
can kill the host there with SIGKILL.

    python tests/harness/rewind_host.py URL LOG [--start] [--rewind CONVERSATION RUN STEP]

``--start`` starts the child and prints ``DONE <conversation> <run>`` when its run
returns; ``--rewind`` asks for the rewind (request id ``rw-1``: asked again after a
restart it is the same execution) and prints ``REWOUND <run>``. The host prints
``AT stop`` where a rewound first run stops, ``FINISHED <run>`` when any run returns,
and ``READY``.
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

LEASE = "lease-rewind"
STEPS = 6


class StepRunner:
    def __init__(self, log: str) -> None:
        self.log = log

    async def prepare(self, request: Request, preset: Preset, identity: object, recovery: object):  # type: ignore[no-untyped-def]
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        recovery = ctx.recovery
        rewound = recovery is not None and recovery.reason == "rewind"
        for n in range(1, STEPS + 1):
            ctx.emit(Event(kind="text", text=f"before {n}"))
            await ctx.step(f"s{n}", self.work, ctx.identity.run_id, n)
            if rewound and n == 4:
                say("AT stop")
                await asyncio.Event().wait()
        ctx.emit(Event(kind="result", text="six steps"))
        say(f"FINISHED {ctx.identity.run_id}")

    def work(self, run_id: str, n: int) -> int:
        with open(self.log, "a") as log:  # the step's effect outside the database
            log.write(f"{run_id} s{n}\n")
            log.flush()
            os.fsync(log.fileno())
        return n


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(lease_lifetime_s=3600.0, release_drain_s=5.0)
    engine = Engine(args.url, runner=StepRunner(args.log), config=config)
    await engine.open()
    if args.start:
        conn = await open_tool(engine)
        result = await start_child(engine, conn, "q-steps", "six", LEASE)
        record = await engine.get_child(result.conversation_id)
        while record is None or not record.terminal:
            await asyncio.sleep(0.05)
            record = await engine.get_child(result.conversation_id)
        say(f"DONE {result.conversation_id} {result.run_id}")
    if args.rewind:
        conversation, run, step = args.rewind
        rewound = await engine.rewind_child(conversation, run_id=run, step=step, request_id="rw-1")
        say(f"REWOUND {rewound.run_id}")
    await ready()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("log")
    parser.add_argument("--start", action="store_true")
    parser.add_argument("--rewind", nargs=3, metavar=("CONVERSATION", "RUN", "STEP"))
    asyncio.run(main(parser.parse_args()))
