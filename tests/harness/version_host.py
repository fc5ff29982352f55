"""A host process for the runner-version crash tests (design §34): an engine whose runner
declares a version (or none) and the older ones it resumes, under a version policy, so a
test can kill a host of one version (SIGKILL) and resume its child on a host of another.

    python tests/harness/version_host.py URL VERSION POLICY [--then ask|hang|finish]
        [--resumes V]... [--start REQUEST]...

``VERSION`` is the runner's own ``version`` (``-``: unversioned), ``POLICY`` the host's
``on_version_change``. The child's run records the step ``one``, then ``hang`` waits
until its host is killed, ``ask`` asks for a word (``ctx.ask``), and ``finish`` goes on;
then it records the step ``two`` and ends with ``heard <word>`` (or ``finished``).

The host prints ``PREPARED <reason> <previous> -> <runner> changed=<bool>`` when its
runner prepares a resumed child (``PREPARED fresh`` a new one), ``STEP <name>`` when a
step's function runs, ``AT hang``, ``DONE <conversation> <time.time()>`` when the run
returns, ``STARTED <conversation>`` (one child per ``--start``), ``INSTANCE <id>`` and
``READY`` once open.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from hosting import (  # this script's own directory is first on sys.path
    open_tool,
    ready,
    say,
    start_child,
)

from delegation import (
    ChildContext,
    Engine,
    EngineConfig,
    Event,
    Preset,
    Recovery,
    Request,
    Run,
)


class VersionedRunner:
    def __init__(self, version: str | None, resumes: tuple[str, ...], then: str) -> None:
        self.version, self.resumes, self.then = version, resumes, then

    async def prepare(
        self, request: Request, preset: Preset, identity: object, recovery: Recovery | None
    ) -> Run:
        if recovery is None:
            say("PREPARED fresh")
        else:
            say(
                f"PREPARED {recovery.reason} {recovery.previous_version} ->"
                f" {recovery.runner_version} changed={recovery.version_changed}"
            )
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        await ctx.step("one", self.work, "one")
        text = "finished"
        if self.then == "hang":
            say("AT hang")
            await asyncio.Event().wait()  # until the test kills this host
        elif self.then == "ask":
            text = f"heard {await ctx.ask('word', 'say a word')}"
        await ctx.step("two", self.work, "two")
        ctx.emit(Event(kind="result", text=text))
        say(f"DONE {ctx.identity.conversation_id} {time.time():.3f}")

    def work(self, name: str) -> str:
        say(f"STEP {name}")
        return name


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(
        lease_lifetime_s=3600.0,
        release_drain_s=2.0,
        hold_s=0.2,  # an asking child is suspended at once: it waits as rows only
        host_heartbeat_s=0.5,
        host_timeout_s=2.0,
        on_version_change=args.policy,
    )
    version = None if args.version == "-" else args.version
    runner = VersionedRunner(version, tuple(args.resumes), args.then)
    engine = Engine(args.url, runner=runner, config=config)
    await engine.open()
    if args.start:  # the tool call the children start under
        conn = await open_tool(engine)
    say(f"INSTANCE {engine.instance_id}")
    for request_id in args.start:
        result = await start_child(engine, conn, request_id, "go", f"lease-{request_id}")
        say(f"STARTED {result.conversation_id}")
    await ready()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("version")
    parser.add_argument("policy", choices=["resume", "refuse", "pin"])
    parser.add_argument("--then", choices=["ask", "hang", "finish"], default="finish")
    parser.add_argument("--resumes", action="append", default=[])
    parser.add_argument("--start", metavar="REQUEST", action="append", default=[])
    asyncio.run(main(parser.parse_args()))
