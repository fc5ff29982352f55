"""Typed inputs are checked as the wire checks them (SPEC §26): a ``Request``,
``Params``, ``ExecutionOptions``, ``Preset`` or ``AdmissionPolicy`` built in Python with
a wrong type (msgspec checks no type when a Struct is built) is refused as
``MalformedInput`` naming the field, in the wire's words, never ``internal_error`` or an
unrelated refusal; at the engine's methods and through the client of a serve host."""

from __future__ import annotations

import datetime
import os
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from delegation import AdmissionPolicy, Params, Preset, Request, errors
from delegation.client.api import Client
from delegation.codec import checked, decode
from delegation.options import ExecutionOptions
from tests.harness.support import PRESET, Harness

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DELEGATION_SCRIPTED_DELAY": "0.02"}


def _request(**fields: Any) -> Request:
    base: dict[str, Any] = {"request_id": "q1", "profile": PRESET.name, "message": "do it"}
    return Request(**{**base, **fields})


def _options(**fields: Any) -> Request:
    return _request(options=ExecutionOptions(**fields))


# (what a Python caller built, the field the refusal names, the wire's words for it)
WRONG: list[tuple[str, dict[str, Any], str]] = [
    ("message=123", {"request": _request(message=123)},
     "Expected `str`, got `int` - at `$.request.message`"),
    ("priority='high'", {"request": _request(priority="high")},
     "Expected `int`, got `str` - at `$.request.priority`"),
    ("generation='1'", {"generation": "1"},
     "Expected `int`, got `str` - at `$.generation`"),
    ("generation=True", {"generation": True},
     "Expected `int`, got `bool` - at `$.generation`"),
    ("generation=-1", {"generation": -1},
     "Expected `int` >= 0 - at `$.generation`"),
    ("generation>uint64", {"generation": 2**64},
     "$.generation exceeds uint64"),
    ("after=1.5", {"after": 1.5},
     "Expected `int`, got `float` - at `$.after`"),
    ("request_id=uuid", {"request": _request(request_id=uuid.uuid4())},
     "Expected `str`, got `uuid` - at `$.request.requestId`"),
    ("message=bytes", {"request": _request(message=b"hi")},
     "Expected `str`, got `bytes` - at `$.request.message`"),
    ("context_mode=1", {"request": _request(context_mode=1)},
     "Expected `str`, got `int` - at `$.request.contextMode`"),
    ("request='q1'", {"request": "q1"},
     "Expected `object`, got `str` - at `$.request`"),
    ("options=dict-typo", {"request": _request(options={"maxTurn": 3})},
     "Object contains unknown field `maxTurn` - at `$.request.options`"),
    ("maxTurns='3'", {"request": _options(max_turns="3")},
     "Expected `int`, got `str` - at `$.request.options.maxTurns`"),
    ("allowedTools='bash'", {"request": _options(allowed_tools="bash")},
     "Expected `array`, got `str` - at `$.request.options.allowedTools`"),
    ("allowedTools=[1]", {"request": _options(allowed_tools=[1])},
     "Expected `str`, got `int` - at `$.request.options.allowedTools[0]`"),
    ("noTools='yes'", {"request": _options(no_tools="yes")},
     "Expected `bool`, got `str` - at `$.request.options.noTools`"),
    ("reasoningEffort=5", {"request": _options(reasoning_effort=5)},
     "Expected `str`, got `int` - at `$.request.options.reasoningEffort`"),
    ("deadlineSeconds='9'", {"request": _options(deadline_seconds="9")},
     "Expected `float`, got `str` - at `$.request.options.deadlineSeconds`"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "words"), [w[1:] for w in WRONG], ids=[w[0] for w in WRONG])
async def test_a_typed_start_with_a_wrong_type_is_malformed_input_naming_the_field(
    harness: Harness, changes: dict[str, Any], words: str
) -> None:
    params = harness.params(**{"request": _request(), **changes})
    for call in (
        lambda: harness.engine.start(harness.conn, params),
        lambda: harness.engine.call(harness.conn, "child.start", params),
    ):
        with pytest.raises(errors.MalformedInput) as refused:
            await call()
        assert str(refused.value) == f"malformed child input: {words}"
    # The same mistake as JSON on the wire: the same words.
    if not any(isinstance(v, bytes | uuid.UUID) for v in _leaves(changes)):
        with pytest.raises(errors.MalformedInput) as on_the_wire:
            decode(msgspec.json.encode(params), Params)
        assert str(on_the_wire.value) == f"malformed child input: {words}"
    assert harness.runner.prepared == [], "nothing started"


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, msgspec.Struct):
        return _leaves(msgspec.structs.asdict(value))
    return [value]


async def test_every_child_method_checks_typed_params(harness: Harness) -> None:
    started = await harness.start()
    child = started.conversation_id
    engine, conn = harness.engine, harness.conn
    wrong = harness.params(child_id=child, generation="7")
    for method in (engine.read, engine.cancel, engine.steer, engine.input, engine.release):
        with pytest.raises(errors.MalformedInput, match=r"at `\$\.generation`"):
            await method(conn, wrong)
    with pytest.raises(errors.MalformedInput, match=r"at `\$\.childId`"):
        await engine.read(conn, harness.params(child_id=uuid.UUID(int=1)))
    assert (await engine.read(conn, harness.params(child_id=child))).conversation_id == child


async def test_a_typed_value_that_is_right_still_works(harness: Harness) -> None:
    """A tuple where a list goes, an int where a float goes: what JSON would carry."""
    request = _options(allowed_tools=("bash",), deadline_seconds=60)
    started = await harness.engine.start(harness.conn, harness.params(request=request))
    assert started.conversation_id
    options = harness.runner.prepared[0].request.options
    assert options.allowed_tools == ["bash"] and options.deadline_seconds == 60.0


async def test_a_tool_begun_with_wrong_types_is_malformed_input(harness: Harness) -> None:
    engine, conn = harness.engine, harness.conn
    cases: list[tuple[dict[str, Any], str]] = [
        ({"presets": [Preset(name="w", extension_id="ext", generation="3")]},
         "Expected `int`, got `str` - at `$.presets[0].generation`"),
        ({"presets": [Preset(name=7, extension_id="ext", generation=3)]},
         "Expected `str`, got `int` - at `$.presets[0].name`"),
        ({"presets": [PRESET], "policy": ExecutionOptions(max_turns="3")},
         "Expected `int`, got `str` - at `$.policy.maxTurns`"),
        ({"presets": [PRESET], "policy": ExecutionOptions(no_tools=1)},
         "Expected `bool`, got `int` - at `$.policy.noTools`"),
    ]  # fmt: skip
    for index, (changes, words) in enumerate(cases):
        with pytest.raises(errors.MalformedInput) as refused:
            await engine.open_tool(
                conn, run_id="run-2", conversation_id="conv-2", tool_call_id=f"call-{index}",
                extension_id="ext", workspace=harness.workspace, **changes,
            )  # fmt: skip
        assert str(refused.value) == f"malformed params: {words}"


def test_an_admission_policy_of_a_wrong_type_is_malformed_input() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"concurrency": "3"}, "Expected `int | null`, got `str` - at `$.concurrency`"),
        ({"concurrency": 2.0}, "Expected `int | null`, got `float` - at `$.concurrency`"),
        ({"rate": "5/s"}, "Expected `array | null`, got `str` - at `$.rate`"),
        ({"rate": (5, "1")}, "Expected `float`, got `str` - at `$.rate[1]`"),
        ({"rate": (True, 1.0)}, "Expected `int`, got `bool` - at `$.rate[0]`"),
        ({"max_queued": "10"}, "Expected `int`, got `str` - at `$.max_queued`"),
        ({"queue_timeout_s": "30"}, "Expected `float | null`, got `str` - at `$.queue_timeout_s`"),
    ]
    for values, words in cases:
        with pytest.raises(errors.MalformedInput) as refused:
            AdmissionPolicy(**values)
        assert str(refused.value) == f"malformed admission policy: {words}"
    assert AdmissionPolicy(rate=[5, 1]).rate == (5, 1.0), "what JSON would carry is taken"


async def test_set_admission_refuses_what_is_not_a_policy(harness: Harness) -> None:
    scope = f"preset:runner-1/{PRESET.extension_id}/{PRESET.name}"
    with pytest.raises(
        errors.MalformedInput, match="expected an AdmissionPolicy or None, got dict"
    ):
        await harness.engine.set_admission(scope, {"concurrency": 1})  # type: ignore[arg-type]
    assert await harness.engine.admission() == []


def test_checked_returns_the_value_as_decoding_builds_it() -> None:
    built = Params(
        run_id="r", extension_id="e", generation=1, request=_options(allowed_tools=("a",))
    )
    value = checked(built, Params)
    assert value == decode(msgspec.json.encode(built), Params)
    assert value.request.options.allowed_tools == ["a"]  # type: ignore[union-attr]
    with pytest.raises(errors.MalformedInput, match=r"^malformed child input: Encoding objects"):
        checked(Params(run_id=object(), extension_id="e", generation=1), Params)
    with pytest.raises(errors.InvalidOptions):
        checked(_options(provider="nobody"), Request)
    assert (
        checked(_options(provider="nobody"), Request, providers=None).options.provider == "nobody"
    )  # type: ignore[union-attr]


async def test_the_client_refuses_what_json_would_carry_as_something_else(
    db_url: str, workspace: Path
) -> None:
    """Bytes, a UUID or a date in a typed field crossed as text (base64, the UUID's
    string) and a child started; the client refuses them as the host would refuse them."""
    owner = {"run_id": "run-1", "tool_call_id": "call-1", "extension_id": "ext", "generation": 3}
    preset = Preset(name="scripted", extension_id="ext", generation=3)
    opening = Client.spawn(["--db", db_url, "--runner", "scripted"], env=ENV, cwd=ROOT)
    async with await opening as client:
        await client.register("r1", "h1")
        with pytest.raises(errors.MalformedInput) as refused:
            await client.begin_tool(
                run_id="run-1", conversation_id="conv-1", tool_call_id="call-1", extension_id="ext",
                presets=[Preset(name=b"scripted", extension_id="ext", generation=3)],
                workspace=str(workspace),
            )  # fmt: skip
        assert str(refused.value) == (
            "malformed params: Expected `str`, got `bytes` - at `$.presets[0].name`"
        )
        await client.begin_tool(
            run_id="run-1", conversation_id="conv-1", tool_call_id="call-1", extension_id="ext",
            presets=[preset], workspace=str(workspace),
        )  # fmt: skip
        wrong = {
            "message": (_req(message=b"hi"), "got `bytes` - at `$.request.message`"),
            "requestId": (_req(request_id=uuid.UUID(int=7)),
                          "got `uuid` - at `$.request.requestId`"),
            "cwd": (_req(cwd=datetime.date(2024, 1, 1)), "got `date` - at `$.request.cwd`"),
        }  # fmt: skip
        for request, words in wrong.values():
            with pytest.raises(errors.MalformedInput) as refused:
                await client.start(Params(**owner, request=request))
            assert str(refused.value) == f"malformed child input: Expected `str`, {words}"
        with pytest.raises(errors.MalformedInput, match=r"got `str` - at `\$\.generation`"):
            await client.start(Params(**{**owner, "generation": "3"}, request=_req()))
        started = await client.start(Params(**owner, request=_req()))
        assert started.conversation_id, "the stream goes on"


def _req(**fields: Any) -> Request:
    return Request(**{"request_id": "q1", "profile": "scripted", "message": "hi", **fields})
