"""A host process for the several-hosts tests (design §12): one of several engines on one
PostgreSQL database, starting leased children that stream until they are stopped.

    python tests/harness/multi_host.py URL NAME CHILDREN HEARTBEAT_S TIMEOUT_S

Each child emits ``NAME:n`` text events (``n`` counting on from what the child already
has), flushes each one and prints ``ACK <conversation> <sequence> <text>`` once it is
committed: what the host acknowledged. A resumed child (taken over from a dead host)
prints ``RESUMED <conversation> <attempt>``; a steer prints ``STEER <conversation>
<message>``; a run that is stopped prints ``STOPPED <conversation> <why>``. Started children
are printed as ``STARTED <conversation> <leaseId>``, then ``READY``.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from delegation import ChildContext, Engine, EngineConfig, Event, Params, Preset, Request

PRESET = Preset(name="worker", extension_id="ext", generation=7)


def _with_action(record: logging.LogRecord) -> bool:
    record.action = getattr(record, "action", "-")
    return True


def say(line: str) -> None:
    print(line, flush=True)


class StreamRunner:
    def __init__(self, name: str) -> None:
        self.name = name

    async def prepare(self, request: Request, preset: Preset, identity: object, recovery: object):  # type: ignore[no-untyped-def]
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        conversation = ctx.identity.conversation_id
        if ctx.recovery is not None:
            say(f"RESUMED {conversation} {ctx.recovery.attempt}")
        n = 0
        try:
            while True:
                n += 1
                text = f"{self.name}:{n}"
                sequence = ctx.emit(Event(kind="text", text=text))
                await ctx.flush()
                say(f"ACK {conversation} {sequence} {text}")
                for message in ctx.take_steers():
                    say(f"STEER {conversation} {message}")
                await asyncio.sleep(0.05)
        except BaseException as exc:  # cancelled, or its writes refused (fenced)
            say(f"STOPPED {conversation} {type(exc).__name__}")
            raise


async def main(url: str, name: str, count: int, heartbeat: float, timeout: float) -> None:
    config = EngineConfig(
        host_heartbeat_s=heartbeat,
        host_timeout_s=timeout,
        lease_lifetime_s=3600.0,
        release_drain_s=5.0,
    )
    engine = Engine(url, runner=StreamRunner(name), config=config)
    await engine.open()
    say(f"INSTANCE {engine.instance_id}")
    conn = await engine.connect(f"runner-{name}", f"hi-{name}")
    await engine.open_tool(
        conn,
        run_id=f"parent-{name}",
        conversation_id=f"parent-conv-{name}",
        tool_call_id="call-1",
        extension_id="ext",
        presets=[PRESET],
        workspace="/tmp",
    )
    for i in range(count):
        lease = f"lease-{name}-{i}"
        request = Request(request_id=f"q-{i}", profile="worker", message="stream", lease_id=lease)
        params = Params(
            run_id=f"parent-{name}",
            tool_call_id="call-1",
            extension_id="ext",
            generation=7,
            lease_id=lease,
            request=request,
        )
        result = await engine.call(conn, "child.start", params)
        say(f"STARTED {result.conversation_id} {lease}")
    say("READY")
    await asyncio.Event().wait()


if __name__ == "__main__":
    # As a host would: warnings and above on stderr, with each record's action key.
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s %(message)s action=%(action)s"
    )
    logging.getLogger().handlers[0].addFilter(_with_action)
    url, name, count, heartbeat, timeout = sys.argv[1:6]
    asyncio.run(main(url, name, int(count), float(heartbeat), float(timeout)))
