"""A host process for the admission tests on several PostgreSQL hosts (design §22).

    python tests/harness/admission_host.py URL NAME COUNT LOG RUN_S HEARTBEAT_S TIMEOUT_S

Every host runs the admission pump under the same policies: ``preset:runner-a/ext/worker``
and ``parent:shared-parent``, each at concurrency 2. Each host connects its own runner
(``runner-NAME``) and starts COUNT children under one lease, from a tool call of the
conversation ``shared-parent``; every host admits and runs what is queued, whoever
started it. Each run appends ``START`` and
``END`` lines (``<line> <conversation> <host> <time>``) to the shared file LOG, with
``O_APPEND``, and takes RUN_S seconds. Prints ``STARTED <conversation>`` for each child
started, then ``READY``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from delegation import (
    AdmissionPolicy,
    ChildContext,
    Engine,
    EngineConfig,
    Params,
    Preset,
    Request,
)

PRESET = Preset(name="worker", extension_id="ext", generation=7)
POLICIES = {
    "preset:runner-a/ext/worker": AdmissionPolicy(concurrency=2),
    "parent:shared-parent": AdmissionPolicy(concurrency=2),
}


def say(line: str) -> None:
    print(line, flush=True)


class FileRunner:
    def __init__(self, name: str, log: str, run_s: float) -> None:
        self.name = name
        self.log = log
        self.run_s = run_s

    async def prepare(self, request: Request, preset: Preset, identity: object, recovery: object):  # type: ignore[no-untyped-def]
        return self.run

    def _write(self, what: str, conversation: str) -> None:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{what} {conversation} {self.name} {time.time():.6f}\n".encode())
        finally:
            os.close(fd)

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        conversation = ctx.identity.conversation_id
        self._write("START", conversation)
        await asyncio.sleep(self.run_s)
        self._write("END", conversation)


async def main(
    url: str, name: str, count: int, log: str, run_s: float, heartbeat: float, timeout: float
) -> None:
    config = EngineConfig(
        host_heartbeat_s=heartbeat,
        host_timeout_s=timeout,
        lease_lifetime_s=3600.0,
        admission=POLICIES,
        start_wait_s=0.0,
    )
    engine = Engine(url, runner=FileRunner(name, log, run_s), config=config)
    await engine.open()
    say(f"INSTANCE {engine.instance_id}")
    if count:
        conn = await engine.connect(f"runner-{name}", f"hi-{name}")
        await engine.open_tool(
            conn,
            run_id=f"parent-{name}",
            conversation_id="shared-parent",
            tool_call_id="call-1",
            extension_id="ext",
            presets=[PRESET],
            workspace="/tmp",
        )
        for i in range(count):
            request = Request(
                request_id=f"q-{i}", profile="worker", message="run", lease_id=f"lease-{name}"
            )
            params = Params(
                run_id=f"parent-{name}",
                tool_call_id="call-1",
                extension_id="ext",
                generation=7,
                lease_id=f"lease-{name}",
                request=request,
            )
            result = await engine.call(conn, "child.start", params)
            say(f"STARTED {result.conversation_id}")
    say("READY")
    await asyncio.Event().wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    url, name, count, log, run_s, heartbeat, timeout = sys.argv[1:8]
    asyncio.run(main(url, name, int(count), log, float(run_s), float(heartbeat), float(timeout)))
