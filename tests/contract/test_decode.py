"""Strict decoding, design §2.1: every malformed input is one DelegationError, nothing leaks."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from delegation import (
    DelegationError,
    Event,
    ExecutionOptions,
    Params,
    Preset,
    Profile,
    Request,
    Result,
    decode,
    encode,
)
from delegation.errors import InvalidOptions, MalformedInput

OPTION_FIELDS = [f.encode_name for f in msgspec.structs.fields(ExecutionOptions)]
VALID_OPTION_VALUES: dict[str, Any] = {
    "provider": "openai",
    "model": "m",
    "weakModel": "w",
    "maxTokens": 1,
    "weakModelMaxTokens": 1,
    "thinkingBudgetTokens": 0,
    "reasoningEffort": "low",
    "maxTurns": 0,
    "useWeakModel": False,
    "noTools": False,
    "noExtensions": False,
    "noSkills": False,
    "allowedTools": [],
    "allowedCommands": [],
    "enableFSSearchTools": False,
    "deadlineSeconds": 1.5,
}


def params(**extra: Any) -> bytes:
    return json.dumps({"runId": "r", "extensionId": "e", "generation": 1, **extra}).encode()


def request(**extra: Any) -> dict[str, Any]:
    return {"requestId": "q", "profile": "p", "message": "m", **extra}


@pytest.mark.parametrize("text", ["null", "[]", "true", '"x"', "{", "{} {}", "1", "", " ", "{}x"])
@pytest.mark.parametrize("kind", [Params, Request, Profile, ExecutionOptions, Event])
def test_only_one_object_is_accepted(text: str, kind: type[Any]) -> None:
    with pytest.raises(MalformedInput):
        decode(text, kind)


def test_whitespace_around_the_object_is_fine() -> None:
    assert decode(b' \n{"runId":"r"}\n ', Params).run_id == "r"


def test_all_input_types_are_accepted() -> None:
    raw = params()
    for data in (raw, raw.decode(), bytearray(raw), memoryview(raw)):
        assert decode(data, Params).run_id == "r"


@pytest.mark.parametrize(
    "extra",
    [
        {"apiKey": "sk"},
        {"providerKey": "sk"},
        {"baseUrl": "http://x"},
        {"endpoint": "http://x"},
        {"sourceId": "s"},
        {"RunID": "r"},
        {"request": request(apiKey="sk")},
        {"request": request(RequestID="q")},
        {"request": request(options={"noSave": True})},
        {"request": request(options={"max_tokens": 5})},
        {"request": request(options={"openai": {"base_url": "http://x"}})},
        {"request": request(options={"enableFsSearchTools": True})},
    ],
)
def test_unknown_fields_are_refused_at_every_level(extra: dict[str, Any]) -> None:
    with pytest.raises(MalformedInput, match="unknown field"):
        decode(params(**extra), Params)


@pytest.mark.parametrize("field", ["options", "contextMode", "resume"])
def test_null_is_refused_in_request(field: str) -> None:
    with pytest.raises(MalformedInput, match="null"):
        decode(params(request=request(**{field: None})), Params)


@pytest.mark.parametrize("field", ["childRunId", "request", "runId", "generation", "after"])
def test_null_is_refused_in_params(field: str) -> None:
    with pytest.raises(MalformedInput, match="null"):
        decode(params(**{field: None}), Params)


@pytest.mark.parametrize("field", OPTION_FIELDS)
def test_null_is_refused_for_every_option(field: str) -> None:
    with pytest.raises(MalformedInput, match="null"):
        decode(json.dumps({field: None}), ExecutionOptions)
    with pytest.raises(MalformedInput, match="null"):
        decode(params(request=request(options={field: None})), Params)
    assert field in VALID_OPTION_VALUES


@pytest.mark.parametrize("field", OPTION_FIELDS)
def test_explicit_zero_values_survive_a_round_trip(field: str) -> None:
    value = {field: VALID_OPTION_VALUES[field]}
    options = decode(json.dumps(value), ExecutionOptions)
    assert json.loads(encode(options)) == value


def test_omitted_options_stay_omitted() -> None:
    options = decode(b"{}", ExecutionOptions)
    assert encode(options) == b"{}"
    assert options.allowed_tools is msgspec.UNSET
    assert options.no_tools is msgspec.UNSET


def test_empty_allowlist_is_deny_all_and_survives() -> None:
    options = decode(b'{"allowedTools":[]}', ExecutionOptions)
    assert options.allowed_tools == []
    assert options.tools_disabled()
    assert encode(options) == b'{"allowedTools":[]}'


U64 = 2**64 - 1


@pytest.mark.parametrize("field", ["generation", "after"])
@pytest.mark.parametrize("bad", ["-1", "1.5", "1e3", "1.0", str(U64 + 1), "true", '"1"'])
def test_uint64_fields_refuse_out_of_range(field: str, bad: str) -> None:
    text = '{"runId":"r","%s":%s}' % (field, bad)
    with pytest.raises(MalformedInput):
        decode(text, Params)


@pytest.mark.parametrize("field", ["generation", "after"])
def test_uint64_bounds_are_accepted(field: str) -> None:
    for good in (0, U64):
        assert getattr(decode(params(**{field: good}), Params), field) == good


def test_event_sequence_is_uint64() -> None:
    assert decode('{"kind":"text","sequence":%d}' % U64, Event).sequence == U64
    for bad in ("-1", "1.5", str(U64 + 1)):
        with pytest.raises(MalformedInput):
            decode('{"kind":"text","sequence":%s}' % bad, Event)
    with pytest.raises(MalformedInput):
        decode('{"done":true,"events":[{"kind":"t","sequence":%d}]}' % (U64 + 1), Result)


def test_preset_generation_is_uint64() -> None:
    with pytest.raises(MalformedInput):
        decode('{"name":"p","generation":%d}' % (U64 + 1), Preset)


@pytest.mark.parametrize(
    ("field", "attr"),
    [
        ("maxTokens", "max_tokens"),
        ("weakModelMaxTokens", "weak_model_max_tokens"),
        ("maxTurns", "max_turns"),
        ("thinkingBudgetTokens", "thinking_budget_tokens"),
    ],
)
def test_option_integers_are_int64(field: str, attr: str) -> None:
    assert getattr(decode('{"%s":%d}' % (field, 2**63 - 1), ExecutionOptions), attr) == 2**63 - 1
    for bad in (str(2**63), "1.5", "true"):
        with pytest.raises(MalformedInput):
            decode('{"%s":%s}' % (field, bad), ExecutionOptions)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("noTools", 1),
        ("noTools", "true"),
        ("allowedTools", "bash"),
        ("allowedTools", [1]),
        ("model", 3),
        ("maxTurns", "3"),
    ],
)
def test_wrong_types_are_refused(field: str, value: Any) -> None:
    with pytest.raises(MalformedInput):
        decode(json.dumps({field: value}), ExecutionOptions)


@pytest.mark.parametrize(
    "options",
    [
        {"provider": "gemini"},
        {"maxTokens": 0},
        {"maxTurns": -1},
        {"model": " "},
        {"reasoningEffort": "extreme"},
        {"allowedCommands": ["ls", ""]},
    ],
)
def test_options_are_validated_while_decoding(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidOptions):
        decode(json.dumps(options), ExecutionOptions)
    with pytest.raises(InvalidOptions):
        decode(params(request=request(options=options)), Params)
    with pytest.raises(InvalidOptions):
        decode(json.dumps({"name": "p", "options": options}), Profile)


def test_provider_list_is_configurable() -> None:
    text = '{"provider":"gemini"}'
    assert decode(text, ExecutionOptions, providers=["gemini"]).provider == "gemini"
    with pytest.raises(InvalidOptions):
        decode('{"provider":"openai"}', ExecutionOptions, providers=["gemini"])


def test_field_names_are_exact_and_case_sensitive() -> None:
    decoded = decode(params(toolCallId="t", childRunId="c", requestId="s", leaseId="l"), Params)
    assert (decoded.tool_call_id, decoded.child_run_id, decoded.request_id, decoded.lease_id) == (
        "t",
        "c",
        "s",
        "l",
    )
    for wrong in ("toolCallID", "tool_call_id", "ToolCallId"):
        with pytest.raises(MalformedInput):
            decode(params(**{wrong: "t"}), Params)


@pytest.mark.parametrize(
    "data",
    [
        b'{"runId":"\xff"}',
        b'{"runId":"\\ud800"}',
        b"\xef\xbb\xbf{}",
        b"[" * 100_000,
        b'{"a":' * 50_000,
    ],
)
def test_hostile_bytes_raise_only_delegation_errors(data: bytes) -> None:
    with pytest.raises(DelegationError):
        decode(data, Params)


def test_decode_error_is_chained_and_leaves_values_untouched() -> None:
    good = decode(params(), Params)
    before = encode(good)
    with pytest.raises(MalformedInput) as info:
        decode(b'{"runId": 1}', Params)
    assert isinstance(info.value.__cause__, msgspec.MsgspecError)
    assert encode(good) == before
