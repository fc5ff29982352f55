"""What other tests use of engine/test_methods.py, kept here so that no test module imports
another: open_tool, release, steer."""

from __future__ import annotations

import dataclasses
from typing import Any

from delegation import Preset
from tests.harness.support import PRESET, Harness


async def open_tool(
    h: Harness,
    tool_call_id: str,
    *,
    run_id: str = "parent-run",
    conversation_id: str = "parent-conv",
    extension_id: str = PRESET.extension_id,
    presets: tuple[Preset, ...] = (PRESET,),
    workspace: str | None = None,
    conn: Any = None,
) -> Harness:
    """A harness on another tool call (of the same runner unless ``conn`` is given)."""
    conn = conn or h.conn
    tool = await h.engine.open_tool(
        conn,
        run_id=run_id,
        conversation_id=conversation_id,
        tool_call_id=tool_call_id,
        extension_id=extension_id,
        presets=list(presets),
        workspace=workspace or h.workspace,
    )
    return dataclasses.replace(h, tool=tool, conn=conn)


async def steer(h: Harness, child_id: str, request_id: str, message: str, **changes: Any) -> Any:
    params = h.params(child_id=child_id, request_id=request_id, message=message, **changes)
    return await h.engine.call(h.conn, "child.steer", params)


async def release(h: Harness, lease_id: str) -> Any:
    return await h.engine.call(h.conn, "child.lease.release", h.params(lease_id=lease_id))
