"""Host processes for the tests of SPEC §17's protections, with the real command runner.

    python tests/protect_host.py plant DB WORKSPACE TARGET LINE [READ_WRITE]

``plant`` runs one command child in ``WORKSPACE`` (``READ_WRITE`` added to what it may
write) that writes ``LINE`` into the file ``TARGET``, and prints the child's error and
event count as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys

from contain_host import start  # this script's own directory is first on sys.path

from delegation import Engine
from delegation.runners.command import CommandRunner

PLANT = 'printf "%s\\n" "$2" > "$1"'


async def plant(db: str, workspace: str, target: str, line: str, *read_write: str) -> None:
    argv = ["/bin/sh", "-c", PLANT, "sh", target, line]
    runner = CommandRunner({"plant": argv}, read_write=read_write)
    async with Engine(f"sqlite:///{db}", runner=runner) as engine:
        child = await start(engine, "plant", workspace)
        while (record := await engine.get_child(child.conversation_id)) and not record.terminal:
            await asyncio.sleep(0.02)
        assert record is not None
        events = await engine.events(child.conversation_id)
        print(json.dumps({"error": record.error, "events": len(events)}), flush=True)


if __name__ == "__main__":
    asyncio.run(plant(*sys.argv[2:]))
