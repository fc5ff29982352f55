"""Host processes for the tests of design §17's protections, with the real command runner.

    python tests/harness/protect_host.py plant DB WORKSPACE TARGET LINE [READ_WRITE]
    python tests/harness/protect_host.py hold DB WORKSPACE OUTSIDE

``plant`` runs one command child in ``WORKSPACE`` (``READ_WRITE`` added to what it may
write) that writes ``LINE`` into the file ``TARGET``, and prints the child's error and
event count as one JSON line (the runner's own, with no event, when it refused to be
made). ``hold`` starts a command child that fills its private
``TMPDIR`` (a file, a symlink to ``OUTSIDE``), prints ``STARTED <conversationId>
<TMPDIR>``, and runs until it is killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

from contain_host import start  # this script's own directory is first on sys.path

from delegation import Engine
from delegation.runners.command import CommandConfigError, CommandRunner

PLANT = 'printf "%s\\n" "$2" > "$1"'
HOLD = 'echo x > "$TMPDIR/file"; ln -s "$1" "$TMPDIR/out"; echo "tmp $TMPDIR"; read a; read b'


async def plant(db: str, workspace: str, target: str, line: str, *read_write: str) -> None:
    argv = ["/bin/sh", "-c", PLANT, "sh", target, line]
    try:
        runner = CommandRunner({"plant": argv}, read_write=read_write)
    except CommandConfigError as exc:  # refused as the host starts, before any child
        print(json.dumps({"error": str(exc), "events": 0}), flush=True)
        return
    async with Engine(f"sqlite:///{db}", runner=runner) as engine:
        child = await start(engine, "plant", workspace)
        while (record := await engine.get_child(child.conversation_id)) and not record.terminal:
            await asyncio.sleep(0.02)
        assert record is not None
        events = await engine.events(child.conversation_id)
        print(json.dumps({"error": record.error, "events": len(events)}), flush=True)


async def hold(db: str, workspace: str, outside: str) -> None:
    runner = CommandRunner({"hold": ["/bin/sh", "-c", HOLD, "sh", outside]}, grace_s=0.1)
    async with Engine(f"sqlite:///{db}", runner=runner) as engine:
        child = await start(engine, "hold", workspace, lease_id="L1")
        while not (events := await engine.events(child.conversation_id)):
            await asyncio.sleep(0.02)
        tmpdir = events[0].text.removeprefix("tmp ")
        print(f"STARTED {child.conversation_id} {tmpdir}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    if sys.argv[1] == "plant":
        asyncio.run(plant(*sys.argv[2:]))
    else:
        asyncio.run(hold(*sys.argv[2:5]))
