"""A host process for the pydantic-ai runner's crash tests (design §16): a leased child
whose agent (a ``FunctionModel``, no network) makes four model requests and four tool
calls; each request and each call appends a line to a log file (its effect outside the
database), so a test can count how often each ran.

    python tests/harness/pydantic_ai_host.py URL LOG STOP [--start]

The model's answers, by request: 1 calls ``add`` (c1); 2 calls ``add`` (c2) and ``grep``
(c3) at once; 3 calls ``add`` (c4); 4 answers "all done". ``STOP`` says where this host
stops so the test can kill it there with SIGKILL: ``model`` (inside request 3, after
its effect), ``tool`` (inside call c4, after its effect), or ``none``. The host prints
``AT <where>`` where it stops, ``DONE <conversation>`` when the child's run returns,
and ``READY``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from hosting import (  # this script's own directory is first on sys.path
    open_tool,
    ready,
    say,
    start_child,
)
from pydantic_ai import Agent, models
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from delegation import ChildContext, Engine, EngineConfig, Preset, Request
from delegation.run.context import Run
from delegation.runners.pydantic_ai import PydanticAIRunner

LEASE = "lease-agent"
ANSWERS: list[list[Any]] = [
    [ToolCallPart("add", {"a": 1, "b": 1}, tool_call_id="c1")],
    [
        ToolCallPart("add", {"a": 2, "b": 2}, tool_call_id="c2"),
        ToolCallPart("grep", {"pattern": "x"}, tool_call_id="c3"),
    ],
    [TextPart("one more"), ToolCallPart("add", {"a": 3, "b": 3}, tool_call_id="c4")],
    [TextPart("all done")],
]


def effect(log: str, line: str) -> None:
    with open(log, "a") as out:
        out.write(line + "\n")
        out.flush()
        os.fsync(out.fileno())


def agent(log: str, stop: str) -> Agent[None, str]:
    async def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        n = sum(isinstance(m, ModelResponse) for m in messages) + 1
        effect(log, f"model {n}")
        if stop == "model" and n == 3:
            say("AT model")
            await asyncio.Event().wait()
        return ModelResponse(parts=ANSWERS[n - 1])

    worker: Agent[None, str] = Agent(FunctionModel(answer))

    @worker.tool_plain
    async def add(a: int, b: int) -> int:
        """Add two numbers."""
        effect(log, f"tool add {a} {b}")
        if stop == "tool" and a == 3:
            say("AT tool")
            await asyncio.Event().wait()
        return a + b

    @worker.tool_plain
    async def grep(pattern: str) -> str:
        """Search."""
        effect(log, f"tool grep {pattern}")
        return f"found {pattern}"

    return worker


class Announcing:
    """The pydantic-ai runner, saying when a child's run returns."""

    def __init__(self, inner: PydanticAIRunner) -> None:
        self.inner = inner

    async def prepare(self, request: Request, preset: Preset, identity: Any, recovery: Any) -> Run:
        run = await self.inner.prepare(request, preset, identity, recovery)

        async def announced(ctx: ChildContext) -> None:
            await run(ctx)
            say(f"DONE {ctx.identity.conversation_id}")

        return announced


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(lease_lifetime_s=3600.0, release_drain_s=5.0)
    runner = Announcing(PydanticAIRunner({"worker": agent(args.log, args.stop)}))
    engine = Engine(args.url, runner=runner, config=config)
    await engine.open()
    if args.start:
        conn = await open_tool(engine)
        result = await start_child(engine, conn, "q-agent", "add", LEASE)
        say(f"STARTED {result.conversation_id}")
    await ready()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("log")
    parser.add_argument("stop", choices=["model", "tool", "none"])
    parser.add_argument("--start", action="store_true")
    models.ALLOW_MODEL_REQUESTS = False  # only the function model answers: no network
    asyncio.run(main(parser.parse_args()))
