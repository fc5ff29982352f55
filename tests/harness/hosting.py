"""What the host scripts the kill tests start by path share (``*_host.py``): the tool call
their children start under, a leased child started under it, and the ``READY`` line after
which a host serves until it is killed.

A script run by path has this directory first on ``sys.path``, so it imports this module
as ``hosting``::

    from hosting import OWNER, PRESET, ready, say, start_child
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

from delegation import Engine, Params, Preset, Request, Result, RunnerConnection

OWNER = {"run_id": "parent-run", "tool_call_id": "call-1", "extension_id": "ext"}
PRESET = Preset(name="worker", extension_id="ext", generation=7)


def say(line: str) -> None:
    """One line to the test reading this host's stdout, at once."""
    print(line, flush=True)


async def open_tool(engine: Engine, workspace: str = "/tmp") -> RunnerConnection:
    """Connect the runner to the open ``engine`` and open the tool call these hosts start
    their children under (its ids are ``OWNER``, its one preset ``PRESET``)."""
    conn = await engine.connect("runner-1", "host-a")
    await engine.open_tool(
        conn, conversation_id="parent-conv", presets=[PRESET], workspace=workspace, **OWNER
    )
    return conn


async def start_child(
    engine: Engine,
    conn: RunnerConnection,
    request_id: str,
    message: str,
    lease: str,
) -> Result:
    """``child.start`` of one leased child of the profile ``worker`` under the tool call of
    ``conn``: its Result once it is admitted."""
    request = Request(request_id=request_id, profile="worker", message=message, lease_id=lease)
    params = Params(**OWNER, generation=7, lease_id=lease, request=request)
    return await engine.start(conn, params)


async def ready() -> NoReturn:
    """Say ``READY`` and serve until the test kills this host."""
    say("READY")
    await asyncio.Event().wait()
    raise AssertionError("unreachable: the event is never set")
