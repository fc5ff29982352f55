"""A host process for the patch tests (design §34): a leased child whose code is one of
four versions of the same run, so a test can kill a host of one (SIGKILL) and resume
the child on a host of another.

    python tests/harness/patch_host.py URL CODE VERSION [--start REQUEST] [--stop]

``CODE``: ``old`` takes steps a, b, c; ``new`` asks ``ctx.patched("p")`` first;
``removed`` is ``new`` with the call removed and a later patch ``q`` asked after b;
``drift`` takes a and c only. ``VERSION`` is the host's ``runner_version``. With
``--stop`` the run stops after b (the test kills the host there). The host prints
``PATCHED <name> <value>``, ``AT stop``, ``DONE <conversation>``, ``STARTED
<conversation>`` and ``READY``.
"""

from __future__ import annotations

import argparse
import asyncio

from hosting import (  # this script's own directory is first on sys.path
    open_tool,
    ready,
    say,
    start_child,
)

from delegation import ChildContext, Engine, EngineConfig, Event, Preset, Request

LEASE = "lease-patches"


class PatchRunner:
    def __init__(self, code: str, stop: bool) -> None:
        self.code, self.stop = code, stop

    async def prepare(self, request: Request, preset: Preset, identity: object, recovery: object):  # type: ignore[no-untyped-def]
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        if self.code == "new":
            say(f"PATCHED p {await ctx.patched('p')}")
        await ctx.step("a", lambda: "a")
        if self.code != "drift":
            await ctx.step("b", lambda: "b")
        if self.stop:
            say("AT stop")
            await asyncio.Event().wait()
        if self.code == "removed":
            say(f"PATCHED q {await ctx.patched('q')}")
        await ctx.step("c", lambda: "c")
        ctx.emit(Event(kind="result", text=self.code))
        say(f"DONE {ctx.identity.conversation_id}")


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(
        lease_lifetime_s=3600.0,
        release_drain_s=5.0,
        host_heartbeat_s=0.5,
        host_timeout_s=2.0,
        runner_version=args.version,
    )
    engine = Engine(args.url, runner=PatchRunner(args.code, args.stop), config=config)
    await engine.open()
    if args.start:
        conn = await open_tool(engine)
        result = await start_child(engine, conn, args.start, "go", LEASE)
        say(f"STARTED {result.conversation_id}")
    await ready()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("code", choices=["old", "new", "removed", "drift"])
    parser.add_argument("version")
    parser.add_argument("--start", metavar="REQUEST")
    parser.add_argument("--stop", action="store_true")
    asyncio.run(main(parser.parse_args()))
