"""What other tests use of runners/test_command_confinement.py, kept here so that no test
module imports another: _ended."""

from __future__ import annotations

import asyncio

from delegation import Engine


async def _ended(engine: Engine, conversation_id: str):  # type: ignore[no-untyped-def]
    while (record := await engine.get_child(conversation_id)) and not record.terminal:
        await asyncio.sleep(0.01)
    return record
