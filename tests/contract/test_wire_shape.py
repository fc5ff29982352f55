"""The shape of the wire, design §2: JSON names, what is always written, what is omitted."""

from __future__ import annotations

import json

import msgspec
import pytest

import delegation
from delegation import (
    Event,
    ExecutionOptions,
    Identity,
    Params,
    Preset,
    Profile,
    Request,
    Result,
    Rewind,
    SteerResult,
    encode,
)

# design §2, in order: (JSON name, always present?)
SHAPES: dict[type[msgspec.Struct], list[tuple[str, bool]]] = {
    Profile: [
        ("name", True),
        ("options", False),
        ("systemPromptPath", False),
        ("systemPrompt", False),
        ("priority", False),  # its children's when a request gives none (design §22)
    ],
    Preset: [
        ("name", True),
        ("options", False),
        ("systemPromptPath", False),
        ("systemPrompt", False),
        ("priority", False),
        ("extensionId", True),
        ("generation", True),
    ],
    Request: [
        ("contextMode", False),
        ("resume", False),
        ("requestId", True),
        ("profile", True),
        ("message", True),
        ("options", False),
        ("systemPrompt", False),
        ("cwd", False),
        ("leaseId", False),
        ("priority", False),  # admission order, 0-9 (design §22)
        ("rewind", False),  # a follow-up seeded from a recorded step (design §35)
    ],
    Rewind: [("runId", True), ("step", False)],
    Params: [
        ("runId", True),
        ("toolCallId", False),
        ("extensionId", True),
        ("generation", True),
        ("request", False),
        ("childId", False),
        ("childRunId", False),
        ("message", False),
        ("requestId", False),
        ("leaseId", False),
        ("after", False),
        ("inputId", False),  # child.input (design §21)
        ("decision", False),
        ("key", False),  # child.send (design §33)
        ("data", False),
    ],
    Identity: [
        ("runnerId", False),
        ("hostInstanceId", False),
        ("conversationId", True),
        ("runId", True),
        ("parentConversationId", True),
        ("parentRunId", True),
        ("extensionId", True),
        ("profile", True),
    ],
    Event: [
        ("sequence", True),
        ("kind", True),
        ("text", False),
        ("toolName", False),
        ("toolCallId", False),
        ("input", False),
        ("toolOutput", False),
        ("success", False),
        ("error", False),
    ],
    SteerResult: [("outcome", True), ("reason", False)],
    ExecutionOptions: [
        (name, False)
        for name in (
            "provider",
            "model",
            "weakModel",
            "maxTokens",
            "weakModelMaxTokens",
            "thinkingBudgetTokens",
            "reasoningEffort",
            "maxTurns",
            "useWeakModel",
            "noTools",
            "noExtensions",
            "noSkills",
            "allowedTools",
            "allowedCommands",
            "enableFSSearchTools",
            "deadlineSeconds",  # design §22
        )
    ],
}
SHAPES[Result] = SHAPES[Identity] + [
    ("done", True),
    ("cancelled", False),
    ("error", False),
    ("output", False),
    ("events", False),
    ("inputRequests", False),  # only while a child that asked has one open (§21)
    ("queued", False),  # only while it waits its turn (§22)
    ("queuePosition", False),
    ("pinnedVersion", False),  # design §34
]
REQUIRED = {Event: {"kind": "text"}, SteerResult: {"outcome": "injected"}}


@pytest.mark.parametrize("kind", SHAPES, ids=lambda k: k.__name__)
def test_json_names_are_exact_and_in_order(kind: type[msgspec.Struct]) -> None:
    names = [f.encode_name for f in msgspec.structs.fields(kind)]
    assert names == [name for name, _ in SHAPES[kind]]


@pytest.mark.parametrize("kind", SHAPES, ids=lambda k: k.__name__)
def test_empty_values_write_exactly_the_unmarked_fields(kind: type[msgspec.Struct]) -> None:
    written = list(json.loads(encode(kind(**REQUIRED.get(kind, {})))))
    assert written == [name for name, always in SHAPES[kind] if always]


@pytest.mark.parametrize("kind", SHAPES, ids=lambda k: k.__name__)
def test_attributes_are_snake_case_of_json_names(kind: type[msgspec.Struct]) -> None:
    for field in msgspec.structs.fields(kind):
        expected = "".join("_" + c.lower() if c.isupper() else c for c in field.encode_name)
        expected = expected.replace("f_s_search", "fs_search")
        assert field.name == expected


def test_done_false_and_sequence_zero_are_written() -> None:
    assert json.loads(encode(Result(done=False)))["done"] is False
    assert json.loads(encode(Event(kind="text")))["sequence"] == 0


def test_success_absent_means_unknown() -> None:
    assert "success" not in json.loads(encode(Event(kind="tool")))
    assert json.loads(encode(Event(kind="tool", success=False)))["success"] is False


def test_result_flattens_identity() -> None:
    result = Result(conversation_id="c", run_id="r", done=True, events=[Event(kind="t")])
    wire = json.loads(encode(result))
    assert wire["conversationId"] == "c"
    assert wire["events"] == [{"sequence": 0, "kind": "t"}]
    assert "identity" not in wire


def test_wire_values_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Params().run_id = "x"  # type: ignore[misc]


def test_method_constants() -> None:
    assert delegation.START_METHOD == "child.start"
    assert delegation.READ_METHOD == "child.read"
    assert delegation.CANCEL_METHOD == "child.cancel"
    assert delegation.STEER_METHOD == "child.steer"
    assert delegation.RELEASE_METHOD == "child.lease.release"


def test_public_exports() -> None:
    for name in (
        "decode",
        "valid_id",
        "DelegationError",
        "Profile",
        "Preset",
        "Request",
        "Params",
        "Identity",
        "Event",
        "Result",
        "SteerResult",
        "ExecutionOptions",
        "START_METHOD",
        "READ_METHOD",
        "CANCEL_METHOD",
        "STEER_METHOD",
        "RELEASE_METHOD",
    ):
        assert (
            getattr(delegation, name) is not None
        )  # listed or forwarded (tests/contract/test_face.py)
