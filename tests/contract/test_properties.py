"""Hypothesis properties of the wire contract (design §2.1).

1. Every valid value of every wire type survives ``encode`` → ``decode`` unchanged,
   and re-encoding is byte-identical; explicit ``false``, ``0`` and ``[]`` options stay.
2. ``decode`` of anything at all either succeeds or raises a ``DelegationError``:
   arbitrary bytes, arbitrary JSON, mutations of valid values, deep nesting,
   invalid UTF-8, lone surrogates and huge numbers. A successful decode is a valid
   value (it round-trips).
3. A failed decode never touches a value decoded before it.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import UNSET

from delegation import (
    DelegationError,
    Event,
    ExecutionOptions,
    Identity,
    Params,
    Preset,
    Profile,
    Request,
    Result,
    SteerResult,
    decode,
    encode,
    valid_id,
)
from delegation._struct import I64_MAX, U64_MAX, WireStruct
from delegation.options import PROVIDERS, REASONING_EFFORTS
from delegation.wire import STEER_INJECTED, STEER_NO_RUNNING_TURN, STEER_PROMPT_REQUIRED
from tests.harness.support import HUGE_NUMBERS
from tests.harness.wire_types import WIRE_TYPES

TYPE_IDS = [kind.__name__ for kind in WIRE_TYPES]

# Deterministic examples, no example database: the module stays fast and leaves
# nothing behind that would change the next run.
ROUND_TRIP = settings(max_examples=150, deadline=None, database=None)
ROBUST = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ROBUST_SLOW = settings(ROBUST, max_examples=80)  # recursive JSON with wild text is slow to draw


# --- valid values --------------------------------------------------------------------

# Any text msgspec can encode (surrogates cannot be UTF-8), NUL and controls included.
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
UINT64 = st.one_of(st.sampled_from([0, 1, 2**63 - 1, 2**63, U64_MAX]), st.integers(0, U64_MAX))

_NO_NUL = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=6)
_SOLID = st.characters(codec="utf-8").filter(lambda ch: not ch.isspace() and ch != "\x00")
# Non-empty after trim and without NUL: what ExecutionOptions text and list entries need.
OPTION_TEXT = st.builds(lambda head, solid, tail: head + solid + tail, _NO_NUL, _SOLID, _NO_NUL)
_SPACE = st.text(st.sampled_from(" \t\n\r\x0b\x0c\x1c\x85\xa0\u2003\u3000"), max_size=3)
EFFORT = st.builds(
    lambda head, effort, case, tail: head + case(effort) + tail,
    _SPACE,
    st.sampled_from(sorted(REASONING_EFFORTS)),
    st.sampled_from([str.lower, str.upper, str.title, str.swapcase]),
    _SPACE,
)


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Omitted (inherit) or an explicit value."""
    return st.one_of(st.just(UNSET), strategy)


_POSITIVE = st.one_of(st.sampled_from([1, I64_MAX]), st.integers(1, I64_MAX))
_NON_NEGATIVE = st.one_of(st.sampled_from([0, I64_MAX]), st.integers(0, I64_MAX))
_ENTRIES = st.lists(OPTION_TEXT, max_size=4)  # [] included: deny-all

OPTIONS: st.SearchStrategy[ExecutionOptions] = st.builds(
    ExecutionOptions,
    provider=_maybe(st.sampled_from(PROVIDERS)),
    model=_maybe(OPTION_TEXT),
    weak_model=_maybe(OPTION_TEXT),
    max_tokens=_maybe(_POSITIVE),
    weak_model_max_tokens=_maybe(_POSITIVE),
    thinking_budget_tokens=_maybe(_NON_NEGATIVE),
    reasoning_effort=_maybe(EFFORT),
    max_turns=_maybe(_NON_NEGATIVE),
    use_weak_model=_maybe(st.booleans()),
    no_tools=_maybe(st.booleans()),
    no_extensions=_maybe(st.booleans()),
    no_skills=_maybe(st.booleans()),
    allowed_tools=_maybe(_ENTRIES),
    allowed_commands=_maybe(_ENTRIES),
    enable_fs_search_tools=_maybe(st.booleans()),
)
MAYBE_OPTIONS = _maybe(OPTIONS)

_PROFILE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "name": TEXT,
    "options": MAYBE_OPTIONS,
    "system_prompt_path": TEXT,
    "system_prompt": TEXT,
}
PROFILE = st.builds(Profile, **_PROFILE_FIELDS)
PRESET = st.builds(Preset, **_PROFILE_FIELDS, extension_id=TEXT, generation=UINT64)
REQUEST = st.builds(
    Request,
    context_mode=st.one_of(st.sampled_from(["", "fresh", "fork"]), TEXT),
    resume=TEXT,
    request_id=TEXT,
    profile=TEXT,
    message=TEXT,
    options=MAYBE_OPTIONS,
    system_prompt=TEXT,
    cwd=TEXT,
    lease_id=TEXT,
)
PARAMS = st.builds(
    Params,
    run_id=TEXT,
    tool_call_id=TEXT,
    extension_id=TEXT,
    generation=UINT64,
    request=_maybe(REQUEST),
    child_id=TEXT,
    child_run_id=TEXT,
    message=TEXT,
    request_id=TEXT,
    lease_id=TEXT,
    after=UINT64,
)
_IDENTITY_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "runner_id": TEXT,
    "host_instance_id": TEXT,
    "conversation_id": TEXT,
    "run_id": TEXT,
    "parent_conversation_id": TEXT,
    "parent_run_id": TEXT,
    "extension_id": TEXT,
    "profile": TEXT,
}
IDENTITY = st.builds(Identity, **_IDENTITY_FIELDS)
EVENT = st.builds(
    Event,
    sequence=UINT64,
    kind=TEXT,
    text=TEXT,
    tool_name=TEXT,
    tool_call_id=TEXT,
    input=TEXT,
    tool_output=TEXT,
    success=st.one_of(st.none(), st.booleans()),
    error=TEXT,
)
RESULT = st.builds(
    Result,
    **_IDENTITY_FIELDS,
    done=st.booleans(),
    cancelled=st.booleans(),
    error=TEXT,
    output=TEXT,
    events=st.lists(EVENT, max_size=3),
)
STEER_RESULT = st.one_of(
    st.builds(SteerResult, outcome=st.just(STEER_INJECTED)),
    st.builds(
        SteerResult,
        outcome=st.just(STEER_PROMPT_REQUIRED),
        reason=st.sampled_from(["", STEER_NO_RUNNING_TURN]),
    ),
)

VALID: dict[type[WireStruct], st.SearchStrategy[Any]] = {
    ExecutionOptions: OPTIONS,
    Profile: PROFILE,
    Preset: PRESET,
    Request: REQUEST,
    Params: PARAMS,
    Identity: IDENTITY,
    Event: EVENT,
    Result: RESULT,
    SteerResult: STEER_RESULT,
}
ANY_VALID = st.one_of(*VALID.values())

# Values that also pass Request.validate() / Profile.validate() (design §2.2).
_BLANKISH = st.text(st.characters(codec="utf-8"), max_size=4)
NONBLANK = st.builds(lambda head, solid, tail: head + solid + tail, _BLANKISH, _SOLID, _BLANKISH)
ID = st.text(
    st.characters(codec="utf-8", min_codepoint=0x21, exclude_characters="/\\\x7f"),
    min_size=1,
    max_size=32,  # at most 4 bytes a character: within 128 bytes
).filter(lambda s: s not in (".", ".."))
_NAME_CHARS = st.characters(codec="utf-8", exclude_characters="/\\\x00")
NAME = st.builds(
    lambda head, solid, tail: head + solid + tail,
    st.text(_NAME_CHARS, max_size=10),
    _SOLID.filter(lambda ch: ch not in "/\\"),
    st.text(_NAME_CHARS, max_size=10),
)


@st.composite
def _validated_request(draw: st.DrawFn) -> Request:
    mode = draw(st.sampled_from(["", "fresh", "fork"]))
    return Request(
        context_mode=mode,
        resume="" if mode == "fork" else draw(st.one_of(st.just(""), ID)),
        request_id=draw(NONBLANK.filter(lambda s: len(s.encode()) <= 128)),
        profile=draw(NONBLANK),
        message=draw(NONBLANK),
        options=draw(MAYBE_OPTIONS),
        system_prompt=draw(TEXT),
        cwd=draw(TEXT),
        lease_id=draw(TEXT),
    )


@st.composite
def _validated_profile(draw: st.DrawFn, kind: type[Profile] = Profile) -> Profile:
    prompt = draw(st.one_of(st.tuples(TEXT, st.just("")), st.tuples(st.just(""), TEXT)))
    extra: dict[str, Any] = {}
    if kind is Preset:
        extra = {"extension_id": draw(TEXT), "generation": draw(UINT64)}
    return kind(
        name=draw(NAME),
        options=draw(MAYBE_OPTIONS),
        system_prompt_path=prompt[0],
        system_prompt=prompt[1],
        **extra,
    )


VALIDATED = st.one_of(_validated_request(), _validated_profile(), _validated_profile(Preset))


def _assert_round_trip(value: WireStruct) -> None:
    raw = encode(value)
    back = decode(raw, type(value))
    assert type(back) is type(value)
    assert back == value
    assert encode(back) == raw


# --- 1. round trips ------------------------------------------------------------------


@pytest.mark.parametrize("kind", WIRE_TYPES, ids=TYPE_IDS)
@ROUND_TRIP
@given(data=st.data())
def test_round_trip(kind: type[WireStruct], data: st.DataObject) -> None:
    value = data.draw(VALID[kind], label="value")
    assert type(value) is kind
    if isinstance(value, ExecutionOptions):
        value.validate()
    _assert_round_trip(value)


@ROUND_TRIP
@given(value=OPTIONS)
def test_options_round_trip_keeps_every_set_field(value: ExecutionOptions) -> None:
    """Omitted stays omitted, and every explicit value (false, 0, []) stays explicit."""
    back = decode(encode(value), ExecutionOptions)
    for field in msgspec.structs.fields(ExecutionOptions):
        mine, theirs = getattr(value, field.name), getattr(back, field.name)
        assert (mine is UNSET) == (theirs is UNSET), field.name
        assert mine == theirs, field.name


@ROUND_TRIP
@given(value=VALIDATED)
def test_validated_values_round_trip(value: Request | Profile) -> None:
    value.validate()
    _assert_round_trip(value)
    decode(encode(value), type(value)).validate()


@pytest.mark.parametrize("field", ["allowed_tools", "allowed_commands"])
@pytest.mark.parametrize(
    "wrap",
    [
        lambda o: o,
        lambda o: Profile(name="p", options=o),
        lambda o: Request(request_id="r", profile="p", message="m", options=o),
        lambda o: Params(run_id="r", extension_id="e", request=Request(options=o)),
    ],
    ids=["options", "profile", "request", "params"],
)
def test_explicit_empty_list_survives(
    field: str, wrap: Callable[[ExecutionOptions], WireStruct]
) -> None:
    value = wrap(ExecutionOptions(**{field: []}))
    raw = encode(value)
    json_name = field.split("_")[0] + "".join(p.capitalize() for p in field.split("_")[1:])
    assert f'"{json_name}":[]'.encode() in raw
    back = decode(raw, type(value))
    assert back == value
    options = back
    if isinstance(back, Params):
        assert isinstance(back.request, Request)
        options = back.request.options
    elif isinstance(back, Profile | Request):
        options = back.options
    assert isinstance(options, ExecutionOptions)
    assert getattr(options, field) is not UNSET
    assert getattr(options, field) == []
    if field == "allowed_tools":
        assert options.tools_disabled()
    else:
        assert not options.tool_allowed("bash")


@ROUND_TRIP
@given(value=OPTIONS, field=st.sampled_from(["allowed_tools", "allowed_commands"]))
def test_explicit_empty_list_survives_among_other_options(
    value: ExecutionOptions, field: str
) -> None:
    value = msgspec.structs.replace(value, **{field: []})
    back = decode(encode(value), ExecutionOptions)
    assert getattr(back, field) is not UNSET
    assert getattr(back, field) == []
    assert back == value


@pytest.mark.parametrize(
    ("field", "explicit"),
    [
        ("use_weak_model", False),
        ("no_tools", False),
        ("no_extensions", False),
        ("no_skills", False),
        ("enable_fs_search_tools", False),
        ("max_turns", 0),
        ("thinking_budget_tokens", 0),
    ],
)
def test_explicit_false_and_zero_survive(field: str, explicit: object) -> None:
    back = decode(encode(ExecutionOptions(**{field: explicit})), ExecutionOptions)
    assert getattr(back, field) is not UNSET
    assert getattr(back, field) == explicit
    assert type(getattr(back, field)) is type(explicit)


# --- 2. robustness -------------------------------------------------------------------


def _decode_or_refuse(data: bytes | bytearray | memoryview | str, kind: type[WireStruct]) -> None:
    """The property: success (a valid value) or DelegationError; anything else escapes."""
    try:
        value = decode(data, kind)
    except DelegationError:
        return
    assert type(value) is kind
    _assert_round_trip(value)


FIELD_NAMES = sorted(
    {field.encode_name for kind in WIRE_TYPES for field in msgspec.structs.fields(kind)}
    | {"RequestID", "requestID", "apiKey", "providerKey", "baseUrl", "endpoint", "sourceId"}
    | {"", "__proto__", "enableFsSearchTools", "allowed_tools"}
)
LONE_SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"]
# Every code point, lone surrogates included and drawn often.
WILD_TEXT = st.lists(st.one_of(st.characters(), st.sampled_from(LONE_SURROGATES)), max_size=10).map(
    "".join
)
KEYS = st.one_of(st.sampled_from(FIELD_NAMES), WILD_TEXT)
BOUNDARY_INTS = st.sampled_from(
    [
        *(-1, 0, 1, 2**31, 2**53 + 1, I64_MAX, I64_MAX + 1, U64_MAX, U64_MAX + 1),
        *(-(2**63), -(2**63) - 1, -(2**64), 10**30, -(10**30), 10**400),
    ]
)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    BOUNDARY_INTS,
    st.floats(),  # NaN and Infinity become the non-JSON tokens json.dumps writes
    WILD_TEXT,
    st.sampled_from(sorted(REASONING_EFFORTS) + list(PROVIDERS) + ["injected", "fork"]),
)
JSON_VALUES = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(KEYS, children, max_size=5)
    ),
    max_leaves=24,
)
JSON_OBJECTS = st.dictionaries(KEYS, JSON_VALUES, max_size=6)
TAIL = st.one_of(
    st.just(b""), st.sampled_from([b" ", b"\n", b"{}", b",", b"x", b"\x00", b"\xff"]), st.binary()
)


def _serialize(obj: Any, how: str, tail: bytes) -> bytes | bytearray | memoryview | str:
    """The JSON text of ``obj`` in one of the forms ``decode`` accepts."""
    if how == "ascii":  # lone surrogates as \\udXXX escapes
        return json.dumps(obj).encode() + tail
    # Lone surrogates as CESU-8 bytes: invalid UTF-8 inside a string.
    raw = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass") + tail
    if how == "bytearray":
        return bytearray(raw)
    if how == "memoryview":
        return memoryview(raw)
    if how == "str":  # a Python str, possibly holding lone surrogates
        return json.dumps(obj, ensure_ascii=False) + tail.decode("latin-1")
    return raw


HOW = st.sampled_from(["ascii", "utf8", "bytearray", "memoryview", "str"])


@pytest.mark.parametrize("kind", WIRE_TYPES, ids=TYPE_IDS)
@ROBUST
@given(data=st.one_of(st.binary(max_size=64), st.binary(max_size=64).map(lambda b: b"{" + b)))
def test_arbitrary_bytes(kind: type[WireStruct], data: bytes) -> None:
    _decode_or_refuse(data, kind)


@pytest.mark.parametrize("kind", WIRE_TYPES, ids=TYPE_IDS)
@ROBUST_SLOW
@given(obj=st.one_of(JSON_OBJECTS, JSON_VALUES), how=HOW, tail=TAIL)
def test_arbitrary_json(kind: type[WireStruct], obj: Any, how: str, tail: bytes) -> None:
    _decode_or_refuse(_serialize(obj, how, tail), kind)


# Near misses: the right shape with a value the type, range or options refuse.
NEAR_MISSES = st.one_of(
    BOUNDARY_INTS,
    st.sampled_from([None, "", " ", "\x00", "x\x00", "bogus", True, False, 1.5, -0.0]),
    # A fresh copy each time: the mutations below change containers in place.
    st.sampled_from([[], [""], [" "], ["\x00"], [None], [1], {}, {"": 1}]).map(copy.deepcopy),
)


@st.composite
def _mutated(draw: st.DrawFn, kind: type[WireStruct]) -> Any:
    """A valid value of ``kind`` as JSON (still an object), with one to three breaks."""
    tree = json.loads(encode(draw(VALID[kind])))
    for _ in range(draw(st.integers(1, 3))):
        _mutate_object(draw, tree)
    return tree


def _mutate_object(draw: st.DrawFn, node: dict[str, Any]) -> None:
    action = draw(st.sampled_from(["child"] * 6 + ["add", "drop"]))
    if action == "add" or not node:
        node[draw(KEYS)] = draw(st.one_of(NEAR_MISSES, JSON_VALUES))
    elif action == "drop":
        del node[draw(st.sampled_from(sorted(node)))]
    else:
        key = draw(st.sampled_from(sorted(node)))
        node[key] = _mutate(draw, node[key])


def _mutate(draw: st.DrawFn, node: Any) -> Any:
    """``node`` with one break somewhere at or below it; mostly deeper, where types are."""
    if isinstance(node, dict) and node and draw(st.integers(0, 4)) > 0:
        _mutate_object(draw, node)
        return node
    if isinstance(node, list) and node and draw(st.integers(0, 4)) > 0:
        index = draw(st.integers(0, len(node) - 1))
        node[index] = _mutate(draw, node[index])
        return node
    action = draw(st.sampled_from(["near"] * 3 + ["json", "wrap"]))
    if action == "wrap":
        return [node]
    if action == "json":
        return draw(JSON_VALUES)
    return draw(NEAR_MISSES)


@pytest.mark.parametrize("kind", WIRE_TYPES, ids=TYPE_IDS)
@ROBUST
@given(data=st.data(), how=HOW, tail=TAIL)
def test_mutated_valid_values(
    kind: type[WireStruct], data: st.DataObject, how: str, tail: bytes
) -> None:
    tree = data.draw(_mutated(kind), label="tree")
    _decode_or_refuse(_serialize(tree, how, tail), kind)


DEPTH = 10_000


def _nested_payloads(kind: type[WireStruct]) -> list[bytes]:
    payloads = [
        b"[" * DEPTH + b"]" * DEPTH,
        b"{" * DEPTH,
        b'{"a":' * DEPTH + b"1" + b"}" * DEPTH,
        b"[" * (10 * DEPTH),
        b'{"x":' + b"[" * (10 * DEPTH),
    ]
    for field in msgspec.structs.fields(kind):
        name = json.dumps(field.encode_name).encode()
        payloads += [
            b"{" + name + b":" + b"[" * DEPTH + b"]" * DEPTH + b"}",
            b"{" + name + b":" + b'{"a":' * DEPTH + b"0" + b"}" * DEPTH + b"}",
            b"{" + name + b":" + (b"{" + name + b":") * DEPTH + b"0" + b"}" * (DEPTH + 1),
            b"{" + name + b":" + b"[" * DEPTH,
        ]
    # Deep inside the types that nest: Params.request.options and Result.events.
    for prefix in (b'{"request":{"options":{"allowedTools":', b'{"events":[{"kind":'):
        payloads += [
            prefix + b"[" * DEPTH + b"]" * DEPTH + b"}}",
            prefix + b'{"requestId":' * DEPTH + b'""' + b"}" * DEPTH + b"}}",
        ]
    return payloads


@pytest.mark.parametrize("kind", WIRE_TYPES, ids=TYPE_IDS)
def test_deep_nesting(kind: type[WireStruct]) -> None:
    for payload in _nested_payloads(kind):
        _decode_or_refuse(payload, kind)
        _decode_or_refuse(payload.decode(), kind)


@pytest.mark.parametrize("kind", WIRE_TYPES, ids=TYPE_IDS)
def test_lone_surrogates_and_invalid_utf8(kind: type[WireStruct]) -> None:
    strings: list[bytes] = [
        b'"\\ud800"',
        b'"\\udc00"',
        b'"a\\udfffb"',
        b'"\\ud800\\u0041"',
        b'"\\ud800\\ud800"',
        b'"\\udc00\\ud800"',
        b'"\\ud83d\\ude00"',  # a valid pair
        b'"\\ud8"',
        b'"\\u"',
        b'"\\uZZZZ"',
        b'"\xed\xa0\x80"',  # CESU-8 lone surrogate
        b'"\xf0\x9f\x98"',  # truncated 4-byte sequence
        b'"\xc0\xaf"',  # overlong
        b'"\xff\xfe"',
        b'"\xf4\x90\x80\x80"',  # above U+10FFFF
        b'"\x00"',
        b'"\x01"',
    ]
    values = [*strings, b"[" + strings[0] + b"]", b'{"a":' + strings[0] + b"}"]
    for field in msgspec.structs.fields(kind):
        name = json.dumps(field.encode_name).encode()
        for value in values:
            _decode_or_refuse(b"{" + name + b":" + value + b"}", kind)
        _decode_or_refuse("{" + name.decode() + ':"\ud800"}', kind)  # a str with a surrogate
        _decode_or_refuse(b'{"\\ud800":1,' + name + b":1}", kind)
        _decode_or_refuse(b'{"\xed\xa0\x80":1,' + name + b":1}", kind)
    nested = b'{"request":{"options":{"allowedTools":[%s]}}}'
    for value in values:
        _decode_or_refuse(nested % value, kind)


@pytest.mark.parametrize("kind", WIRE_TYPES, ids=TYPE_IDS)
def test_huge_numbers(kind: type[WireStruct]) -> None:
    for field in msgspec.structs.fields(kind):
        name = json.dumps(field.encode_name).encode()
        for number in HUGE_NUMBERS:
            _decode_or_refuse(b"{" + name + b":" + number + b"}", kind)
            _decode_or_refuse(b'{"options":{' + name + b":" + number + b"}}", kind)
            _decode_or_refuse(b'{"events":[{"kind":"k",' + name + b":" + number + b"}]}", kind)
            _decode_or_refuse(b'{"request":{"options":{' + name + b":" + number + b"}}}", kind)


# --- 3. a failed decode leaves earlier values alone --------------------------------


@st.composite
def _value_and_garbage(draw: st.DrawFn) -> tuple[WireStruct, bytes | bytearray | memoryview | str]:
    value = draw(ANY_VALID)
    raw = encode(value)
    garbage = draw(
        st.one_of(
            st.binary(max_size=64),
            st.builds(lambda cut: raw[:cut], st.integers(0, max(len(raw) - 1, 0))),
            st.builds(lambda tail: raw + tail, TAIL),
            st.builds(_serialize, _mutated(type(value)), HOW, TAIL),
            st.builds(_serialize, JSON_OBJECTS, HOW, TAIL),
        )
    )
    return value, garbage


@ROBUST
@given(case=_value_and_garbage(), again=st.booleans())
def test_failed_decode_leaves_earlier_value(
    case: tuple[WireStruct, bytes | bytearray | memoryview | str], again: bool
) -> None:
    value, garbage = case
    kind = type(value)
    raw = encode(value)
    first = decode(raw, kind)
    for _ in range(2 if again else 1):
        with contextlib.suppress(DelegationError):
            decode(garbage, kind)
    assert first == value
    assert encode(first) == raw
    # A later good decode is a new value, not the earlier one reused or changed.
    second = decode(raw, kind)
    assert second == first
    assert encode(first) == raw


def test_valid_id_strategy_matches_valid_id() -> None:
    """The ID strategy used for ``resume`` above really produces valid IDs."""

    @settings(max_examples=50, deadline=None, database=None)
    @given(ident=ID)
    def check(ident: str) -> None:
        assert valid_id(ident)

    check()
