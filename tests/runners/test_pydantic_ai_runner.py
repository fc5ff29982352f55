"""The pydantic-ai runner (design §16) through a real Engine, on pydantic-ai's own test
models only: ``FunctionModel`` answers from the test's function, which counts and keeps
every request it is asked; model requests to anything else are refused (no network).

Hosts killed with SIGKILL mid-run are in ``test_pydantic_ai_crash.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.harness.pydantic_ai_support import require_pydantic_ai

require_pydantic_ai()

from pydantic_ai import Agent, models  # noqa: E402
from pydantic_ai.messages import (  # noqa: E402
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: E402

from delegation import Engine, EngineConfig, ExecutionOptions, Preset  # noqa: E402
from delegation.runners import pydantic_ai as runner_module  # noqa: E402
from delegation.runners.pydantic_ai import PydanticAIRunner, UnknownAgent  # noqa: E402
from tests.harness import rows  # noqa: E402
from tests.harness.support import Harness, identity, open_harness  # noqa: E402

GENERATION = 7
PRESET = Preset(name="worker", extension_id="ext", generation=GENERATION)


@pytest.fixture(autouse=True)
def no_model_requests() -> Iterator[None]:
    """Only the test's own models answer: a real model's request raises."""
    with models.override_allow_model_requests(False):
        yield


class Script:
    """A FunctionModel's function: each request is kept (its user prompts, the tools
    offered, the instructions) and answered by ``answers`` in turn."""

    def __init__(self, *answers: ModelResponse) -> None:
        self.answers = list(answers)
        self.requests: list[list[ModelMessage]] = []
        self.tools: list[list[str]] = []
        self.instructions: list[str | None] = []

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append(list(messages))
        self.tools.append([tool.name for tool in info.function_tools])
        self.instructions.append(info.instructions)
        index = min(len(self.requests), len(self.answers)) - 1
        return self.answers[index]

    def prompts(self, request: int = -1) -> list[str]:
        """Every user prompt in the request's messages, oldest first."""
        return [
            str(part.content)
            for message in self.requests[request]
            if isinstance(message, ModelRequest)
            for part in message.parts
            if isinstance(part, UserPromptPart)
        ]


def call(tool: str, call_id: str, **args: Any) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart(tool, args, tool_call_id=call_id)])


def text(words: str) -> ModelResponse:
    return ModelResponse(parts=[TextPart(words)])


def agent_of(script: Script, ran: list[str] | None = None) -> Agent[None, str]:
    agent: Agent[None, str] = Agent(FunctionModel(script))
    ran = ran if ran is not None else []

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        ran.append(f"add {a} {b}")
        return a + b

    @agent.tool_plain
    def grep(pattern: str) -> str:
        """Search."""
        ran.append(f"grep {pattern}")
        return f"found {pattern}"

    return agent


@contextlib.asynccontextmanager
async def hosted(
    db_url: str, workspace: Path, runner: PydanticAIRunner, presets: Sequence[Preset] = (PRESET,)
) -> AsyncIterator[Harness]:
    config = EngineConfig(release_drain_s=2.0)
    async with Engine(db_url, runner=runner, config=config) as engine:
        yield await open_harness(engine, runner, workspace, list(presets))


async def finished(h: Harness, conversation_id: str) -> Any:
    record = await h.wait_done(conversation_id, timeout=20)
    return record


async def events(h: Harness, conversation_id: str) -> list[Any]:
    return [e for e in await h.engine.events(conversation_id, limit=1000) if e.kind != "start"]


# --- the mapping -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "offered"),
    [
        (None, ["add", "grep"]),
        (ExecutionOptions(allowed_tools=["grep"]), ["grep"]),
        (ExecutionOptions(allowed_tools=[]), []),
        (ExecutionOptions(no_tools=True), []),
        (ExecutionOptions(allowed_tools=["add", "grep"], no_tools=True), []),
    ],
)
async def test_the_tools_offered_follow_the_ceiling(
    db_url: str, workspace: Path, options: ExecutionOptions | None, offered: list[str]
) -> None:
    script = Script(text("nothing to do"))
    runner = PydanticAIRunner({"worker": agent_of(script)})
    async with hosted(db_url, workspace, runner) as h:
        changes: dict[str, Any] = {} if options is None else {"options": options}
        started = await h.start("q1", message="look", **changes)
        record = await finished(h, started.conversation_id)
    assert (record.state, record.output) == ("done", "nothing to do")
    assert script.tools == [offered]


async def test_a_preset_narrowing_the_tools_narrows_them_too(db_url: str, workspace: Path) -> None:
    script = Script(text("ok"))
    preset = Preset(
        name="worker",
        extension_id="ext",
        generation=GENERATION,
        options=ExecutionOptions(allowed_tools=["add"]),
        system_prompt="You are terse.",
    )
    runner = PydanticAIRunner({"worker": lambda: agent_of(script)})
    async with hosted(db_url, workspace, runner, [preset]) as h:
        started = await h.start("q1", message="look")
        await finished(h, started.conversation_id)
    assert script.tools == [["add"]]
    assert script.instructions == ["You are terse."]
    assert script.prompts() == ["look"]


async def test_events_are_text_tool_use_tool_result_and_result(
    db_url: str, workspace: Path
) -> None:
    script = Script(
        ModelResponse(
            parts=[TextPart("adding"), ToolCallPart("add", {"a": 1, "b": 2}, tool_call_id="c1")]
        ),
        text("the sum is 3"),
    )
    ran: list[str] = []
    runner = PydanticAIRunner({"worker": agent_of(script, ran)})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="add 1 and 2", system_prompt="Be exact.")
        record = await finished(h, started.conversation_id)
        seen = await events(h, started.conversation_id)
    assert (record.state, record.output) == ("done", "the sum is 3")
    assert ran == ["add 1 2"]
    assert [(e.kind, e.text) for e in seen] == [
        ("text", "adding"),
        ("tool-use", ""),
        ("tool-result", ""),
        ("text", "the sum is 3"),
        ("result", "the sum is 3"),
    ]
    use, result = seen[1], seen[2]
    assert (use.tool_name, use.tool_call_id, json.loads(use.input)) == (
        "add",
        "c1",
        {"a": 1, "b": 2},
    )
    assert (result.tool_name, result.tool_call_id, result.tool_output, result.success) == (
        "add",
        "c1",
        "3",
        True,
    )
    assert script.instructions == ["Be exact.", "Be exact."]


async def test_a_failing_tool_is_a_tool_result_without_success(
    db_url: str, workspace: Path
) -> None:
    script = Script(call("broken", "c1"), text("gave up"))
    agent: Agent[None, str] = Agent(FunctionModel(script))

    @agent.tool_plain
    def broken() -> str:
        """Fails."""
        raise ValueError("the disk is gone")

    runner = PydanticAIRunner({"worker": agent})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="try")
        record = await finished(h, started.conversation_id)
        seen = await events(h, started.conversation_id)
    assert record.state == "done"
    (failed,) = [e for e in seen if e.kind == "tool-result"]
    assert (failed.tool_call_id, failed.success) == ("c1", False)
    assert "the disk is gone" in failed.tool_output


async def test_max_turns_is_the_request_limit(db_url: str, workspace: Path) -> None:
    script = Script(call("grep", "c1", pattern="a"), call("grep", "c2", pattern="b"), text("x"))
    runner = PydanticAIRunner({"worker": agent_of(script)})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="look", options=ExecutionOptions(max_turns=1))
        record = await finished(h, started.conversation_id)
    assert record.state == "done"
    assert "request_limit" in record.error or "request limit" in record.error
    assert len(script.requests) == 1


async def test_max_tokens_reaches_the_model_settings(db_url: str, workspace: Path) -> None:
    seen: list[Any] = []

    async def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append((info.model_settings or {}).get("max_tokens"))
        return text("short")

    runner = PydanticAIRunner({"worker": Agent(FunctionModel(answer))})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="look", options=ExecutionOptions(max_tokens=50))
        record = await finished(h, started.conversation_id)
    assert (record.state, seen) == ("done", [50])


async def test_an_unknown_preset_fails_in_prepare(db_url: str, workspace: Path) -> None:
    runner = PydanticAIRunner({"other": agent_of(Script(text("x")))})
    with pytest.raises(UnknownAgent):
        await runner.prepare(*_prepare_args())


def _prepare_args() -> tuple[Any, ...]:
    from delegation import Request

    return Request(request_id="q", profile="worker", message="m"), PRESET, identity(), None


# --- steers, cancellation, follow-ups -----------------------------------------------


async def test_a_steer_reaches_the_model_at_its_next_request(db_url: str, workspace: Path) -> None:
    script = Script(call("wait", "c1"), text("turned left"))
    agent: Agent[None, str] = Agent(FunctionModel(script))
    waiting, go = asyncio.Event(), asyncio.Event()

    @agent.tool_plain
    async def wait() -> str:
        """Wait."""
        waiting.set()
        await go.wait()
        return "waited"

    runner = PydanticAIRunner({"worker": agent})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="go somewhere")
        await asyncio.wait_for(waiting.wait(), 10)
        steered = await h.engine.call(
            h.conn,
            "child.steer",
            h.params(child_id=started.conversation_id, request_id="s1", message="go left"),
        )
        assert steered.outcome == "injected"
        await asyncio.sleep(0.2)  # the steer reaches the run's queue
        go.set()
        record = await finished(h, started.conversation_id)
    assert record.output == "turned left"
    assert script.prompts(0) == ["go somewhere"]
    assert script.prompts(1) == ["go somewhere", "go left"]


async def test_cancellation_stops_the_agent_at_once(db_url: str, workspace: Path) -> None:
    script = Script(call("hang", "c1"), text("never"))
    agent: Agent[None, str] = Agent(FunctionModel(script))
    hanging = asyncio.Event()

    @agent.tool_plain
    async def hang() -> str:
        """Hang."""
        hanging.set()
        await asyncio.Event().wait()
        return "no"

    runner = PydanticAIRunner({"worker": agent})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="hang")
        await asyncio.wait_for(hanging.wait(), 10)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await h.engine.call(h.conn, "child.cancel", h.params(child_id=started.conversation_id))
        record = await h.wait_done(started.conversation_id, timeout=10)
        assert record.state == "cancelled"
        assert loop.time() - began < 2
    assert len(script.requests) == 1


async def test_a_follow_up_starts_from_the_previous_history(db_url: str, workspace: Path) -> None:
    script = Script(call("add", "c1", a=2, b=2), text("four"), text("and five after that"))
    runner = PydanticAIRunner({"worker": agent_of(script)})
    async with hosted(db_url, workspace, runner) as h:
        first = await h.start("q1", message="add two and two")
        assert (await finished(h, first.conversation_id)).output == "four"
        follow = await h.start("q2", message="and one more?", resume=first.conversation_id)
        assert follow.run_id != first.run_id
        record = await finished(h, follow.conversation_id)
    assert record.output == "and five after that"
    assert script.prompts(2) == ["add two and two", "and one more?"]
    history = script.requests[2]
    returned = [
        part.content for m in history for part in m.parts if part.part_kind == "tool-return"
    ]
    assert returned == [4]
    answered = [part.content for m in history for part in m.parts if isinstance(part, TextPart)]
    assert answered == ["four"]


# --- serve's factory -------------------------------------------------------------------

AGENTS: dict[str, Any] = {}


def test_from_module_loads_a_mapping_named_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    AGENTS["worker"] = agent_of(Script(text("x")))
    monkeypatch.setenv(runner_module.MODULE_ENV, f"{__name__}:AGENTS")
    runner = runner_module.from_module()
    assert list(runner.agents) == ["worker"]
    monkeypatch.setenv(runner_module.MODULE_ENV, "")
    with pytest.raises(ValueError, match=runner_module.MODULE_ENV):
        runner_module.from_module()


# --- a resumed run (graceful restarts; SIGKILL in test_pydantic_ai_crash.py) ------------

LEASE = "lease-1"


async def test_a_resumed_run_replays_its_requests_and_the_steer_they_took(
    db_url: str, workspace: Path
) -> None:
    script = Script(call("add", "c1", a=1, b=1), call("hold", "c2"), text("went left"))
    agent: Agent[None, str] = Agent(FunctionModel(script))
    go, holding, first = asyncio.Event(), asyncio.Event(), [True]
    ran: list[str] = []

    @agent.tool_plain
    async def add(a: int, b: int) -> int:
        """Add."""
        ran.append("add")
        await go.wait()
        return a + b

    @agent.tool_plain
    async def hold() -> str:
        """Hold."""
        ran.append("hold")
        if first[0]:
            holding.set()
            await asyncio.Event().wait()
        return "held"

    runner = PydanticAIRunner({"worker": agent})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="start", lease_id=LEASE)
        child_id = started.conversation_id
        await asyncio.sleep(0.2)
        steered = await h.engine.call(
            h.conn,
            "child.steer",
            h.params(child_id=child_id, request_id="s1", message="go left", lease_id=LEASE),
        )
        assert steered.outcome == "injected"
        await asyncio.sleep(0.2)
        go.set()
        await asyncio.wait_for(holding.wait(), 10)
    first[0] = False
    assert len(script.requests) == 2
    async with hosted(db_url, workspace, runner) as h:
        record = await finished(h, child_id)
        seen = await events(h, child_id)
    assert (record.state, record.output) == ("done", "went left")
    # Requests 1 and 2 and the call c1 had finished: none was made again.
    assert len(script.requests) == 3
    assert ran == ["add", "hold", "hold"]  # c2 was in flight at the close
    assert script.prompts(2) == ["start", "go left"]
    assert [e.tool_call_id for e in seen if e.kind == "tool-use"] == ["c1", "c2"]
    assert [e.kind for e in seen].count("recovery") == 1


def test_importing_delegation_imports_no_pydantic_ai() -> None:
    code = (
        "import sys, delegation, delegation.cli, delegation.cli.demo, delegation.host.serve, "
        "delegation.runners, delegation.runners.command, delegation.runners.scripted; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic_ai'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


# --- design §20: what a replay sees -------------------------------------------------------


async def test_a_model_that_repeats_a_call_id_gets_each_call_run_once(
    db_url: str, workspace: Path
) -> None:
    """Named by the model's id, the second `call_0` got the first call's recorded result:
    the tool never ran and the agent got wrong data, on the first run already. (Within
    one response pydantic-ai itself refuses a repeated id.)"""
    script = Script(
        call("add", "call_0", a=1, b=2),
        call("add", "call_0", a=10, b=20),
        ModelResponse(
            parts=[
                ToolCallPart("grep", {"pattern": "x"}, tool_call_id="call_0"),
                ToolCallPart("grep", {"pattern": "y"}, tool_call_id="call_1"),
            ]
        ),
        text("done"),
    )
    ran: list[str] = []
    runner = PydanticAIRunner({"worker": agent_of(script, ran)})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="add twice")
        record = await finished(h, started.conversation_id)
        seen = await events(h, started.conversation_id)
    sql = "SELECT name FROM steps WHERE child_id = :c AND name LIKE 'tool %' ORDER BY name"
    steps = [name for (name,) in rows.rows(db_url, sql, {"c": record.id})]
    assert record.state == "done"
    assert sorted(ran) == ["add 1 2", "add 10 20", "grep x", "grep y"]
    outputs = [e.tool_output for e in seen if e.kind == "tool-result"]
    assert sorted(outputs) == ["3", "30", "found x", "found y"]
    assert steps == ["tool 1.1", "tool 2.1", "tool 3.1", "tool 3.2"]
    # What the model was given back for each call: its own result, never the first's.
    returned = [
        part.content
        for message in script.requests[-1]
        if isinstance(message, ModelRequest)
        for part in message.parts
        if getattr(part, "part_kind", "") == "tool-return"
    ]
    assert returned == [3, 30, "found x", "found y"]


async def test_a_tool_result_over_max_step_bytes_is_dropped_and_the_child_goes_on(
    db_url: str, workspace: Path
) -> None:
    """It ended the whole child (step_too_large) after the tool had run."""
    script = Script(call("dump", "c1"), text("asked for less"))
    agent: Agent[None, str] = Agent(FunctionModel(script))
    ran: list[str] = []

    @agent.tool_plain
    def dump() -> str:
        """Returns a lot."""
        ran.append("dump")
        return "x" * 10000

    runner = PydanticAIRunner({"worker": agent})
    config = EngineConfig(release_drain_s=2.0, max_step_bytes=4096)
    async with Engine(db_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace, [PRESET])
        started = await h.start("q1", message="dump it")
        record = await finished(h, started.conversation_id)
        seen = await events(h, started.conversation_id)
    assert (record.state, record.error, record.output) == ("done", "", "asked for less")
    assert ran == ["dump"]
    (result,) = [e for e in seen if e.kind == "tool-result"]
    note = runner_module.oversize_note("dump", 10002, 4096)
    assert (result.success, result.tool_output) == (False, note)
    returned = [
        part.content
        for message in script.requests[-1]
        if isinstance(message, ModelRequest)
        for part in message.parts
        if getattr(part, "part_kind", "") == "tool-return"
    ]
    assert returned == [note]


# --- design §21: approvals -------------------------------------------------------------


@pytest.mark.parametrize("decision", ["approve", "deny"])
async def test_a_tool_that_needs_approval_asks_a_person_and_repeats_no_model_request(
    db_url: str, workspace: Path, decision: str
) -> None:
    script = Script(call("wipe", "c1", path="/data"), text("all done"))
    agent: Agent[None, str] = Agent(FunctionModel(script))
    ran: list[str] = []

    @agent.tool_plain(requires_approval=True)
    def wipe(path: str) -> str:
        """Deletes a folder."""
        ran.append(path)
        return f"wiped {path}"

    runner = PydanticAIRunner({"worker": agent})
    config = EngineConfig(release_drain_s=2.0, hold_s=0.2)
    async with Engine(db_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace, [PRESET])
        started = await h.start("q1", message="wipe /data", lease_id="lease-1")
        cid = started.conversation_id
        for _ in range(500):  # it asks, then waits holding nothing
            record = await engine.get_child(cid)
            if record is not None and record.state == "waiting":
                break
            await asyncio.sleep(0.02)
        read = await h.read(cid, lease_id="lease-1", tool_call_id="")
        (ask,) = read.input_requests.values()
        assert list(read.input_requests) == ["approval 1.1"]
        assert (ask.kind, ask.tool_name, ask.tool_call_id) == ("approval", "wipe", "c1")
        assert json.loads(ask.input) == {"path": "/data"}
        await engine.answer_input(cid, "approval 1.1", decision=decision)
        record = await finished(h, cid)
        seen = await events(h, cid)
    assert (record.state, record.output) == ("done", "all done")
    assert len(script.requests) == 2  # the first request was replayed on the wake
    assert ran == (["/data"] if decision == "approve" else [])
    returned = [
        part.content
        for message in script.requests[-1]
        if isinstance(message, ModelRequest)
        for part in message.parts
        if getattr(part, "part_kind", "") == "tool-return"
    ]
    assert returned == (["wiped /data"] if decision == "approve" else ["The tool call was denied."])
    kinds = [e.kind for e in seen]
    assert kinds[:2] == ["tool-use", "input-required"] and "recovery" in kinds
