"""Validation after decoding, design §2.2: valid_id, Request and Profile, exact messages."""

from __future__ import annotations

from typing import Any

import pytest

from delegation import ExecutionOptions, Preset, Profile, Request, errors, valid_id

KIB = 1024


@pytest.mark.parametrize(
    "value",
    ["a", "conv-1", "x" * 128, "é" * 64, "a.b", "...", "A_b~c:d@e", "日本"],
)
def test_valid_ids(value: str) -> None:
    assert valid_id(value)


@pytest.mark.parametrize(
    "value",
    [
        "",
        ".",
        "..",
        "x" * 129,
        "é" * 65,
        "a/b",
        "a\\b",
        "a b",
        "a\tb",
        "a\nb",
        "\x00",
        "a\x7f",
        "\x1f",
        " a",
        "a ",
    ],
)
def test_invalid_ids(value: str) -> None:
    assert not valid_id(value)


def make_request(**changes: Any) -> Request:
    base: dict[str, Any] = {"request_id": "req-1", "profile": "p", "message": "do it"}
    return Request(**{**base, **changes})


def test_a_minimal_request_is_valid() -> None:
    make_request().validate()


@pytest.mark.parametrize(
    "changes",
    [
        {"request_id": ""},
        {"request_id": "  "},
        {"request_id": "x" * 129},
        {"profile": ""},
        {"profile": " \t"},
        {"message": ""},
        {"message": "\n "},
    ],
)
def test_request_requires_id_profile_message(changes: dict[str, Any]) -> None:
    with pytest.raises(errors.RequestIncomplete) as info:
        make_request(**changes).validate()
    assert str(info.value) == "child requestId, profile and message are required"


@pytest.mark.parametrize(
    ("field", "limit"),
    [("message", 512 * KIB), ("system_prompt", 256 * KIB), ("cwd", 8192)],
)
def test_request_size_limits_are_exact(field: str, limit: int) -> None:
    make_request(**{field: "a" * limit}).validate()
    with pytest.raises(errors.InputTooLarge) as info:
        make_request(**{field: "a" * (limit + 1)}).validate()
    assert str(info.value) == "child input exceeds limit"


def test_request_limits_count_utf8_bytes() -> None:
    make_request(cwd="é" * 4096).validate()
    with pytest.raises(errors.InputTooLarge):
        make_request(cwd="é" * 4096 + "a").validate()


def test_request_id_limit_is_exact() -> None:
    make_request(request_id="x" * 128).validate()


@pytest.mark.parametrize("mode", ["", "fresh", "fork"])
def test_context_modes(mode: str) -> None:
    make_request(context_mode=mode).validate()


@pytest.mark.parametrize("mode", ["Fresh", "new", " fork", "resume"])
def test_bad_context_mode(mode: str) -> None:
    with pytest.raises(errors.BadContextMode) as info:
        make_request(context_mode=mode).validate()
    assert str(info.value) == "child contextMode must be fresh or fork"


def test_resume() -> None:
    make_request(resume="conv-1").validate()
    make_request(resume="conv-1", context_mode="fresh").validate()
    message = "child resume requires a valid owned conversation ID and cannot be combined with fork"
    for changes in ({"resume": "../x"}, {"resume": "a b"}, {"resume": "c", "context_mode": "fork"}):
        with pytest.raises(errors.BadResume) as info:
            make_request(**changes).validate()
        assert str(info.value) == message


def test_request_validates_its_options_last() -> None:
    with pytest.raises(errors.InvalidOptions):
        make_request(options=ExecutionOptions(max_tokens=0)).validate()
    with pytest.raises(errors.BadContextMode):
        make_request(context_mode="x", options=ExecutionOptions(max_tokens=0)).validate()


def test_request_checks_run_in_spec_order() -> None:
    with pytest.raises(errors.RequestIncomplete):
        make_request(message="", system_prompt="a" * (256 * KIB + 1)).validate()
    with pytest.raises(errors.InputTooLarge):
        make_request(cwd="a" * 8193, context_mode="bogus").validate()


def test_profile_valid() -> None:
    Profile(name="reviewer", system_prompt="be brief").validate()
    Preset(name="reviewer", extension_id="ext", generation=3).validate()


@pytest.mark.parametrize("name", ["", "  ", "a/b", "a\\b", "a\x00b", "x" * 129])
def test_profile_name(name: str) -> None:
    with pytest.raises(errors.BadPresetName) as info:
        Profile(name=name).validate()
    assert str(info.value) == "execution preset requires a simple nonempty name"


def test_profile_name_limit_is_exact() -> None:
    Profile(name="x" * 128).validate()


def test_profile_prompt_limits_are_exact() -> None:
    Profile(name="p", system_prompt="a" * (256 * KIB)).validate()
    Profile(name="p", system_prompt_path="a" * 8192).validate()
    for changes in ({"system_prompt": "a" * (256 * KIB + 1)}, {"system_prompt_path": "a" * 8193}):
        with pytest.raises(errors.PresetPromptTooLarge) as info:
            Profile(name="p", **changes).validate()
        assert str(info.value) == "execution preset prompt exceeds limit"


def test_profile_prompt_content_or_path() -> None:
    with pytest.raises(errors.PresetPromptConflict) as info:
        Profile(name="p", system_prompt="x", system_prompt_path="/p").validate()
    assert str(info.value) == (
        "execution preset must use prompt content or a prompt path, not both"
    )


def test_profile_validates_options() -> None:
    with pytest.raises(errors.InvalidOptions):
        Preset(name="p", options=ExecutionOptions(provider="gemini")).validate()
    Preset(name="p", options=ExecutionOptions(provider="gemini")).validate(providers=["gemini"])


def test_blank_is_go_trim_space() -> None:
    make_request(message="\x1f").validate()  # a separator, not white space, in Go
    for space in (" ", "\t", "\u00a0", "\u2028", "\u3000", "\u0085"):
        with pytest.raises(errors.RequestIncomplete):
            make_request(message=space * 3).validate()
