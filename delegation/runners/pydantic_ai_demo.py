"""The agent of ``delegation demo --runner pydantic-ai``: a real pydantic-ai ``Agent`` on
a scripted model (``FunctionModel``; no network, no credentials).

It surveys a few files, one ``read_file`` tool call per model request, and follows the
latest steer it was given. Each answered request and each finished tool call appends
one line to the file named by ``DELEGATION_DEMO_COUNTS`` (if set), so the tour can
count them before a crash and after the resume. ``DELEGATION_DEMO_DELAY`` sets the pace.

The tour's host loads it through serve's factory, as a host would its own agents::

    DELEGATION_PYDANTIC_AI_AGENTS=delegation.runners.pydantic_ai_demo:AGENTS \\
        delegation serve --runner delegation.runners.pydantic_ai:from_module
"""

from __future__ import annotations

import asyncio
import os

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

COUNTS_ENV = "DELEGATION_DEMO_COUNTS"
DELAY_ENV = "DELEGATION_DEMO_DELAY"
FILES = ("engine.py", "journal.py", "store.py", "runs.py", "serve.py")


def _count(line: str) -> None:
    path = os.environ.get(COUNTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as counts:
            counts.write(line + "\n")


def _delay() -> float:
    return float(os.environ.get(DELAY_ENV, "0.4"))


def _heading(messages: list[ModelMessage]) -> str:
    """The latest user prompt: the task, or the steer that came after it."""
    prompts = [
        str(part.content)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, UserPromptPart)
    ]
    return prompts[-1] if prompts else ""


async def _answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    n = sum(isinstance(message, ModelResponse) for message in messages) + 1
    await asyncio.sleep(_delay())  # the model thinking
    heading = _heading(messages)
    if n <= len(FILES) and info.function_tools:
        name = FILES[n - 1]
        parts: list[TextPart | ToolCallPart] = [
            TextPart(f"request {n}: reading {name}, on {heading!r}"),
            ToolCallPart("read_file", {"path": name}, tool_call_id=f"read-{n}"),
        ]
    else:
        parts = [TextPart(f"surveyed {n - 1} files, with {heading!r} in mind")]
    _count(f"model {n}")
    return ModelResponse(parts=parts, model_name="scripted")


def survey_agent() -> Agent[None, str]:
    """A fresh agent (the runner calls this factory for each run)."""
    agent: Agent[None, str] = Agent(FunctionModel(_answer, model_name="scripted"))

    @agent.tool_plain
    async def read_file(path: str) -> str:
        """Read one file of the repository (the demo pretends)."""
        await asyncio.sleep(_delay() / 2)
        _count(f"tool {path}")
        return f"{path}: {10 * (FILES.index(path) + 1) if path in FILES else 0} lines"

    return agent


AGENTS = {"agent": survey_agent}
