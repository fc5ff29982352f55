"""Fuzzing the edges: ``decode``, the ``serve`` framing, and refused calls.

1. ``decode`` of anything, for every public wire type and for the params of the
   serve methods: arbitrary bytes, byte-level corruptions of encoded values, JSON
   with every field name and wild values, deep nesting, numbers beyond int64 and
   uint64, ``1e400``, NaN, lone surrogates, invalid UTF-8. The answer is a value
   that re-encodes and decodes to an equal value, or an input ``DelegationError``
   that can itself go on the wire; nothing else ever escapes.
2. The serve framing, through the real ``Session`` in-process: whatever lines
   arrive (random bytes, invalid UTF-8, lines under and over 4 MiB cut at random
   chunk boundaries, deep nesting, huge numbers, missing, null, object or float
   ids, missing methods, params of the wrong type, batches, notifications), the
   session keeps serving. Every line that is a request gets exactly one JSON-RPC
   2.0 response, with the request's id when it can be read (else null) and the
   code JSON-RPC and design §2.3 assign; notifications get none; and the valid
   request that follows gets its correct answer. The expected answers come from an
   oracle written against the JSON and JSON-RPC 2.0 specifications (Python's json),
   not from the library.
3. A refused call changes nothing: Hypothesis draws broken or unauthorized params
   for the five methods against a scene on a real, migrated SQLite file; whenever
   the engine refuses, ``prepare`` was not called and every row of every table,
   read through a separate read-only connection, is as it was.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from delegation import (
    CANCEL_METHOD,
    READ_METHOD,
    RELEASE_METHOD,
    START_METHOD,
    STEER_METHOD,
    ChildContext,
    DelegationError,
    Engine,
    EngineConfig,
    ExecutionOptions,
    Params,
    Request,
    Result,
    RunnerConnection,
    decode,
    encode,
    errors,
    rpc,
)
from delegation._struct import I64_MAX, I64_MIN, U64_MAX, WireStruct
from delegation.backlog import Backlog
from delegation.clock import ManualClock
from delegation.host.serve import Session
from delegation.protocol import Register, RunFinish, ToolBegin, ToolEnd
from delegation.wire import CHILD_METHODS as METHODS
from tests.harness.fuzzing import snapshot
from tests.harness.support import HUGE_NUMBERS, PRESET, Harness, ScriptRunner, hold
from tests.harness.wire_types import WIRE_TYPES

FAST = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# One engine serves every example of a test (each example opens its own session).
SHARED = settings(
    FAST,
    suppress_health_check=[*FAST.suppress_health_check, HealthCheck.function_scoped_fixture],
)

# --- 1. decode --------------------------------------------------------------------

SERVE_TYPES: tuple[type[Any], ...] = (Register, ToolBegin, ToolEnd, RunFinish)
ALL_TYPES = WIRE_TYPES + SERVE_TYPES
TYPE_IDS = [kind.__name__ for kind in ALL_TYPES]


def _decode(data: Any, kind: type[Any]) -> Any:
    """The library's decoder for ``kind``: ``decode`` for wire types, the serve layer's
    ``decode_params`` for the params of its own methods."""
    if issubclass(kind, WireStruct):
        return decode(data, kind)
    return rpc.decode_params(data, kind)


def _encode(value: Any) -> bytes:
    return encode(value) if isinstance(value, WireStruct) else msgspec.json.encode(value)


def _check_input_refusal(exc: DelegationError) -> None:
    """A decode refusal is an input error (-32602) whose answer can be encoded."""
    assert isinstance(exc, errors.InputError), repr(exc)
    assert exc.rpc_code == -32602
    answer = json.loads(rpc.error_frame(exc, 1))
    assert answer["error"]["data"] == {"reason": exc.reason}


def _decoded_or_refused(data: Any, kind: type[Any]) -> Any:
    """The property: a value that round-trips, or a refusal fit for the wire."""
    try:
        value = _decode(data, kind)
    except DelegationError as exc:
        _check_input_refusal(exc)
        return None
    assert type(value) is kind
    raw = _encode(value)
    back = _decode(raw, kind)
    assert back == value
    assert _encode(back) == raw
    return value


LONE_SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff"]
PLAUSIBLE = ["", " ", "x", "openai", "anthropic", "high", "bash", "fork", "injected", "a/b", ".."]
TEXT = st.one_of(st.sampled_from(PLAUSIBLE), st.text(st.characters(codec="utf-8"), max_size=8))
WILD_TEXT = st.lists(st.one_of(st.characters(), st.sampled_from(LONE_SURROGATES)), max_size=8).map(
    "".join
)


ANY_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)  # no lone surrogate
ANY_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(I64_MIN, I64_MAX), ANY_TEXT,
              st.floats(allow_nan=False, allow_infinity=False)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(ANY_TEXT, inner, max_size=3)),
    max_leaves=8,
)  # fmt: skip


def _of_type(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values of a msgspec type, read from the wire types themselves: a new field is
    fuzzed without touching this file."""
    if isinstance(t, mi.StrType):
        return TEXT
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.IntType):
        low = I64_MIN if t.ge is None else t.ge
        high = U64_MAX if t.le is None else t.le
        edges = [v for v in (low, -1, 0, 1, I64_MAX, high) if low <= v <= high]
        return st.one_of(st.sampled_from(edges), st.integers(low, high))
    if isinstance(t, mi.FloatType):
        edges = st.sampled_from([0.0, -1.0, 1e-9, 1.5, 1e9, 2.0**63])
        return st.one_of(edges, st.floats(allow_nan=False, allow_infinity=False))
    if isinstance(t, mi.ListType):
        return st.lists(_of_type(t.item_type), max_size=3)
    if isinstance(t, mi.DictType):
        return st.dictionaries(_of_type(t.key_type), _of_type(t.value_type), max_size=3)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(_of_type(member) for member in t.types))
    if isinstance(t, mi.StructType):
        return _values(t.cls)
    if isinstance(t, mi.AnyType):  # any JSON (child.send's data)
        return ANY_VALUES
    raise TypeError(f"no strategy for {t}")


def _values(kind: type[Any]) -> st.SearchStrategy[Any]:
    info = mi.type_info(kind)
    assert isinstance(info, mi.StructType)
    fields = info.fields
    required = {f.name: _of_type(f.type) for f in fields if f.required}
    optional = {f.name: _of_type(f.type) for f in fields if not f.required}
    return st.fixed_dictionaries(required, optional=optional).map(lambda kw: kind(**kw))


def _json_names(kind: type[Any]) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(kind)]


FIELD_NAMES = sorted(
    {name for kind in ALL_TYPES for name in _json_names(kind)}
    | {"apiKey", "providerKey", "baseUrl", "endpoint", "sourceId", "RequestID", "run_id", ""}
)


@dataclass(frozen=True)
class Token:
    """JSON text written verbatim: numbers no Python value holds, NaN, broken escapes."""

    raw: bytes


def dump(node: Any, ascii_only: bool = False) -> bytes:
    """JSON bytes of ``node``; lone surrogates become ``\\ud800`` escapes (``ascii_only``)
    or their CESU-8 bytes, which are invalid UTF-8."""
    if isinstance(node, Token):
        return node.raw
    if isinstance(node, dict):
        items = (dump(str(k), ascii_only) + b":" + dump(v, ascii_only) for k, v in node.items())
        return b"{" + b",".join(items) + b"}"
    if isinstance(node, list):
        return b"[" + b",".join(dump(v, ascii_only) for v in node) + b"]"
    return json.dumps(node, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


DEPTH = 10_000
NASTY = [
    *HUGE_NUMBERS,
    b"null",
    b"true",
    b'"\\ud800"',
    b'"a\\udfffb"',
    b'"\\ud800\\ud800"',
    b'"\xed\xa0\x80"',  # a lone surrogate in CESU-8: invalid UTF-8
    b'"\xff\xfe"',
    b'"\xc0\xaf"',
    b'"\xf4\x90\x80\x80"',
    b'"\\u0000"',
    b"[" * DEPTH + b"]" * DEPTH,
    b'{"a":' * DEPTH + b"0" + b"}" * DEPTH,
    b"[" * (10 * DEPTH),
    b"[" * 500 + b"]" * 500,
    b'{"apiKey":"sk-secret"}',
    b"[null]",
    b'[""]',
]
TOKENS = st.sampled_from([Token(raw) for raw in NASTY if len(raw) < 600])
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([-1, 0, 1, I64_MAX, I64_MAX + 1, U64_MAX, U64_MAX + 1, I64_MIN - 1]),
    st.floats(),  # NaN and infinities become the non-JSON tokens json.dumps writes
    TEXT,
    WILD_TEXT,
    TOKENS,
)
JSON_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)  # no lone surrogate
JSON_VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), WILD_TEXT), inner, max_size=4),
    ),
    max_leaves=16,
)
# Objects keyed mostly by real field names, so the values reach the typed fields.
JSON_DOCUMENTS = st.dictionaries(
    st.one_of(st.sampled_from(FIELD_NAMES), WILD_TEXT), JSON_VALUES, max_size=6
)


def _forms(raw: bytes) -> list[Any]:
    """The same input as every type ``decode`` takes; the str may hold lone surrogates."""
    return [raw, bytearray(raw), memoryview(raw), raw.decode("utf-8", "surrogateescape")]


@pytest.mark.parametrize("kind", ALL_TYPES, ids=TYPE_IDS)
@FAST
@given(data=st.one_of(st.binary(max_size=48), st.binary(max_size=48).map(lambda b: b"{" + b)))
def test_decode_arbitrary_bytes(kind: type[Any], data: bytes) -> None:
    for form in _forms(data):
        _decoded_or_refused(form, kind)


@pytest.mark.parametrize("kind", ALL_TYPES, ids=TYPE_IDS)
@FAST
@given(data=st.data())
def test_decode_takes_back_what_encode_wrote(kind: type[Any], data: st.DataObject) -> None:
    """The base of the corruptions below: any value decodes back to itself, unless its
    ExecutionOptions are invalid (decoding validates them)."""
    value = data.draw(_values(kind), label="value")
    back = _decoded_or_refused(_encode(value), kind)
    if back is None:
        with pytest.raises(errors.InvalidOptions):
            _decode(_encode(value), kind)
    else:
        assert back == value


_PAIR = re.compile(rb'"[^"\\]*":("[^"\\]*"|[^,{}\[\]"]*),?')


@st.composite
def _corrupted(draw: st.DrawFn, kind: type[Any]) -> bytes:
    """An encoded value of ``kind`` with one to four byte-level corruptions."""
    raw = _encode(draw(_values(kind)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(raw)))
        end = draw(st.integers(at, len(raw)))
        token = dump(draw(st.one_of(TOKENS, LEAVES)), draw(st.booleans()))
        pairs = list(_PAIR.finditer(raw))
        colons = [m.end() for m in re.finditer(rb":", raw)]
        how = draw(st.sampled_from(["value", "value", "add", "drop", "insert", "cut", "byte"]))
        if how == "value" and colons:  # a field's value replaced by a wrong one
            start = draw(st.sampled_from(colons))
            stop = min([i for i in (raw.find(b",", start), raw.find(b"}", start)) if i >= 0] or [0])
            raw = raw[:start] + token + raw[max(stop, start) :]
        elif how == "add" and raw.startswith(b"{"):  # an unknown or duplicated field
            name = dump(draw(st.one_of(st.sampled_from(FIELD_NAMES), WILD_TEXT)))
            raw = b"{" + name + b":" + token + (b"," if raw[1:2] != b"}" else b"") + raw[1:]
        elif how == "drop" and pairs:  # a field gone, required or not
            pair = draw(st.sampled_from(pairs))
            raw = raw[: pair.start()] + raw[pair.end() :]
        elif how == "insert":
            raw = raw[:at] + token + raw[at:]
        elif how == "cut":
            raw = raw[:at] + raw[end:]
        else:
            raw = raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
    return raw


@pytest.mark.parametrize("kind", ALL_TYPES, ids=TYPE_IDS)
@FAST
@given(data=st.data())
def test_decode_corrupted_encodings(kind: type[Any], data: st.DataObject) -> None:
    raw = data.draw(_corrupted(kind), label="raw")
    for form in _forms(raw):
        _decoded_or_refused(form, kind)


@pytest.mark.parametrize("kind", ALL_TYPES, ids=TYPE_IDS)
@settings(FAST, max_examples=30)  # recursive JSON with wild text is slow to draw
@given(doc=JSON_DOCUMENTS, ascii_only=st.booleans())
def test_decode_json_with_wild_values(kind: type[Any], doc: Any, ascii_only: bool) -> None:
    _decoded_or_refused(dump(doc, ascii_only), kind)


@pytest.mark.parametrize("kind", ALL_TYPES, ids=TYPE_IDS)
def test_decode_nasty_values_in_every_field(kind: type[Any]) -> None:
    """Every nasty value in every field, at the top and inside the nested types."""
    payloads = [*NASTY, b"{}", b'{"a":1} {}', b'{"a":1}x', b"{" * DEPTH, b'{"a":' * DEPTH]
    for payload in payloads:
        _decoded_or_refused(payload, kind)
    for name in (*_json_names(kind), "apiKey"):
        key = dump(name)
        for value in NASTY:
            for doc in (
                b"{" + key + b":" + value + b"}",
                b'{"request":{"options":{' + key + b":" + value + b"}}}",
                b'{"options":{' + key + b":" + value + b"}}",
                b'{"events":[{"kind":"k",' + key + b":" + value + b"}]}",
                b'{"presets":[{"name":"p",' + key + b":" + value + b"}]}",
            ):
                for form in (doc, doc.decode("utf-8", "surrogateescape")):
                    _decoded_or_refused(form, kind)


def test_decode_accepts_the_edges_of_the_ranges() -> None:
    """The property above is not vacuous: the largest uint64 and int64 values decode."""
    params = _decoded_or_refused(
        b'{"runId":"r","extensionId":"e","generation":18446744073709551615,'
        b'"after":18446744073709551615}',
        Params,
    )
    assert params is not None
    assert params.generation == params.after == U64_MAX
    options = _decoded_or_refused(b'{"maxTokens":9223372036854775807}', ExecutionOptions)
    assert options == ExecutionOptions(max_tokens=I64_MAX)
    for too_big in (b'{"generation":18446744073709551616}', b'{"maxTokens":9223372036854775808}'):
        assert _decoded_or_refused(too_big, ExecutionOptions) is None
        assert _decoded_or_refused(too_big, Params) is None


# --- 2. the serve framing ----------------------------------------------------------

LIMIT = rpc.MAX_FRAME_BYTES
LIFECYCLE = ("runner.register", "tool.begin", "tool.end", "run.finish")
KNOWN_METHODS = frozenset(METHODS) | frozenset(LIFECYCLE)
RUN, CALL = "run-1", "call-1"
PRESET_JSON = json.loads(encode(PRESET))
OWNER = {
    "runId": RUN,
    "toolCallId": CALL,
    "extensionId": PRESET.extension_id,
    "generation": PRESET.generation,
}


@dataclass(repr=False)
class Host:
    """One engine on its own event loop, shared by the examples of one test."""

    loop: asyncio.Runner
    engine: Engine
    runner: ScriptRunner
    workspace: Path
    db: str  # the database's URL
    sessions: int = 0

    def __repr__(self) -> str:  # Hypothesis prints it with every failing example
        return f"Host(sessions={self.sessions})"


@pytest.fixture
def host(db_url: str, workspace: Path) -> Iterator[Host]:
    runner = ScriptRunner()
    config = EngineConfig(release_drain_s=5.0)
    with asyncio.Runner() as loop:
        engine = Engine(db_url, runner=runner, config=config, clock=ManualClock(1_800_000_000.0))
        loop.run(engine.open())
        try:
            yield Host(loop, engine, runner, workspace, db_url)
        finally:
            loop.run(engine.close())


def _frame(request_id: Any, method: str, params: Any) -> bytes:
    return dump({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})


def _setup(host: Host) -> list[bytes]:
    """Register a runner of its own for this session and open the tool call."""
    host.sessions += 1
    tool = {
        "runId": RUN,
        "conversationId": "conv-1",
        "toolCallId": CALL,
        "extensionId": PRESET.extension_id,
        "presets": [PRESET_JSON],
        "workspace": str(host.workspace),
    }
    register = {"runnerId": f"fuzz-{host.sessions}", "hostInstanceId": "h1"}
    return [_frame("~register", "runner.register", register), _frame("~tool", "tool.begin", tool)]


PROBE = _frame(
    "~probe",
    START_METHOD,
    {**OWNER, "request": {"requestId": "~probe", "profile": PRESET.name, "message": "probe"}},
)


async def _session(engine: Engine, stream: bytes, chunks: Sequence[int]) -> list[bytes]:
    """Serve ``stream`` on one in-process Session, read in chunks of the given sizes."""
    written: list[bytes] = []
    position = 0
    sizes = iter(chunks)

    async def read(limit: int) -> bytes:
        nonlocal position
        size = max(1, min(limit, next(sizes, limit)))
        chunk = stream[position : position + size]
        position += len(chunk)
        await asyncio.sleep(0)  # requests run while the stream is still arriving
        return chunk

    class Outbox:
        backlog = Backlog()

        def send(self, frame: bytes) -> None:
            written.append(frame)  # taken at once: nothing waits in the backlog

    await Session(engine, Outbox()).run(read)
    return written


# The oracle: what JSON (RFC 8259) and JSON-RPC 2.0 say a line deserves.

_MISSING = object()


class _Float:
    """A JSON number with a fraction or an exponent: never a valid id."""

    def __init__(self, text: str) -> None:
        self.text = text


class _Huge:
    """An integer too long for any decoder to hold: never a readable id."""


def _int(text: str) -> int | _Huge:
    return int(text) if len(text) <= 4000 else _Huge()


def _not_json(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _has_surrogate(node: Any) -> bool:
    if isinstance(node, str):
        return any("\ud800" <= ch <= "\udfff" for ch in node)
    if isinstance(node, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in node.items())
    if isinstance(node, list):
        return any(_has_surrogate(v) for v in node)
    return False


@dataclass(frozen=True)
class Expect:
    """What one line deserves: no answer, or one answer with this id and code.

    ``codes`` None: a result, or a refusal (-32602) of a known method.
    """

    answered: bool
    id: Any = None
    codes: frozenset[int] | None = None
    lifecycle: bool = False  # a runner/tool/run message: it may change the session


def expect(line: bytes) -> Expect:
    if not line.strip():
        return Expect(False)
    if len(line) > LIMIT:
        return Expect(True, None, frozenset({-32600}))
    try:
        message = json.loads(
            line.decode("utf-8"), parse_float=_Float, parse_int=_int, parse_constant=_not_json
        )
    except (ValueError, RecursionError):
        return Expect(True, None, frozenset({-32700}))
    if _has_surrogate(message):  # "\ud800" alone is no character: not a JSON text we take
        return Expect(True, None, frozenset({-32700}))
    if not isinstance(message, dict):  # batches included: one error, id null
        return Expect(True, None, frozenset({-32600}))
    request_id = message.get("id", _MISSING)
    id_ok = request_id is _MISSING or request_id is None or type(request_id) in (int, str)
    answer_id = request_id if request_id is not _MISSING and id_ok else None
    method = message.get("method")
    if not (
        id_ok
        and set(message) <= {"jsonrpc", "method", "id", "params"}
        and message.get("jsonrpc") == "2.0"
        and type(method) is str
    ):
        return Expect(True, answer_id, frozenset({-32600}))
    lifecycle = method in LIFECYCLE
    if request_id is _MISSING:
        return Expect(False, lifecycle=lifecycle)
    if method not in KNOWN_METHODS:
        return Expect(True, request_id, frozenset({-32601}))
    return Expect(True, request_id, None, lifecycle)


def _answer(frame: bytes) -> dict[str, Any]:
    """One well-formed JSON-RPC 2.0 response object on one line."""
    assert frame.endswith(b"\n") and frame.count(b"\n") == 1, frame[:200]
    message = json.loads(frame)
    assert isinstance(message, dict)
    assert message.get("jsonrpc") == "2.0"
    if "error" in message:
        assert set(message) == {"jsonrpc", "id", "error"}, message
        error = message["error"]
        assert type(error["code"]) is int and type(error["message"]) is str
        assert error.get("data", {}).keys() <= {"reason"}
        assert "Traceback" not in error["message"]
    else:
        assert set(message) == {"jsonrpc", "id", "result"}, message
    return message


def _key(request_id: Any) -> tuple[str, Any]:
    return type(request_id).__name__, request_id


def _accepts(rule: Expect, answer: dict[str, Any]) -> bool:
    if not rule.answered or _key(answer["id"]) != _key(rule.id):
        return False
    if rule.codes is None:
        return "result" in answer or answer["error"]["code"] == -32602
    return "error" in answer and answer["error"]["code"] in rule.codes


def _matched(answers: list[dict[str, Any]], rules: list[Expect]) -> bool:
    """Whether each answer belongs to its own line (a bipartite matching)."""
    owner: dict[int, int] = {}

    def place(a: int, seen: set[int]) -> bool:
        for r, rule in enumerate(rules):
            if r not in seen and _accepts(rule, answers[a]):
                seen.add(r)
                if r not in owner or place(owner[r], seen):
                    owner[r] = a
                    return True
        return False

    return all(place(a, set()) for a in range(len(answers)))


def _serve_and_check(host: Host, payload: bytes, chunks: Sequence[int] = ()) -> None:
    """Serve setup + ``payload`` + a probe on one session; check every answer."""
    stream = b"\n".join([*_setup(host), payload, PROBE]) + b"\n"
    written = host.loop.run(_session(host.engine, stream, chunks))
    answers = [_answer(frame) for frame in written]
    own = {a["id"]: a for a in answers if isinstance(a["id"], str) and a["id"].startswith("~")}
    rest = [a for a in answers if a not in own.values()]
    assert sorted(own) == ["~probe", "~register", "~tool"], answers
    assert own["~register"]["result"]["generation"] == 1
    assert own["~tool"]["result"] == {}
    rules = [expect(line) for line in payload.split(b"\n")]
    assert len(rest) == sum(rule.answered for rule in rules), (rules, rest)
    assert _matched(rest, rules), (rules, rest)
    probe = own["~probe"]
    lifecycle = {_key(rule.id) for rule in rules if rule.lifecycle and rule.answered}
    if any(rule.lifecycle and not rule.answered for rule in rules) or any(
        "result" in a and _key(a["id"]) in lifecycle for a in rest
    ):
        return  # a runner/tool/run message took effect: the probe's answer may differ
    assert "result" in probe, probe
    assert probe["result"]["parentRunId"] == RUN
    assert probe["result"]["profile"] == PRESET.name


# Generated JSON-RPC messages: mostly well-formed envelopes with broken parts.

ID_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, I64_MAX + 1, U64_MAX, U64_MAX + 1, I64_MIN - 1]),
    st.text(max_size=6).filter(lambda s: not s.startswith("~")),
    st.none(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.sampled_from([[], {}, {"id": 1}, [1]]),
    st.sampled_from([Token(b"1e400"), Token(b"1.0"), Token(b"-0"), Token(b"1" + b"0" * 40)]),
)
METHOD_NAMES = st.one_of(
    st.sampled_from([*METHODS, *LIFECYCLE, "child.Start", "no.such.method", "", "rpc.x"]),
    st.text(max_size=6),
)
PARAM_VALUES = st.one_of(
    st.sampled_from([RUN, CALL, "ext", "", "x", "L1", "../x", "nobody"]),
    st.sampled_from([0, 7, -1, U64_MAX, U64_MAX + 1, True, None, [], {}]),
    TOKENS,
    JSON_VALUES,
)
_REQUEST = {"requestId": "q", "profile": PRESET.name, "message": "m"}
PARAM_KEYS = sorted({*FIELD_NAMES, "childId", "request"})


@st.composite
def _params(draw: st.DrawFn) -> Any:
    """Params that are almost right (a child method's or a lifecycle's), or anything."""
    kind = draw(st.sampled_from(["child", "child", "lifecycle", "any", "deep"]))
    if kind == "any":
        return draw(JSON_VALUES)
    if kind == "deep":
        depth = draw(st.integers(1, 200))
        return Token(b"[" * depth + b"]" * depth)
    if kind == "child":
        params: dict[str, Any] = {**OWNER, "request": dict(_REQUEST)}
    else:
        params = {"runId": RUN, "toolCallId": CALL, "succeeded": True}
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(PARAM_KEYS))
        if draw(st.booleans()) and key in params:
            del params[key]
        else:
            params[key] = draw(PARAM_VALUES)
    return params


@st.composite
def _message(draw: st.DrawFn) -> dict[str, Any]:
    message: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        message["jsonrpc"] = "2.0"
    elif draw(st.booleans()):
        message["jsonrpc"] = draw(st.sampled_from(["1.0", "2", 2, 2.0, None, ["2.0"]]))
    if draw(st.integers(0, 9)):
        message["method"] = draw(METHOD_NAMES)
    elif draw(st.booleans()):
        message["method"] = draw(st.sampled_from([None, 1, [], {}, True]))
    if draw(st.integers(0, 3)):
        message["id"] = draw(ID_VALUES)
    if draw(st.integers(0, 3)):
        message["params"] = draw(_params())
    if not draw(st.integers(0, 9)):
        message[draw(st.sampled_from(["apiKey", "ID", "Method", "result"]))] = 1
    order = draw(st.permutations(list(message)))
    return {key: message[key] for key in order}


@st.composite
def _line(draw: st.DrawFn) -> bytes:
    """One line of input (it may still hold newlines when it is raw bytes)."""
    kind = draw(st.sampled_from(["message"] * 6 + ["batch", "bytes", "json", "deep", "blank"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40))
    if kind == "json":
        return dump(draw(JSON_VALUES), draw(st.booleans()))
    if kind == "deep":
        depth = draw(st.integers(1, 200))
        opener = draw(st.sampled_from([b"[", b'{"a":', b'{"params":']))
        closer = b"]" if opener == b"[" else b"}"
        return opener * depth + b"0" * (opener != b"[") + closer * depth
    if kind == "blank":
        return draw(st.sampled_from([b"", b" ", b"\t", b"\r", b" \x0c "]))
    if kind == "batch":
        return dump(draw(st.lists(_message(), max_size=3)))
    raw = dump(draw(_message()), draw(st.booleans()))
    corruption = draw(st.sampled_from([None] * 8 + ["cut", "byte", "tail", "crlf", "pad"]))
    at = draw(st.integers(0, len(raw)))
    if corruption == "cut":
        raw = raw[:at]
    elif corruption == "byte":
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\x00", b"}"])) + raw[at:]
    elif corruption == "tail":
        raw += draw(st.sampled_from([b" {}", b"x", b",", b" \x00"]))
    elif corruption == "crlf":
        raw += b"\r"
    elif corruption == "pad":
        raw = b"  \t" + raw + b" "
    return raw.replace(b"\n", b"")


@settings(SHARED, max_examples=100)
@given(line=_line())
def test_every_line_is_answered_and_the_session_goes_on(host: Host, line: bytes) -> None:
    _serve_and_check(host, line)


@settings(SHARED, max_examples=50)
@given(
    lines=st.lists(_line(), min_size=1, max_size=6),
    chunks=st.lists(st.integers(1, 64), max_size=40),
)
def test_a_stream_of_lines_cut_anywhere_is_answered_line_by_line(
    host: Host, lines: list[bytes], chunks: list[int]
) -> None:
    _serve_and_check(host, b"\n".join(lines), chunks)


def _padded(request_id: int, size: int) -> bytes:
    """A child.read of nobody's child, padded with JSON white space to ``size`` bytes."""
    line = _frame(request_id, READ_METHOD, {**OWNER, "childId": "nobody"})
    return line + b" " * (size - len(line))


NO_ANSWER = 0


def test_huge_deep_and_odd_lines_get_their_answers(host: Host) -> None:
    """Explicit examples too big for Hypothesis to draw, each with its exact answer."""
    deep = b"[" * DEPTH + b"]" * DEPTH
    read = {**OWNER, "childId": "nobody"}
    cases: list[tuple[bytes, Any, int | None]] = [
        # (line, the id of its answer, its error code or NO_ANSWER)
        (_padded(1, LIMIT - 1), 1, -32602),
        (_padded(2, LIMIT), 2, -32602),
        (_padded(3, LIMIT + 1), None, -32600),
        (b"x" * (2 * LIMIT + 7), None, -32600),
        (b"\xff" * (LIMIT + 1), None, -32600),
        (deep, None, -32700),
        (b"[" * (10 * DEPTH), None, -32700),
        (_frame(4, READ_METHOD, Token(deep)), None, -32700),
        (_frame(5, READ_METHOD, Token(b"[" * 300 + b"]" * 300)), 5, -32602),
        (_frame(6, READ_METHOD, {**read, "after": Token(b"1e400")}), 6, -32602),
        (_frame(7, READ_METHOD, {**read, "after": Token(b"1" + b"0" * 5000)}), 7, -32602),
        (_frame(8, READ_METHOD, {**read, "after": U64_MAX + 1}), 8, -32602),
        (_frame(9, READ_METHOD, {**read, "generation": -1}), 9, -32602),
        (_frame(Token(b"1e400"), READ_METHOD, read), None, -32600),
        (_frame(Token(b"1" + b"0" * 5000), READ_METHOD, read), None, -32600),
        (_frame(U64_MAX + 1, "no.such.method", {}), U64_MAX + 1, -32601),
        (_frame(-(2**70), "no.such.method", {}), -(2**70), -32601),
        (_frame(1.5, READ_METHOD, read), None, -32600),
        (_frame(True, READ_METHOD, read), None, -32600),
        (_frame({"id": 1}, READ_METHOD, read), None, -32600),
        (_frame(None, READ_METHOD, read), None, -32602),
        (_frame("", "no.such.method", {}), "", -32601),
        (b'{"jsonrpc":"2.0","id":10}', 10, -32600),
        (b'{"jsonrpc":"2.0","id":11,"method":null}', 11, -32600),
        (b'{"id":12,"method":"child.read"}', 12, -32600),
        (_frame(13, READ_METHOD, []), 13, -32602),
        (_frame(14, READ_METHOD, "params"), 14, -32602),
        (_frame(15, READ_METHOD, None), 15, -32602),
        (_frame(16, "runner.register", [1, 2]), 16, -32602),
        (_frame(17, "tool.end", {"runId": RUN}), 17, -32602),
        (b"[" + _frame(18, READ_METHOD, read) + b"]", None, -32600),
        (b"[]", None, -32600),
        (
            b'{"jsonrpc":"2.0","id":19,"method":"child.read","params":{"childId":"\xff"}}',
            None,
            -32700,
        ),
        (
            b'{"jsonrpc":"2.0","id":20,"method":"child.read","params":{"childId":"\\ud800"}}',
            None,
            -32700,
        ),
        (b'{"jsonrpc":"2.0","id":21,"method":"\xed\xa0\x80"}', None, -32700),
        (b'{"jsonrpc":"2.0","id":22,"method":"no.such"}\r', 22, -32601),
        (b'{"jsonrpc":"2.0","id":23,"method":"no.such"} {}', None, -32700),
        (b'{"jsonrpc":"2.0","id":24,"method":"child.read","params":{"after":NaN}}', None, -32700),
        (b'{"jsonrpc":"2.0","method":"no.such.method"}', None, NO_ANSWER),  # notifications
        (b'{"jsonrpc":"2.0","method":"child.read","params":{"after":1e400}}', None, NO_ANSWER),
        (b'{"jsonrpc":"2.0","method":"child.read","params":5}', None, NO_ANSWER),
        (b"   ", None, NO_ANSWER),  # blank lines are skipped
        (b"", None, NO_ANSWER),
    ]
    stream = b"\n".join([*_setup(host), *(line for line, _, _ in cases), PROBE]) + b"\n"
    written = host.loop.run(_session(host.engine, stream, ()))
    answers = [_answer(frame) for frame in written]
    got = sorted((repr(_key(a["id"])), a.get("error", {}).get("code")) for a in answers)
    wanted = [(repr(_key(i)), code) for _, i, code in cases if code != NO_ANSWER]
    wanted += [(repr(_key(i)), None) for i in ("~register", "~tool", "~probe")]
    missing, unexpected = Counter(wanted) - Counter(got), Counter(got) - Counter(wanted)
    assert not missing and not unexpected, (sorted(missing), sorted(unexpected))


def test_a_huge_last_line_without_newline_ends_the_session_cleanly(host: Host) -> None:
    stream = b"\n".join([*_setup(host), PROBE, b'{"a":"' + b"x" * (LIMIT + 5)])
    written = host.loop.run(_session(host.engine, stream, ()))
    answers = [_answer(frame) for frame in written]
    assert len(answers) == 4
    (too_long,) = [a for a in answers if a["id"] is None]
    assert too_long["error"]["code"] == -32600
    assert "4 MiB" in too_long["error"]["message"]
    stream = b"\n".join([*_setup(host), PROBE, _frame(30, "no.such", {})])  # no final newline
    answers = [_answer(f) for f in host.loop.run(_session(host.engine, stream, ()))]
    assert [a["error"]["code"] for a in answers if a["id"] == 30] == [-32601]


# --- 3. a refused call changes nothing ----------------------------------------------


async def settled(db: Path | str) -> dict[str, list[tuple[Any, ...]]]:
    """The snapshot once no write trails any more (a cancelled run stopping, say)."""
    before = snapshot(db)
    while True:
        await asyncio.sleep(0.02)
        now = snapshot(db)
        if now == before:
            return now
        before = now


async def hold_forever(ctx: ChildContext) -> None:
    """Admit, then do nothing until cancelled: no write of its own after admission."""
    await ctx.admit()
    await asyncio.Event().wait()


LEASE, TOMBSTONE = "L1", "L9"
BASE = Params(
    run_id="parent-run",
    tool_call_id="call-1",
    extension_id=PRESET.extension_id,
    generation=PRESET.generation,
)


@dataclass
class Scene:
    """One runner's children in every situation a call may name, on the shared file.

    ``children`` maps a name to (conversationId, runId, leaseId): ``tool`` and
    ``leased`` are held running, ``old`` was cancelled and ``follow`` resumed it (two
    executions of one conversation), ``foreign`` belongs to another runner.
    """

    conn: RunnerConnection
    stale: RunnerConnection  # the same runner's superseded connection
    other: RunnerConnection  # another runner's current connection
    children: dict[str, tuple[str, str, str]] = field(default_factory=dict)


async def _wait_terminal(engine: Engine, conversation_id: str, run_id: str) -> None:
    for _ in range(500):
        record = await engine.get_child(conversation_id, run_id)
        if record is not None and record.terminal:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"child {conversation_id} did not stop")


async def build_scene(host: Host) -> Scene:
    host.sessions += 1
    host.runner.script = hold_forever
    engine, n, workspace = host.engine, host.sessions, str(host.workspace)
    stale = await engine.connect(f"runner-{n}", "host-a")
    conn = await engine.connect(f"runner-{n}", "host-a")
    other = await engine.connect(f"other-{n}", "host-b")
    scene = Scene(conn, stale, other)
    for owner, call in ((other, "call-9"), (conn, "call-1")):
        await engine.open_tool(
            owner,
            run_id=BASE.run_id,
            conversation_id="parent-conv",
            tool_call_id=call,
            extension_id=PRESET.extension_id,
            presets=[PRESET],
            workspace=workspace,
        )

    async def start(name: str, owner: RunnerConnection = conn, **changes: Any) -> Result:
        call = "call-9" if owner is other else "call-1"
        lease = changes.get("lease_id", "")
        request = Request(request_id=f"q-{name}", profile=PRESET.name, message="do it", **changes)
        params = msgspec.structs.replace(BASE, tool_call_id=call, lease_id=lease, request=request)
        result = await engine.call(owner, START_METHOD, params)
        assert isinstance(result, Result)
        scene.children[name] = (result.conversation_id, result.run_id, lease)
        return result

    await start("tool")
    await start("leased", lease_id=LEASE)
    await start("foreign", other)
    old = await start("old")
    await engine.call(
        conn, CANCEL_METHOD, msgspec.structs.replace(BASE, child_id=old.conversation_id)
    )
    await _wait_terminal(engine, old.conversation_id, old.run_id)
    await start("follow", resume=old.conversation_id)
    steer = {"request_id": "s-1", "message": "turn left"}
    tool_child = scene.children["tool"][0]
    await engine.call(
        conn, STEER_METHOD, msgspec.structs.replace(BASE, child_id=tool_child, **steer)
    )
    await engine.call(conn, RELEASE_METHOD, msgspec.structs.replace(BASE, lease_id=TOMBSTONE))
    return scene


# Values that break a call (or, for some, that a call may take): "@name" stands for
# the conversation id of the scene's child ``name``, "@name.run" for its run id.
CHILD_REFS = ["@tool", "@leased", "@old", "@follow", "@foreign"]
RUN_REFS = [f"{ref}.run" for ref in CHILD_REFS]
UINT64_EDGES = st.one_of(
    st.sampled_from([0, 1, 6, 7, 8, I64_MAX, I64_MAX + 1, U64_MAX]), st.integers(0, U64_MAX)
)
BROKEN: dict[str, st.SearchStrategy[Any]] = {
    "run_id": st.sampled_from(["other-run", "", "parent-run ", "PARENT-RUN", "\ud800", "\x00"]),
    "tool_call_id": st.sampled_from(["call-2", "call-9", "", "call-1\x00"]),
    "extension_id": st.sampled_from(["other-ext", "", "EXT", "ext/.."]),
    "generation": UINT64_EDGES,
    "child_id": st.sampled_from(["", "nobody", ".", "..", "a/b", "x" * 200, "\ud800", *CHILD_REFS]),
    "child_run_id": st.sampled_from(["", "r-nobody", "x" * 200, *RUN_REFS]),
    "lease_id": st.sampled_from(["", LEASE, TOMBSTONE, "L-none", "../L", "a/b", "x" * 200, " "]),
    "after": UINT64_EDGES,
    "message": st.sampled_from(["", " ", "\t\n", "x" * 10_001, "turn right", "\ud800"]),
    "request_id": st.sampled_from(["", " ", "s-1", "s-2", "../s", "x" * 129, "s\x7f"]),
}
BAD_OPTIONS = [
    ExecutionOptions(provider="bogus"),
    ExecutionOptions(max_tokens=0),
    ExecutionOptions(max_turns=-1),
    ExecutionOptions(allowed_tools=[""]),
    ExecutionOptions(reasoning_effort="extreme"),
    ExecutionOptions(model=" "),
]
BROKEN_REQUEST: dict[str, st.SearchStrategy[Any]] = {
    "request_id": st.sampled_from(["", "  ", "x" * 129, "q-tool", "q-leased", "q-old", "q-2"]),
    "profile": st.sampled_from(["", " ", "missing", "worker/..", "\ud800"]),
    "message": st.sampled_from(["", " ", "x" * (512 * 1024 + 1), "something else", "\x00"]),
    "context_mode": st.sampled_from(["bogus", "fork", "fresh", "FORK"]),
    "resume": st.sampled_from(["nope", "../x", "x" * 200, *CHILD_REFS]),
    "cwd": st.sampled_from(["..", "../..", "/", "/etc", "missing", "sub", "sub/../..", "\x00"]),
    "system_prompt": st.sampled_from(["x" * (256 * 1024 + 1), "be brief"]),
    "options": st.sampled_from(BAD_OPTIONS),
    "lease_id": st.sampled_from(["", LEASE, "L2", TOMBSTONE, "../x"]),
}
AUTHORITY = ["run_id", "tool_call_id", "extension_id", "generation", "lease_id"]
LOCATE = ["child_id", "child_run_id"]
STEERING = ["message", "request_id"]
REQUEST_FIELDS = sorted(BROKEN_REQUEST)
# Where a method's drawn defects come from; authority is drawn less often, since
# it answers first and would hide every later check.
POOLS = {
    START_METHOD: [AUTHORITY, *[REQUEST_FIELDS] * 4, ["after"]],
    READ_METHOD: [AUTHORITY, LOCATE, LOCATE, LOCATE, ["after"]],
    CANCEL_METHOD: [AUTHORITY, LOCATE, LOCATE, LOCATE, ["after"]],
    STEER_METHOD: [AUTHORITY, LOCATE, LOCATE, STEERING, STEERING, STEERING],
    RELEASE_METHOD: [AUTHORITY],
}
CONNECTIONS = ["conn"] * 20 + ["stale", "other", "ghost", "forged"]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...<{len(text)} chars>"


@dataclass(frozen=True, repr=False)
class Call:
    """A drawn call, resolved against a scene when it is made."""

    method: str
    target: str
    connection: str
    changes: tuple[tuple[str, Any], ...]
    request_changes: tuple[tuple[str, Any], ...]
    as_json: str  # "no", "yes" or "apiKey": the params as JSON, with an unknown field

    def __repr__(self) -> str:  # short: a 512 KiB message is drawn now and then
        changes = {k: _short(v) for k, v in (*self.changes, *self.request_changes)}
        return f"Call({self.method}, {self.target}, {self.connection}, {changes}, {self.as_json})"

    def resolve(self, scene: Scene) -> tuple[RunnerConnection, Params | bytes]:
        def value(v: Any) -> Any:
            if isinstance(v, str) and v.startswith("@"):
                name, _, part = v[1:].partition(".")
                conversation_id, run_id, _ = scene.children[name]
                return run_id if part else conversation_id
            return v

        conversation_id, _, lease = scene.children[self.target]
        params = msgspec.structs.replace(BASE, lease_id=lease)
        if self.method == START_METHOD:
            request = Request(request_id="q-new", profile=PRESET.name, message="do it")
            request = msgspec.structs.replace(request, lease_id=lease)
            request = msgspec.structs.replace(
                request, **{k: value(v) for k, v in self.request_changes}
            )
            params = msgspec.structs.replace(params, request=request)
        elif self.method in (READ_METHOD, CANCEL_METHOD, STEER_METHOD):
            params = msgspec.structs.replace(params, child_id=conversation_id)
            if self.method == STEER_METHOD:
                params = msgspec.structs.replace(params, request_id="s-2", message="turn")
        params = msgspec.structs.replace(params, **{k: value(v) for k, v in self.changes})
        conn = {
            "conn": scene.conn,
            "stale": scene.stale,
            "other": scene.other,
            "ghost": RunnerConnection("conn-ghost", "ghost", "host-a", 1),
            "forged": RunnerConnection(
                scene.conn.id, scene.conn.runner_id, "host-a", scene.conn.generation + 1
            ),
        }[self.connection]
        if self.as_json == "no":
            return conn, params
        try:
            raw = encode(params)
        except UnicodeEncodeError:  # a lone surrogate has no JSON form: keep the object
            return conn, params
        if self.as_json == "apiKey":
            raw = b'{"apiKey":"sk-secret",' + raw[1:]
        return conn, raw


@st.composite
def calls(draw: st.DrawFn) -> Call:
    method = draw(st.sampled_from(sorted(POOLS)))
    target = draw(st.sampled_from(["tool", "tool", "leased", "follow", "old", "foreign"]))
    changes: dict[str, Any] = {}
    request_changes: dict[str, Any] = {}
    for _ in range(draw(st.integers(1, 3))):
        pool = draw(st.sampled_from(POOLS[method]))
        name = draw(st.sampled_from(pool))
        if pool is REQUEST_FIELDS:
            request_changes[name] = draw(BROKEN_REQUEST[name])
        else:
            changes[name] = draw(BROKEN[name])
    return Call(
        method,
        target,
        draw(st.sampled_from(CONNECTIONS)),
        tuple(changes.items()),
        tuple(request_changes.items()),
        draw(st.sampled_from(["no"] * 6 + ["yes"] * 3 + ["apiKey"])),
    )


@dataclass
class Tally:
    scene: Scene | None = None
    refused: int = 0
    accepted: int = 0
    reasons: Counter[str] = field(default_factory=Counter)


async def _refusal_changes_nothing(host: Host, tally: Tally, call: Call) -> None:
    if tally.scene is None:
        tally.scene = await build_scene(host)
    conn, params = call.resolve(tally.scene)
    before = await settled(host.db)
    assert before["children"], "the snapshot must see the store"
    prepared = len(host.runner.prepared)
    try:
        await host.engine.call(conn, call.method, params)
    except DelegationError as exc:
        refusal: DelegationError | None = exc
    else:
        refusal = None
    if refusal is None:
        tally.accepted += 1
        tally.scene = None  # it may have changed the scene: the next call gets a new one
        return
    tally.refused += 1
    tally.reasons[refusal.reason] += 1
    await asyncio.sleep(0.02)  # nothing may trail the refusal either
    assert len(host.runner.prepared) == prepared, f"prepare was called for {call}"
    assert snapshot(host.db) == before, f"{refusal!r} changed the database for {call}"
    # A lone surrogate cannot come over the wire (decode refuses it); handed to the
    # engine in a Params object, it fails in SQLite's text encoding: an internal fault.
    internal_ok = "\\ud800" in repr(params) and isinstance(refusal, errors.InternalError)
    assert refusal.rpc_code == -32602 or internal_ok, f"{refusal!r} for {call}"


def test_a_refused_call_changes_nothing(host: Host) -> None:
    tally = Tally()

    @settings(SHARED, max_examples=100)
    @given(call=calls())
    # An ``after`` beyond int64 (a valid uint64) once made start and cancel write and
    # then fail, and read fail as an internal fault.
    @example(Call(START_METHOD, "tool", "conn", (("after", U64_MAX),), (), "no"))
    @example(Call(CANCEL_METHOD, "leased", "conn", (("after", I64_MAX + 1),), (), "yes"))
    @example(Call(READ_METHOD, "tool", "conn", (("after", U64_MAX),), (), "no"))
    def check(call: Call) -> None:
        host.loop.run(_refusal_changes_nothing(host, tally, call))

    check()
    # Not vacuous: most drawn calls are refusals, for many different reasons.
    assert tally.refused >= 2 * tally.accepted, tally
    assert len(tally.reasons) >= 8, tally.reasons


async def test_a_refused_read_leaves_later_reads_fresh(harness: Harness) -> None:
    """A read refused deep in the locate step (the purged-child lookup) must not leave
    the engine's reader inside a transaction: later reads see new commits, and the
    read models still work."""
    gate = asyncio.Event()
    harness.runner.script = hold(gate)
    child = await harness.start("q1")
    with pytest.raises(errors.ChildNotOwned):
        await harness.read("nobody")
    gate.set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while not (result := await harness.read(child.conversation_id)).done:
        assert loop.time() < deadline, "child.read never saw the child finish"
        await asyncio.sleep(0.01)
    assert [event.text for event in result.events] == ["working", "finished"]
    record = await harness.engine.get_child(child.conversation_id)
    assert record is not None and record.state == "done"
