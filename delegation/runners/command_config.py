"""The command runner's settings, checked once, when the runner is made.

A profile is an argv template, or a table (in TOML, ``[command.profiles.NAME]``) of
``argv`` and the options below. Everything that can be wrong with a setting is refused
here with :class:`CommandConfigError`, in one line naming the setting: never at run time.

* ``timeout_s``: a child of the profile running longer is cancelled by the engine with
  "cancelled: child deadline exceeded", as with ``EngineConfig.max_run_s``; the smaller applies.
* ``close_stdin``: the command's stdin ends after the message, for a command that reads
  it to its end (``cat``, ``wc``, many CLIs); steers cannot reach such a command.

Beside the profiles, ``version`` names the code the profiles run (design §34: never a
hash of the source; 1 to 128 printable bytes) and ``resumes`` the older versions it can
continue: the engine records the version of every child the runner runs.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from delegation.config import check_version

PLACEHOLDERS = frozenset({"message", "profile", "conversation_id", "run_id", "cwd"})
# Where the host's database URL or its password may be: never a child's (design §17).
DATABASE_CREDENTIALS = frozenset(
    {
        "DELEGATION_DB",
        "PGPASSWORD",
        "PGPASSFILE",
        "PGSERVICEFILE",
        "PGSERVICE",
        "PGSYSCONFDIR",
        "PGSSLKEY",
        "PGSSLCERT",
        "PGSSLROOTCERT",
        "PGSSLCRL",
        "PGSSLCRLDIR",
    }
)
# What a number of seconds may be at most (EngineConfig.max_run_s's bound too).
MAX_SECONDS = 10**9
_SETTINGS = frozenset(
    {
        "profiles",
        "env_allow",
        "grace_s",
        "read_only",
        "read_write",
        "net_connect",
        "listen",
        "max_processes",
        "max_memory",
        "child_uid",
        "child_gid",
        "version",
        "resumes",
    }
)
_PROFILE_KEYS = frozenset({"argv", "timeout_s", "close_stdin"})


class CommandConfigError(ValueError):
    """The command runner's configuration is invalid (raised at construction)."""


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """What a profile sets beside its argv (see the module docstring)."""

    timeout_s: float | None = None
    close_stdin: bool = False


def check_profile(name: object, value: object) -> tuple[tuple[str, ...], ProfileOptions]:
    """A profile's argv template and options, from an argv list or a table of them."""
    if not isinstance(value, Mapping):
        return check_template(name, value), ProfileOptions()
    if "argv" not in value or (unknown := sorted(set(value) - _PROFILE_KEYS)):
        known = ", ".join(sorted(_PROFILE_KEYS))
        raise CommandConfigError(
            f"[command.profiles.{name}] must set argv, and may set only {known}"
            + (f" (not {', '.join(unknown)})" if "argv" in value else "")
        )
    timeout_s = value.get("timeout_s")
    if timeout_s is not None:
        timeout_s = _check_seconds(f"profile {name!r}: timeout_s", timeout_s, above=0)
    close_stdin = value.get("close_stdin", False)
    if not isinstance(close_stdin, bool):
        raise CommandConfigError(
            f"profile {name!r}: close_stdin must be true or false, not {close_stdin!r}"
        )
    return check_template(name, value["argv"]), ProfileOptions(timeout_s, close_stdin)


def check_template(profile: object, argv: object) -> tuple[str, ...]:
    if not isinstance(profile, str) or not profile.strip():
        raise CommandConfigError(f"a profile name must be a nonempty string, not {profile!r}")
    if isinstance(argv, str | bytes) or not isinstance(argv, Sequence) or not argv:
        raise CommandConfigError(f"profile {profile!r}: argv must be a nonempty list of strings")
    for item in argv:
        if not isinstance(item, str) or "\0" in item:
            raise CommandConfigError(f"profile {profile!r}: argv item {item!r} is not a string")
        _check_placeholders(profile, item)
    if not argv[0].strip():
        raise CommandConfigError(f"profile {profile!r}: argv[0] must name a program")
    return tuple(argv)


def _check_placeholders(profile: str, item: str) -> None:
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(item)]
    except ValueError as exc:
        raise CommandConfigError(f"profile {profile!r}: bad template {item!r}: {exc}") from exc
    known = ", ".join(f"{{{name}}}" for name in sorted(PLACEHOLDERS))
    for name, spec, conversion in fields:
        if name is not None and (name not in PLACEHOLDERS or spec or conversion):
            raise CommandConfigError(
                f"profile {profile!r}: unknown placeholder {{{name}}} in {item!r}"
                f" (known: {known}; use {{{{ and }}}} for literal braces)"
            )


def check_env_names(names: Iterable[str]) -> list[str]:
    checked = list(names)
    for name in checked:
        if isinstance(names, str) or not isinstance(name, str) or not name.isidentifier():
            raise CommandConfigError(f"env_allow must list variable names, not {names!r}")
        if name in DATABASE_CREDENTIALS:
            raise CommandConfigError(
                f"env_allow may not name {name}: it gives the host's database to a child"
            )
    return checked


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise CommandConfigError(f"{name} must be true or false, not {value!r}")
    return value


def check_id(name: str, value: object) -> int:
    """A user or group id for a root host's children (0 keeps them root)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32 - 1:
        raise CommandConfigError(
            f"{name} must be a user or group id (0 to 4294967294), not {value!r}"
        )
    return value


def check_runner_version(version: object) -> str | None:
    """The runner's ``version`` (None: unversioned), refused in one line naming it."""
    if version is None:
        return None
    try:
        return check_version(version)
    except ValueError as exc:
        raise CommandConfigError(f"version: {exc}") from None


def check_resumes(resumes: object) -> tuple[str, ...]:
    """The older versions the runner can continue: a list of versions."""
    if isinstance(resumes, str | bytes) or not isinstance(resumes, Iterable):
        raise CommandConfigError(f"resumes must be a list of runner versions, not {resumes!r}")
    try:
        return tuple(dict.fromkeys(check_version(version) for version in resumes))
    except ValueError as exc:
        raise CommandConfigError(f"resumes: {exc}") from None


def check_grace(grace_s: object) -> float:
    return _check_seconds("grace_s", grace_s, above=None)


def _check_seconds(what: str, value: object, *, above: float | None) -> float:
    """``value`` as seconds: a finite number, at most :data:`MAX_SECONDS`, and above
    ``above`` (else at least 0)."""
    bound = "> 0" if above is not None else ">= 0"
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (above is not None and value <= above)
        or value > MAX_SECONDS
    ):
        raise CommandConfigError(
            f"{what} must be a finite number of seconds {bound} (at most {MAX_SECONDS}),"
            f" not {value!r}"
        )
    return float(value)


def settings(document: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor's arguments from a parsed TOML document; unknown keys refused."""
    section = document.get("command")
    if not isinstance(section, dict) or not isinstance(section.get("profiles"), dict):
        raise CommandConfigError("a [command] table with [command.profiles.NAME] is required")
    if unknown := sorted(set(section) - _SETTINGS):
        raise CommandConfigError(f"unknown [command] settings: {', '.join(unknown)}")
    for name, table in section["profiles"].items():
        if not isinstance(table, dict):
            raise CommandConfigError(f"[command.profiles.{name}] must be a table setting argv")
    return dict(section)
