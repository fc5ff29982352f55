"""Errors of the tree (see :mod:`delegation.errors`): input: decode and validation."""

from __future__ import annotations

from delegation.errors.base import DelegationError


class InputError(DelegationError):
    """invalid child input"""

    reason = "invalid_input"


class MalformedInput(InputError):
    """malformed child input"""

    reason = "malformed_input"


class RequestIncomplete(InputError):
    """child requestId, profile and message are required"""

    reason = "request_incomplete"


class InputTooLarge(InputError):
    """child input exceeds limit"""

    reason = "input_exceeds_limit"


class BadContextMode(InputError):
    """child contextMode must be fresh or fork"""

    reason = "invalid_context_mode"


class BadResume(InputError):
    """child resume requires a valid owned conversation ID and cannot be combined with fork"""

    reason = "invalid_resume"


class BadPresetName(InputError):
    """execution preset requires a simple nonempty name"""

    reason = "invalid_preset_name"


class PresetPromptTooLarge(InputError):
    """execution preset prompt exceeds limit"""

    reason = "preset_prompt_exceeds_limit"


class PresetPromptConflict(InputError):
    """execution preset must use prompt content or a prompt path, not both"""

    reason = "preset_prompt_conflict"


class InvalidOptions(InputError):
    """invalid execution options"""

    reason = "invalid_options"


class OptionsWidened(InputError):
    """child execution options widen the parent's policy"""

    reason = "options_widened"


class NoToolsRelaxed(OptionsWidened):
    """child execution options cannot relax the parent's noTools"""

    reason = "no_tools_relaxed"


class NoSkillsRelaxed(OptionsWidened):
    """child execution options cannot relax the parent's noSkills"""

    reason = "no_skills_relaxed"


class NoExtensionsRelaxed(OptionsWidened):
    """child execution options cannot relax the parent's noExtensions"""

    reason = "no_extensions_relaxed"


class ToolsWidened(OptionsWidened):
    """child allowedTools must stay within the parent's allowedTools"""

    reason = "tools_widened"


class CommandsWidened(OptionsWidened):
    """child allowedCommands must stay within the parent's allowedCommands"""

    reason = "commands_widened"


class FsSearchEnabled(OptionsWidened):
    """child execution options cannot enable filesystem search the parent disabled"""

    reason = "fs_search_enabled"


class TokenLimitRaised(OptionsWidened):
    """child token limit exceeds the parent's"""

    reason = "token_limit_raised"


class DeadlineWidened(OptionsWidened):
    """child deadlineSeconds exceeds the parent's"""

    reason = "deadline_widened"


class BadPriority(InputError):
    """child priority must be a whole number from 0 to 9"""

    reason = "bad_priority"


class PriorityAboveCap(InputError):
    """child priority is above its admission scope's max_priority"""

    reason = "priority_above_cap"


class TurnLimitWidened(OptionsWidened):
    """child maxTurns must be between 1 and the parent's maxTurns"""

    reason = "turn_limit_widened"


class BadSteer(InputError):
    """child steer requires requestId and a nonempty bounded message"""

    reason = "invalid_steer"


class BadLeaseId(InputError):
    """child leaseId must be a valid ID"""

    reason = "invalid_lease_id"


class InvalidId(InputError):
    """child handle must be a valid ID"""

    reason = "invalid_id"


class ChildNotFound(InputError):
    """child not found"""

    reason = "child_not_found"


class ReleaseOwnerRequired(InputError):
    """child lease release requires its exact owner"""

    reason = "release_owner_required"
