"""A host that stops itself (SIGSTOP) between queuing a write and running it, for the
tests of writes stamped when they commit (issue 36, tests/crash/test_stamped_at_commit.py).

    python tests/harness/stall_host.py DB purge|end

The host runs an engine on ``DB`` with a retention of :data:`RETENTION_S`, swept every
:data:`SWEEP_S`, and one leased child:

* ``purge``: the child ends at once; once it is due (past the retention), the host
  stops itself right after the next retention sweep queues its purge (before it runs);
* ``end``: the child ends when told; the host stops itself right after queuing its end.

Either way it prints ``STOPPING <conversationId>`` first, then stops; the test continues
it (SIGCONT) after longer than the retention. It then runs until killed. The fault
point is here, in the test's host: the library has none.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from delegation import ChildContext, Engine, EngineConfig, Event
from delegation.engine import runtime
from delegation.store.database import Database
from delegation.usecases import maintenance, service

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contain_host import start

RETENTION_S = 2.0
SWEEP_S = 0.2
_armed: list[Any] = []  # the use case whose write stops the host, once


def stop_at(fn: Any, conversation: list[str], due: list[float]) -> None:
    """Stop this process once ``fn`` is queued (after ``conversation`` names the child,
    and at ``due[0]`` or later if given), before its job is handed to the writer: its
    ``now`` is read after the stop or before it, as the engine stamps it."""
    write, submit = runtime.Runtime.write, Database.submit

    def watched_write(self: runtime.Runtime, use: runtime.Use[Any], **kwargs: Any) -> Any:
        ready = conversation and (not due or time.time() >= due[0])
        if use.fn is fn and conversation and not ready:
            skipped = asyncio.get_running_loop().create_future()
            skipped.set_result(0)  # no earlier sweep may purge it: the stopped one does
            return skipped
        if use.fn is fn and ready and not _armed:
            _armed.append(use)
        return write(self, use, **kwargs)

    def watched_submit(self: Database, job: Any, **kwargs: Any) -> Any:
        if _armed and _armed[0] is not None:
            _armed[0] = None
            print(f"STOPPING {conversation[0]}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return submit(self, job, **kwargs)

    runtime.Runtime.write = watched_write  # type: ignore[method-assign]
    Database.submit = watched_submit  # type: ignore[method-assign]


class Runner:
    def __init__(self, go: asyncio.Event) -> None:
        self.go = go

    async def prepare(self, request: Any, preset: Any, identity: Any, recovery: Any) -> Any:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            await self.go.wait()
            ctx.emit(Event(kind="result", text="done"))

        return run


async def main(db: str, what: str) -> None:
    go = asyncio.Event()
    conversation: list[str] = []
    due: list[float] = []
    stop_at(maintenance.purge if what == "purge" else service.finish, conversation, due)
    config = EngineConfig(retention_s=RETENTION_S, retention_sweep_s=SWEEP_S)
    async with Engine(f"sqlite:///{db}", runner=Runner(go), config=config) as engine:
        workspace = Path(db).parent / "ws"
        workspace.mkdir(exist_ok=True)
        child = await start(engine, "p", str(workspace), lease_id="L1")
        if what == "purge":
            go.set()  # ends now
            while not (record := await engine.get_child(child.conversation_id)).terminal:
                await asyncio.sleep(0.01)
            assert record.finished_at is not None
            due.append(record.finished_at + RETENTION_S)  # the first sweep then stops it
            conversation.append(child.conversation_id)
        else:
            conversation.append(child.conversation_id)
            go.set()  # its end is queued next: the host stops there
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
