"""Golden wire vectors of design §2, shared with clients in other languages.

Every case of ``tests/harness/vectors/*.json`` (format: ``tests/harness/vectors/README.md``) is one
test: the input is decoded strictly into its type; a valid case must re-encode to
the exact canonical bytes (and the canonical text must be a fixed point), an invalid
one must raise the :class:`DelegationError` with the exact ``reason``. Request,
Profile and Preset cases also say what ``.validate()`` does, with the exact message
design §2.2 quotes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

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
)

VECTORS = Path(__file__).resolve().parents[1] / "harness" / "vectors"

# One file per wire type; the file name is the contract, not a glob.
FILES: dict[str, type[Any]] = {
    "params": Params,
    "request": Request,
    "profile": Profile,
    "preset": Preset,
    "execution_options": ExecutionOptions,
    "event": Event,
    "identity": Identity,
    "result": Result,
    "steer_result": SteerResult,
}
VALIDATED = {"Request", "Profile", "Preset"}
CASE_KEYS = {"name", "input", "valid", "canonical", "reason", "validate", "message", "repeat"}
RPC_INVALID_PARAMS = -32602


def _load(stem: str) -> dict[str, Any]:
    with (VECTORS / f"{stem}.json").open(encoding="utf-8") as handle:
        doc: dict[str, Any] = json.load(handle)
    return doc


DOCS = {stem: _load(stem) for stem in FILES}
CASES = [
    pytest.param(stem, case, id=f"{stem}:{case['name']}")
    for stem, doc in DOCS.items()
    for case in doc["cases"]
]


def _expand(text: str, repeat: dict[str, Any] | None) -> str:
    """Apply the ``repeat`` hint: set one top-level string field to a long run of a char."""
    if repeat is None:
        return text
    obj = json.loads(text)
    field = repeat["field"]
    assert isinstance(obj, dict), "repeat applies to a JSON object"
    assert field in obj, f"repeat field {field!r} must already be present (keeps key order)"
    obj[field] = repeat["char"] * repeat["count"]
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _decode(stem: str, text: str) -> Any:
    return decode(text.encode("utf-8"), FILES[stem])


# --- the vector files themselves ------------------------------------------------


def test_every_wire_type_has_a_vector_file() -> None:
    on_disk = {path.stem for path in VECTORS.glob("*.json")}
    assert on_disk == set(FILES)


@pytest.mark.parametrize("stem", sorted(FILES))
def test_vector_file_is_well_formed(stem: str) -> None:
    doc = DOCS[stem]
    assert set(doc) == {"type", "cases"}
    assert doc["type"] == FILES[stem].__name__
    names = [case["name"] for case in doc["cases"]]
    assert len(names) == len(set(names)), "case names must be unique"
    for case in doc["cases"]:
        where = f"{stem}:{case.get('name')}"
        assert set(case) <= CASE_KEYS, where
        assert isinstance(case["name"], str), where
        assert case["name"], where
        assert isinstance(case["input"], str), where
        assert isinstance(case["valid"], bool), where
        if case["valid"]:
            assert isinstance(case["canonical"], str), where
            assert "reason" not in case, where
        else:
            assert isinstance(case["reason"], str), where
            assert "canonical" not in case, where
            assert "validate" not in case, where
            assert "message" not in case, where
        if "validate" in case:
            assert doc["type"] in VALIDATED, where
            assert ("message" in case) == (case["validate"] != "ok"), where
        else:
            assert "message" not in case, where
        if "repeat" in case:
            repeat = case["repeat"]
            assert set(repeat) == {"field", "char", "count"}, where
            assert len(repeat["char"]) == 1, where
            assert repeat["count"] > 0, where


def test_vectors_cover_both_outcomes_of_every_type() -> None:
    for stem, doc in DOCS.items():
        outcomes = {case["valid"] for case in doc["cases"]}
        assert outcomes == {True, False}, stem
        if doc["type"] in VALIDATED:
            assert all(case["valid"] is False or "validate" in case for case in doc["cases"])


# --- the behaviour --------------------------------------------------------------


@pytest.mark.parametrize(("stem", "case"), CASES)
def test_vector(stem: str, case: dict[str, Any]) -> None:
    repeat = case.get("repeat")
    data = _expand(case["input"], repeat)

    if not case["valid"]:
        with pytest.raises(DelegationError) as caught:
            _decode(stem, data)
        assert caught.value.reason == case["reason"], str(caught.value)
        assert caught.value.rpc_code == RPC_INVALID_PARAMS
        return

    value = _decode(stem, data)
    canonical = _expand(case["canonical"], repeat)
    assert encode(value).decode("utf-8") == canonical
    # The canonical text is itself a valid input that encodes to itself.
    again = _decode(stem, canonical)
    assert again == value
    assert encode(again).decode("utf-8") == canonical

    expected = case.get("validate")
    if expected is None:
        return
    if expected == "ok":
        value.validate()
        return
    with pytest.raises(DelegationError) as caught:
        value.validate()
    assert caught.value.reason == expected, str(caught.value)
    assert str(caught.value) == case["message"]
    assert caught.value.rpc_code == RPC_INVALID_PARAMS
