"""ExecutionOptions: the credential-free execution policy a child may carry.

Every field may be omitted, and omission means "inherit". An explicit ``false``,
``0`` or ``[]`` is a value of its own: ``allowedTools: []`` denies every tool and
survives a round trip. ``null`` is never accepted (omit the field to inherit).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec
from msgspec import UNSET, UnsetType

from delegation import errors
from delegation._struct import Int64, WireStruct, blank, has_nul

PROVIDERS: tuple[str, ...] = ("openai", "anthropic")
REASONING_EFFORTS: frozenset[str] = frozenset(
    {"none", "minimal", "low", "medium", "high", "xhigh", "max"}
)
# Tools whose availability follows a dedicated option, not only allowedTools.
BASH_TOOL = "bash"
SKILL_TOOL = "skill"
FS_SEARCH_TOOLS = frozenset({"glob_tool", "grep_tool"})

_TEXT_FIELDS = ("provider", "model", "weak_model", "reasoning_effort")
_POSITIVE_FIELDS = ("max_tokens", "weak_model_max_tokens")
_NON_NEGATIVE_FIELDS = ("max_turns", "thinking_budget_tokens")
_LIST_FIELDS = ("allowed_tools", "allowed_commands")
_TOKEN_LIMITS = ("max_tokens", "weak_model_max_tokens", "thinking_budget_tokens")
# Model and turn choices: central decisions, not environment restrictions.
_MODEL_CHOICES = (
    "provider",
    "model",
    "weak_model",
    "reasoning_effort",
    "max_tokens",
    "weak_model_max_tokens",
    "thinking_budget_tokens",
    "max_turns",
    "use_weak_model",
)


def wire_name(name: str) -> str:
    """The wire (camelCase) name of a snake_case attribute: ``tool_call_id`` -> ``toolCallId``."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


class ExecutionOptions(WireStruct, frozen=True):
    """Narrowing execution policy; omitted fields are ``UNSET`` (inherit)."""

    provider: str | UnsetType = UNSET
    model: str | UnsetType = UNSET
    weak_model: str | UnsetType = UNSET
    max_tokens: Int64 | UnsetType = UNSET
    weak_model_max_tokens: Int64 | UnsetType = UNSET
    thinking_budget_tokens: Int64 | UnsetType = UNSET
    reasoning_effort: str | UnsetType = UNSET
    max_turns: Int64 | UnsetType = UNSET
    use_weak_model: bool | UnsetType = UNSET
    no_tools: bool | UnsetType = UNSET
    no_extensions: bool | UnsetType = UNSET
    no_skills: bool | UnsetType = UNSET
    allowed_tools: list[str] | UnsetType = UNSET
    allowed_commands: list[str] | UnsetType = UNSET
    enable_fs_search_tools: bool | UnsetType = msgspec.field(
        default=UNSET, name="enableFSSearchTools"
    )
    # Seconds the child may take from its first admission (design §22): never reset by
    # a restart, a wait or a takeover; a child of a child gets at most what is left of
    # its parent's.
    deadline_seconds: float | UnsetType = UNSET

    def validate(self, providers: Iterable[str] = PROVIDERS) -> None:
        """Check every present value; raise :class:`errors.InvalidOptions` on the first bad one."""
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if value is not UNSET and (blank(value) or has_nul(value)):
                raise errors.InvalidOptions(
                    f"execution option {wire_name(name)} must be nonempty and contain no NUL"
                )
        if self.provider is not UNSET and self.provider not in tuple(providers):
            raise errors.InvalidOptions(f"unsupported execution provider {self.provider!r}")
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if value is not UNSET and value <= 0:
                raise errors.InvalidOptions(f"execution option {wire_name(name)} must be positive")
        for name in _NON_NEGATIVE_FIELDS:
            value = getattr(self, name)
            if value is not UNSET and value < 0:
                raise errors.InvalidOptions(
                    f"execution option {wire_name(name)} must not be negative"
                )
        deadline = self.deadline_seconds
        if deadline is not UNSET and not (
            not isinstance(deadline, bool) and 0 < deadline < 10**9 and deadline == deadline
        ):
            raise errors.InvalidOptions("execution option deadlineSeconds must be positive seconds")
        effort = self.reasoning_effort
        if effort is not UNSET and effort.strip().lower() not in REASONING_EFFORTS:
            raise errors.InvalidOptions(f"unsupported reasoning effort {effort!r}")
        for name in _LIST_FIELDS:
            entries = getattr(self, name)
            if entries is not UNSET and any(blank(e) or has_nul(e) for e in entries):
                raise errors.InvalidOptions(
                    f"execution option {wire_name(name)} contains an empty or invalid entry"
                )

    def tools_disabled(self) -> bool:
        """True for ``noTools: true`` and for the deny-all ``allowedTools: []``."""
        return self.no_tools is True or self.allowed_tools == []

    def tool_allowed(self, name: str) -> bool:
        """Whether the tool ``name`` may be offered to a run under these options.

        An empty ``allowedCommands`` also disables bash; ``noSkills`` disables the
        skill tool; ``enableFSSearchTools: false`` disables the filesystem search tools.
        """
        if self.tools_disabled():
            return False
        if name == BASH_TOOL and self.allowed_commands == []:
            return False
        if name == SKILL_TOOL and self.no_skills is True:
            return False
        if name in FS_SEARCH_TOOLS and self.enable_fs_search_tools is False:
            return False
        return self.allowed_tools is UNSET or name in self.allowed_tools

    def restrictions(self) -> ExecutionOptions:
        """A copy with only the environment restrictions: model and turn choices dropped."""
        return msgspec.structs.replace(self, **dict.fromkeys(_MODEL_CHOICES, UNSET))

    def narrowed_by(self, parent: ExecutionOptions | UnsetType | None) -> None:
        """Check that these (child) options only narrow ``parent``'s policy.

        Omitted child fields inherit and never widen. Raises a distinct
        :class:`errors.OptionsWidened` subclass for each kind of widening.
        """
        if parent is None or parent is UNSET:
            return
        relaxed = (
            ("no_tools", errors.NoToolsRelaxed),
            ("no_skills", errors.NoSkillsRelaxed),
            ("no_extensions", errors.NoExtensionsRelaxed),
        )
        for name, error in relaxed:
            if getattr(parent, name) is True and getattr(self, name) is False:
                raise error()
        _check_subset(self.allowed_tools, parent.allowed_tools, errors.ToolsWidened)
        _check_subset(self.allowed_commands, parent.allowed_commands, errors.CommandsWidened)
        if parent.enable_fs_search_tools is False and self.enable_fs_search_tools is True:
            raise errors.FsSearchEnabled()
        for name in _TOKEN_LIMITS:
            mine, theirs = getattr(self, name), getattr(parent, name)
            if mine is not UNSET and theirs is not UNSET and mine > theirs:
                raise errors.TokenLimitRaised(
                    f"child {wire_name(name)} exceeds the parent's {wire_name(name)}"
                )
        mine_s, theirs_s = self.deadline_seconds, parent.deadline_seconds
        if theirs_s is not UNSET and mine_s is not UNSET and mine_s > theirs_s:
            raise errors.DeadlineWidened()
        limit = parent.max_turns
        turns = self.max_turns
        # maxTurns 0 means "no limit": a child of a limited parent must keep one.
        if limit is not UNSET and limit > 0 and turns is not UNSET and not 1 <= turns <= limit:
            raise errors.TurnLimitWidened()


def _check_subset(
    child: Sequence[str] | UnsetType,
    parent: Sequence[str] | UnsetType,
    error: type[errors.OptionsWidened],
) -> None:
    if child is UNSET or parent is UNSET:
        return
    extra = sorted(set(child) - set(parent))
    if extra:
        raise error(f"{error.default_message()}: {', '.join(extra)} not allowed")


class _Optioned(Protocol):
    @property
    def options(self) -> ExecutionOptions | UnsetType: ...


def effective_options(
    policy: ExecutionOptions | None, preset: _Optioned, request: _Optioned
) -> ExecutionOptions:
    """The options a child runs with: the parent run's ``policy`` (None: no ceiling),
    narrowed by the preset's options, narrowed by the request's (design §9).

    Each level may only narrow the ones above it; a field a level omits is inherited.

    Raises:
        errors.OptionsWidened: the subclass naming how the preset widens the policy,
            or how the request widens the preset (or the policy through it).
    """
    ceiling = policy if policy is not None else ExecutionOptions()
    if preset.options is not UNSET:
        preset.options.narrowed_by(ceiling)
        ceiling = _overlay(ceiling, preset.options)
    if request.options is not UNSET:
        request.options.narrowed_by(ceiling)
        ceiling = _overlay(ceiling, request.options)
    return ceiling


def _overlay(base: ExecutionOptions, top: ExecutionOptions) -> ExecutionOptions:
    """``base`` with every field ``top`` sets taken from ``top``."""
    changes = {
        name: value for name in top.__struct_fields__ if (value := getattr(top, name)) is not UNSET
    }
    return msgspec.structs.replace(base, **changes) if changes else base
