"""ExecutionOptions: value validation, presence semantics and the policy helpers."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from delegation import ExecutionOptions, errors
from delegation.options import REASONING_EFFORTS

UNSET = msgspec.UNSET


def test_empty_options_are_valid_and_allow_everything() -> None:
    options = ExecutionOptions()
    options.validate()
    assert not options.tools_disabled()
    assert options.tool_allowed("bash")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"provider": "gemini"}, "unsupported execution provider 'gemini'"),
        ({"provider": " "}, "execution option provider must be nonempty and contain no NUL"),
        ({"model": ""}, "execution option model must be nonempty and contain no NUL"),
        ({"weak_model": "a\x00"}, "execution option weakModel must be nonempty and contain no NUL"),
        ({"reasoning_effort": "extreme"}, "unsupported reasoning effort 'extreme'"),
        ({"max_tokens": 0}, "execution option maxTokens must be positive"),
        ({"weak_model_max_tokens": -5}, "execution option weakModelMaxTokens must be positive"),
        ({"max_turns": -1}, "execution option maxTurns must not be negative"),
        (
            {"thinking_budget_tokens": -1},
            "execution option thinkingBudgetTokens must not be negative",
        ),
        (
            {"allowed_tools": ["read", " "]},
            "execution option allowedTools contains an empty or invalid entry",
        ),
        (
            {"allowed_commands": ["l\x00s"]},
            "execution option allowedCommands contains an empty or invalid entry",
        ),
    ],
)
def test_invalid_values(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InvalidOptions) as info:
        ExecutionOptions(**changes).validate()
    assert str(info.value) == message


@pytest.mark.parametrize("effort", [*sorted(REASONING_EFFORTS), " HIGH ", "Max", "xHigh"])
def test_reasoning_efforts_are_trimmed_and_case_folded(effort: str) -> None:
    ExecutionOptions(reasoning_effort=effort).validate()


def test_boundary_values_are_valid() -> None:
    ExecutionOptions(
        provider="anthropic",
        max_tokens=1,
        weak_model_max_tokens=1,
        max_turns=0,
        thinking_budget_tokens=0,
        allowed_tools=[],
        allowed_commands=[],
    ).validate()


def test_tools_disabled() -> None:
    assert ExecutionOptions(no_tools=True).tools_disabled()
    assert ExecutionOptions(allowed_tools=[]).tools_disabled()
    assert not ExecutionOptions(no_tools=False).tools_disabled()
    assert not ExecutionOptions(allowed_tools=["read"]).tools_disabled()


def test_tool_allowed() -> None:
    assert not ExecutionOptions(no_tools=True).tool_allowed("read")
    assert not ExecutionOptions(allowed_tools=[]).tool_allowed("read")
    listed = ExecutionOptions(allowed_tools=["read", "bash", "skill", "grep_tool"])
    assert listed.tool_allowed("read")
    assert not listed.tool_allowed("write")
    assert not ExecutionOptions(allowed_commands=[]).tool_allowed("bash")
    assert ExecutionOptions(allowed_commands=["ls"]).tool_allowed("bash")
    assert not ExecutionOptions(no_skills=True).tool_allowed("skill")
    assert ExecutionOptions(no_skills=False).tool_allowed("skill")
    assert not ExecutionOptions(enable_fs_search_tools=False).tool_allowed("grep_tool")
    assert not ExecutionOptions(enable_fs_search_tools=False).tool_allowed("glob_tool")
    assert ExecutionOptions(enable_fs_search_tools=False).tool_allowed("read")


def test_restrictions_drop_model_choices() -> None:
    full = ExecutionOptions(
        provider="openai",
        model="m",
        weak_model="w",
        max_tokens=5,
        weak_model_max_tokens=5,
        thinking_budget_tokens=5,
        reasoning_effort="low",
        max_turns=5,
        use_weak_model=True,
        no_tools=False,
        no_extensions=True,
        no_skills=True,
        allowed_tools=[],
        allowed_commands=["ls"],
        enable_fs_search_tools=False,
    )
    kept = full.restrictions()
    assert kept == ExecutionOptions(
        no_tools=False,
        no_extensions=True,
        no_skills=True,
        allowed_tools=[],
        allowed_commands=["ls"],
        enable_fs_search_tools=False,
    )
    assert full.model == "m", "restrictions() returns a copy"


PARENT = ExecutionOptions(
    no_tools=True,
    no_skills=True,
    no_extensions=True,
    allowed_tools=["read", "grep"],
    allowed_commands=["ls"],
    enable_fs_search_tools=False,
    max_tokens=1000,
    weak_model_max_tokens=500,
    thinking_budget_tokens=200,
    max_turns=10,
)


@pytest.mark.parametrize(
    "child",
    [
        ExecutionOptions(),
        ExecutionOptions(no_tools=True, no_skills=True, no_extensions=True),
        ExecutionOptions(allowed_tools=["read"], allowed_commands=[]),
        ExecutionOptions(allowed_tools=[]),
        ExecutionOptions(enable_fs_search_tools=False),
        ExecutionOptions(max_tokens=1000, weak_model_max_tokens=1, thinking_budget_tokens=0),
        ExecutionOptions(max_turns=1),
        ExecutionOptions(max_turns=10),
        ExecutionOptions(model="other", provider="anthropic"),
    ],
)
def test_narrowing_is_accepted(child: ExecutionOptions) -> None:
    child.narrowed_by(PARENT)


@pytest.mark.parametrize(
    ("child", "error", "message"),
    [
        (
            ExecutionOptions(no_tools=False),
            errors.NoToolsRelaxed,
            "child execution options cannot relax the parent's noTools",
        ),
        (
            ExecutionOptions(no_skills=False),
            errors.NoSkillsRelaxed,
            "child execution options cannot relax the parent's noSkills",
        ),
        (
            ExecutionOptions(no_extensions=False),
            errors.NoExtensionsRelaxed,
            "child execution options cannot relax the parent's noExtensions",
        ),
        (
            ExecutionOptions(allowed_tools=["read", "write"]),
            errors.ToolsWidened,
            "child allowedTools must stay within the parent's allowedTools: write not allowed",
        ),
        (
            ExecutionOptions(allowed_commands=["rm"]),
            errors.CommandsWidened,
            "child allowedCommands must stay within the parent's allowedCommands: rm not allowed",
        ),
        (
            ExecutionOptions(enable_fs_search_tools=True),
            errors.FsSearchEnabled,
            "child execution options cannot enable filesystem search the parent disabled",
        ),
        (
            ExecutionOptions(max_tokens=1001),
            errors.TokenLimitRaised,
            "child maxTokens exceeds the parent's maxTokens",
        ),
        (
            ExecutionOptions(weak_model_max_tokens=501),
            errors.TokenLimitRaised,
            "child weakModelMaxTokens exceeds the parent's weakModelMaxTokens",
        ),
        (
            ExecutionOptions(thinking_budget_tokens=201),
            errors.TokenLimitRaised,
            "child thinkingBudgetTokens exceeds the parent's thinkingBudgetTokens",
        ),
        (
            ExecutionOptions(max_turns=11),
            errors.TurnLimitWidened,
            "child maxTurns must be between 1 and the parent's maxTurns",
        ),
        (
            ExecutionOptions(max_turns=0),
            errors.TurnLimitWidened,
            "child maxTurns must be between 1 and the parent's maxTurns",
        ),
    ],
)
def test_each_widening_is_a_distinct_error(
    child: ExecutionOptions, error: type[errors.OptionsWidened], message: str
) -> None:
    with pytest.raises(error) as info:
        child.narrowed_by(PARENT)
    assert str(info.value) == message
    assert isinstance(info.value, errors.OptionsWidened)


def test_widening_reasons_are_distinct() -> None:
    reasons = {cls.reason for cls in errors.OptionsWidened.__subclasses__()}
    assert len(reasons) == len(errors.OptionsWidened.__subclasses__()) == 9


def test_a_parent_without_policy_allows_anything() -> None:
    child = ExecutionOptions(no_tools=False, allowed_tools=["x"], max_turns=0, max_tokens=10**9)
    for parent in (None, UNSET, ExecutionOptions()):
        child.narrowed_by(parent)


def test_parent_deny_all_lists_refuse_any_entry() -> None:
    parent = ExecutionOptions(allowed_tools=[], allowed_commands=[])
    ExecutionOptions(allowed_tools=[], allowed_commands=[]).narrowed_by(parent)
    with pytest.raises(errors.ToolsWidened):
        ExecutionOptions(allowed_tools=["read"]).narrowed_by(parent)
    with pytest.raises(errors.CommandsWidened):
        ExecutionOptions(allowed_commands=["ls"]).narrowed_by(parent)


def test_unlimited_parent_turns_allow_any_child_turns() -> None:
    ExecutionOptions(max_turns=0).narrowed_by(ExecutionOptions(max_turns=0))
    ExecutionOptions(max_turns=99).narrowed_by(ExecutionOptions(max_turns=0))
