"""The ``pydantic-ai`` runner (design §16): a preset is a pydantic-ai ``Agent``.

``PydanticAIRunner(agents, version=None, resumes=())`` maps a preset name to an ``Agent``
(or a zero-argument factory of one). The host keeps its models and credentials; a
request carries neither. ``version`` names the code of the agents (design §34: never a
hash of the source), ``resumes`` the older versions it can continue; the engine records
the version of every child it runs (None: unversioned).

* **Mapping**: the request's message is the user prompt; the frozen system prompt (the
  request's, else the preset's) the run's instructions; ``allowedTools`` filters the
  agent's function tools (``[]`` and ``noTools``: none is offered to the model at all);
  ``maxTurns`` is the model-request limit (0: none); ``maxTokens`` the output-token
  limit (of each response, and of the run).
* **Events**: a response's text is a ``text`` event, its tool calls ``tool-use``
  (``toolName``, ``toolCallId``, ``input``), each tool's result ``tool-result``
  (``toolOutput``, ``success``), the final output ``result``.
* **Steers** reach the agent as user messages at its next model request, through
  pydantic-ai's pending-message queue (``enqueue``). Cancellation stops the run at once.
* **Approvals** (design §21): a tool that requires approval (pydantic-ai's deferred
  tools, ``requires_approval=True``) asks a person with ``ctx.ask(kind="approval")``,
  ``approval N.K`` by its place; the child waits holding nothing, and the agent goes on
  with the call approved or denied, no model request made again.
* **Durable** (design §15): every model request and every tool call is a ``ctx.step``
  (``model N``; ``tool N.K``, the K-th call of the response to request N, never named
  by the model's own call id, which some models repeat), and so are the steers each
  request took (``steers N``). A resumed child runs its agent again from the start of the execution;
  each finished request and call returns what it returned before, without reaching the
  model or the tool, and the run continues from the first unfinished one. The final
  message history is the step ``messages``: a follow-up starts from it
  (``ctx.recorded("messages", run_id=ctx.previous_run_id)``). Only messages are stored,
  never a model or a credential. A tool's result is journaled as JSON: the agent sees
  the JSON form of what a tool returned, on the first run as on a resumed one. A result
  over ``max_step_bytes`` is not kept: the model gets a note that says so (a
  ``tool-result`` without success), is asked for less, and the child goes on.

Hazard: a tool that was running when the host died runs again on the resume (what it
did outside the database is at-least-once, design §15); make tools idempotent by their
``tool_call_id`` where that matters.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.capabilities import (
    AbstractCapability,
    ValidatedToolArgs,
    WrapModelRequestHandler,
    WrapToolExecuteHandler,
)
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models import Model, ModelRequestContext, ModelRequestParameters
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import (
    DeferredToolApprovalResult,
    DeferredToolRequests,
    DeferredToolResults,
    RunContext,
    ToolDefinition,
    ToolDenied,
)
from pydantic_ai.usage import UsageLimits
from pydantic_core import to_json, to_jsonable_python

from delegation.config import check_version
from delegation.options import ExecutionOptions
from delegation.run.context import ChildContext, Recovery, Run
from delegation.usecases.redaction import redact_secrets
from delegation.wire import Event, Identity, Preset, Request

AgentSource = Agent[Any, Any] | Callable[[], Agent[Any, Any]]
MESSAGES_STEP = "messages"
MODULE_ENV = "DELEGATION_PYDANTIC_AI_AGENTS"

__all__ = ["PydanticAIRunner", "UnknownAgent", "from_module"]


class UnknownAgent(LookupError):
    """No agent is configured for the requested preset (raised by ``prepare``)."""


class PydanticAIRunner:
    """Runs each preset's pydantic-ai agent as a child (see the module docstring)."""

    def __init__(
        self,
        agents: Mapping[str, AgentSource],
        *,
        version: str | None = None,
        resumes: Iterable[str] = (),
    ) -> None:
        """Raises ``ValueError``: no agent, one that is neither an Agent nor a factory,
        or a version that may name none (1 to 128 printable bytes)."""
        if not isinstance(agents, Mapping) or not agents:
            raise ValueError("the pydantic-ai runner needs at least one agent")
        for name, agent in agents.items():
            if not isinstance(agent, Agent) and not callable(agent):
                raise ValueError(f"preset {name!r}: not an Agent nor a factory of one")
        self.agents: Mapping[str, AgentSource] = dict(agents)
        self.version = None if version is None else check_version(version)
        if isinstance(resumes, str | bytes) or not isinstance(resumes, Iterable):
            raise ValueError(f"resumes must be a sequence of runner versions, not {resumes!r}")
        self.resumes = tuple(dict.fromkeys(check_version(older) for older in resumes))

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        """Freeze one run: the agent (a factory is called here), the prompt, the
        instructions and the ceilings. Starts nothing; raises :class:`UnknownAgent`."""
        source = self.agents.get(preset.name)
        if source is None:
            raise UnknownAgent(f"the pydantic-ai runner has no agent for preset {preset.name!r}")
        agent = source if isinstance(source, Agent) else source()
        if not isinstance(agent, Agent):
            raise TypeError(f"the factory of preset {preset.name!r} returned no Agent")
        options = request.options if isinstance(request.options, ExecutionOptions) else None
        return AgentRun(
            agent=agent,
            prompt=request.message,
            instructions=request.system_prompt or preset.system_prompt or None,
            options=options or ExecutionOptions(),
            identity=identity,
            delivered=recovery.delivered_steers if recovery is not None else (),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class AgentRun:
    """One prepared run; calling it with the child's context runs the agent."""

    agent: Agent[Any, Any]
    prompt: str
    instructions: str | None
    options: ExecutionOptions
    identity: Identity
    delivered: tuple[str, ...]

    def limits(self) -> tuple[UsageLimits, ModelSettings | None]:
        """``maxTurns`` as the request limit (0: none), ``maxTokens`` as the output limit."""
        turns = self.options.max_turns
        tokens = self.options.max_tokens
        requests = turns if isinstance(turns, int) and turns > 0 else None
        output = tokens if isinstance(tokens, int) else None
        settings = ModelSettings(max_tokens=output) if output is not None else None
        return UsageLimits(request_limit=requests, output_tokens_limit=output), settings

    async def __call__(self, ctx: ChildContext) -> None:
        history = await _history(ctx)
        limits, settings = self.limits()
        journal = Journaled(ctx, self.options, self.delivered)
        await ctx.admit()  # before the first model request
        result = await self.agent.run(
            self.prompt,
            message_history=history,
            instructions=self.instructions,
            usage_limits=limits,
            model_settings=settings,
            capabilities=[journal],
            run_id=self.identity.run_id,
            conversation_id=self.identity.conversation_id,
        )

        async def finish() -> bytes:
            output = result.output
            words = output if isinstance(output, str) else _json(output)
            ctx.emit(Event(kind="result", text=words))
            return ModelMessagesTypeAdapter.dump_json(result.all_messages())

        await ctx.step(MESSAGES_STEP, finish)


async def _history(ctx: ChildContext) -> list[ModelMessage] | None:
    """The message history a follow-up continues: the previous execution's last."""
    if ctx.previous_run_id is None:
        return None
    stored = await ctx.recorded(MESSAGES_STEP, run_id=ctx.previous_run_id)
    if stored is None:
        return None
    return ModelMessagesTypeAdapter.validate_json(stored)


@dataclasses.dataclass(init=False)
class Journaled(AbstractCapability[Any]):
    """The capability that makes an agent run a child's: its tools filtered by the
    options, its steers queued before each request, its requests and tool calls steps."""

    ctx: ChildContext
    options: ExecutionOptions
    delivered: tuple[str, ...]

    def __init__(
        self, ctx: ChildContext, options: ExecutionOptions, delivered: tuple[str, ...]
    ) -> None:
        self.ctx = ctx
        self.options = options
        self.delivered = delivered
        self._requests = 0  # model requests answered (made or replayed)
        self._turns = 0  # request steps begun
        self._replayed: list[str] = []  # steers the replayed steps had taken
        # The last response's tool calls, and the positions of those given a step name:
        # a call is named by where it stands, never by the model's id (design §20).
        self._calls: list[ToolCallPart] = []
        self._named: set[int] = set()
        self._asked: set[int] = set()  # the same for approvals

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None

    async def prepare_tools(
        self, ctx: RunContext[Any], tool_defs: list[ToolDefinition]
    ) -> list[ToolDefinition]:
        return [tool for tool in tool_defs if self.options.tool_allowed(tool.name)]

    def get_wrapper_model(self, model: Model) -> Model | None:
        return JournaledModel(model, self)

    async def wrap_model_request(
        self,
        ctx: RunContext[Any],
        *,
        request_context: ModelRequestContext,
        handler: WrapModelRequestHandler,
    ) -> ModelResponse:
        self._turns += 1
        steers = await self.ctx.step(f"steers {self._turns}", self._take_steers, type=list[str])
        self._replayed.extend(steers)
        if steers:
            ctx.enqueue(*steers)
        return await handler(request_context)

    async def _take_steers(self) -> list[str]:
        """The steers this request carries: first those an earlier attempt was handed
        and no recorded step holds (the host died in between), then the new ones."""
        missing = list(self.delivered)
        for steer in self._replayed:
            if steer in missing:
                missing.remove(steer)
        self.delivered = ()
        return [*missing, *self.ctx.take_steers()]

    async def request(
        self,
        model: Model,
        messages: list[ModelMessage],
        settings: ModelSettings | None,
        parameters: ModelRequestParameters,
    ) -> ModelResponse:
        """One model request as a step: made once, its response journaled as JSON."""
        name = f"model {self._requests + 1}"
        parameters = self._narrowed(parameters)

        async def ask() -> bytes:
            response = await model.request(messages, settings, parameters)
            self._emit_response(response)
            return ModelMessagesTypeAdapter.dump_json([response])

        stored = await self.ctx.step(name, ask)
        self._requests += 1
        (response,) = ModelMessagesTypeAdapter.validate_json(stored)
        assert isinstance(response, ModelResponse)
        self._calls = [part for part in response.parts if isinstance(part, ToolCallPart)]
        self._named, self._asked = set(), set()
        return response

    def _position(self, call: ToolCallPart, used: set[int]) -> str:
        """``N.K``: the K-th tool call of the response to model request N. A model may
        give every call the same id (``call_0`` each turn): the position tells them
        apart, on the first run as on a replay, whatever order they run in."""
        found = next((k for k, c in enumerate(self._calls) if c is call), None)
        if found is None or found in used:  # a copy of the part: the first equal one
            same = (call.tool_name, call.tool_call_id, call.args)
            found = next(
                (
                    k
                    for k, c in enumerate(self._calls)
                    if k not in used and (c.tool_name, c.tool_call_id, c.args) == same
                ),
                len(self._calls) + len(used),
            )
        used.add(found)
        return f"{self._requests}.{found + 1}"

    def _narrowed(self, parameters: ModelRequestParameters) -> ModelRequestParameters:
        """Native (provider-side) tools pass the same ceiling as function tools."""
        native = [t for t in parameters.native_tools if self.options.tool_allowed(t.kind)]
        if len(native) == len(parameters.native_tools):
            return parameters
        return dataclasses.replace(parameters, native_tools=native)

    def _emit_response(self, response: ModelResponse) -> None:
        for part in response.parts:
            if isinstance(part, TextPart) and part.content:
                self.ctx.emit(Event(kind="text", text=part.content))
            elif isinstance(part, ToolCallPart):
                self.ctx.emit(
                    Event(
                        kind="tool-use",
                        tool_name=part.tool_name,
                        tool_call_id=part.tool_call_id,
                        input=part.args_as_json_str(),
                    )
                )

    async def wrap_tool_execute(
        self,
        ctx: RunContext[Any],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: ValidatedToolArgs,
        handler: WrapToolExecuteHandler,
    ) -> Any:
        async def execute() -> Any:
            try:
                result = await handler(args)
            except Exception as exc:
                self._emit_result(call, redact_secrets(str(exc)), success=False)
                raise
            value = to_jsonable_python(result, fallback=str)
            size = len(to_json(value))
            if size > self.ctx.max_step_bytes:
                # Not kept: neither the journal nor the model gets it, and the child
                # goes on; the model is told, as of a tool that failed.
                note = oversize_note(call.tool_name, size, self.ctx.max_step_bytes)
                self._emit_result(call, note, success=False)
                return note
            self._emit_result(call, value if isinstance(value, str) else _json(value), True)
            return value

        return await self.ctx.step(f"tool {self._position(call, self._named)}", execute)

    async def handle_deferred_tool_calls(
        self, ctx: RunContext[Any], *, requests: DeferredToolRequests
    ) -> DeferredToolResults | None:
        """A tool that requires approval (``requires_approval``, ``ApprovalRequired``)
        asks a person (design §21): ``ctx.ask(kind="approval")``, named ``approval N.K``
        by its place, with the call's tool, id and arguments. The child waits (past
        ``hold_s``, holding nothing) and the agent goes on as approved or denied: no
        model request is made again. Calls deferred for external execution are left
        unresolved."""
        approvals: dict[str, bool | DeferredToolApprovalResult] = {}
        for call in requests.approvals:
            answer = await self.ctx.ask(
                f"approval {self._position(call, self._asked)}",
                f"approve the call of {call.tool_name}?",
                kind="approval",
                tool_name=call.tool_name,
                tool_call_id=call.tool_call_id,
                input=call.args_as_json_str(),
            )
            approvals[call.tool_call_id] = True if answer == "approve" else ToolDenied()
        return DeferredToolResults(approvals=approvals) if approvals else None

    def _emit_result(self, call: ToolCallPart, output: str, success: bool) -> None:
        self.ctx.emit(
            Event(
                kind="tool-result",
                tool_name=call.tool_name,
                tool_call_id=call.tool_call_id,
                tool_output=output,
                success=success,
            )
        )


class JournaledModel(WrapperModel):
    """The model a child's agent asks: each request goes through the journal."""

    def __init__(self, wrapped: Model, journal: Journaled) -> None:
        super().__init__(wrapped)
        self._journal = journal

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        return await self._journal.request(
            self.wrapped, messages, model_settings, model_request_parameters
        )


def oversize_note(tool_name: str, size: int, limit: int) -> str:
    """What the model (and the journal) gets instead of a tool result over
    ``max_step_bytes``."""
    return (
        f"tool {tool_name} returned {size} bytes, over the {limit}-byte limit of what a"
        " child records: the result was dropped; ask for less"
    )


def _json(value: object) -> str:
    return to_json(value, fallback=str).decode()


def from_module(
    spec: str | None = None, *, version: str | None = None, resumes: Iterable[str] = ()
) -> PydanticAIRunner:
    """The runner ``delegation serve --runner delegation.runners.pydantic_ai:from_module``
    loads: ``spec`` (default: the environment variable ``DELEGATION_PYDANTIC_AI_AGENTS``)
    is ``module:attr`` naming a mapping of preset names to agents (or factories), or a
    zero-argument function returning one. ``version`` and ``resumes`` as the runner's
    (``serve`` loads it without: ``$DELEGATION_RUNNER_VERSION`` names the host's).

    Raises ``ValueError`` when nothing is named or what is named is no such mapping.
    """
    target = spec if spec is not None else os.environ.get(MODULE_ENV, "")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"set {MODULE_ENV} to module:attr naming a mapping of preset to Agent")
    found: Any = getattr(importlib.import_module(module_name), attr)
    agents = found() if callable(found) and not isinstance(found, Mapping) else found
    if not isinstance(agents, Mapping):
        raise ValueError(f"{target} names no mapping of preset names to agents")
    return PydanticAIRunner(agents, version=version, resumes=resumes)
