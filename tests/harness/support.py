"""Test helpers: a controllable runner and a small harness around a real Engine.

Nothing here stands in for the library's own code: the engine, the store and the
migrations are the real ones, on a real SQLite file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from delegation import (
    ChildContext,
    Engine,
    Event,
    ExecutionOptions,
    Identity,
    Params,
    Preset,
    Recovery,
    Request,
    RunnerConnection,
    ToolHandle,
)

Script = Callable[[ChildContext], Awaitable[None]]


def identity() -> Identity:
    """A child's identity for tests that call a runner or a context directly."""
    return Identity(
        conversation_id="c-1",
        run_id="r-1",
        parent_conversation_id="pc",
        parent_run_id="pr",
        extension_id="ext",
        profile="worker",
    )


async def until_exists(path: Path, timeout_s: float = 10.0, pause_s: float = 0.05) -> None:
    """Return once ``path`` exists (a host's socket), or after about ``timeout_s``: the
    caller's next step then fails on its own."""
    for _ in range(round(timeout_s / pause_s)):
        if path.exists():
            return
        await asyncio.sleep(pause_s)


async def finish_after_admit(ctx: ChildContext) -> None:
    await ctx.admit()
    ctx.emit(Event(kind="result", text=f"done: {ctx.request.message}"))


def hold(gate: asyncio.Event) -> Script:
    """A run that admits, then waits for ``gate`` (or cancellation) before finishing."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="working"))
        await gate.wait()
        ctx.emit(Event(kind="result", text="finished"))

    return run


@dataclass
class Prepared:
    request: Any
    preset: Preset
    identity: Identity
    recovery: Recovery | None


@dataclass
class ScriptRunner:
    """A runner whose runs follow ``script``; it records every prepare call."""

    script: Script = finish_after_admit
    prepare_error: BaseException | None = None
    prepared: list[Prepared] = field(default_factory=list)
    started: int = 0

    async def prepare(
        self, request: Any, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Script:
        self.prepared.append(Prepared(request, preset, identity, recovery))
        if self.prepare_error is not None:
            raise self.prepare_error
        script = self.script

        async def run(ctx: ChildContext) -> None:
            self.started += 1
            await script(ctx)

        return run


PRESET = Preset(name="worker", extension_id="ext", generation=7)


@dataclass
class Harness:
    """One engine, one connected runner, one open tool call: the usual starting point."""

    engine: Engine
    runner: ScriptRunner
    conn: RunnerConnection
    tool: ToolHandle
    workspace: str

    def params(self, **changes: Any) -> Params:
        base: dict[str, Any] = {
            "run_id": self.tool.run_id,
            "tool_call_id": self.tool.tool_call_id,
            "extension_id": self.tool.extension_id,
            "generation": PRESET.generation,
        }
        return Params(**{**base, **changes})

    def start_params(self, request_id: str = "q1", **changes: Any) -> Params:
        request_fields = {
            k: changes.pop(k)
            for k in list(changes)
            if k
            in (
                "message",
                "profile",
                "context_mode",
                "resume",
                "cwd",
                "options",
                "system_prompt",
                "rewind",
            )
        }
        request = Request(
            request_id=request_id,
            profile=request_fields.pop("profile", PRESET.name),
            message=request_fields.pop("message", "do the task"),
            lease_id=changes.get("lease_id", ""),
            **request_fields,
        )
        return self.params(request=request, **changes)

    async def start(self, request_id: str = "q1", **changes: Any) -> Any:
        return await self.engine.call(
            self.conn, "child.start", self.start_params(request_id, **changes)
        )

    async def read(self, child_id: str, **changes: Any) -> Any:
        return await self.engine.call(
            self.conn, "child.read", self.params(child_id=child_id, **changes)
        )

    async def wait_done(self, child_id: str, timeout: float = 60.0, **changes: Any) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            record = await self.engine.get_child(child_id, changes.get("child_run_id") or None)
            if record is not None and record.terminal:
                return record
            if loop.time() > deadline:
                raise AssertionError(f"child {child_id} did not finish: {record}")
            await asyncio.sleep(0.01)


async def wait_terminal(engine: Engine, conversation_id: str, timeout: float = 60.0) -> Any:
    """The newest execution of the conversation once it is terminal (up to ``timeout``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (record := await engine.get_child(conversation_id)) is None or not record.terminal:
        if loop.time() > deadline:
            raise AssertionError(f"child {conversation_id} did not end: {record}")
        await asyncio.sleep(0.01)
    return record


# JSON numbers no wire integer or float holds, and their edges (decode fuzzing).
HUGE_NUMBERS = [
    b"18446744073709551615",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"9223372036854775808",
    b"1" + b"0" * 5000,
    b"-" + b"9" * 5000,
    b"1e400",
    b"-1e400",
    b"1e-400",
    b"1.0",
    b"0.5",
    b"-0",
    b"-0.0",
    b"1E2",
    b"0." + b"0" * 5000 + b"1",
    b"1" * 400 + b"." + b"1" * 400 + b"e99999999999999999999",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"01",
    b"+1",
    b"0x10",
    b"1_000",
    b"-18446744073709551616",
    b"1" + b"0" * 400,
]


async def open_harness(
    engine: Engine,
    runner: Any,
    workspace: Path | str,
    presets: Sequence[Preset] = (PRESET,),
    policy: ExecutionOptions | None = None,
) -> Harness:
    """Connect the usual runner to ``engine`` and open the usual tool call (``runner``
    is the one ``engine`` was made with)."""
    conn = await engine.connect("runner-1", "host-a")
    tool = await engine.open_tool(
        conn,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-1",
        extension_id=PRESET.extension_id,
        presets=list(presets),
        workspace=str(workspace),
        policy=policy,
    )
    return Harness(engine, runner, conn, tool, str(workspace))
