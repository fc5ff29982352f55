"""``delegation completion bash|zsh|fish|tcsh``: a shell completion script.

Every command, option and choice of the command line completes: ``eval "$(delegation
completion bash)"`` in ``~/.bashrc``, or the script saved where the shell looks
(``delegation completion zsh > "${fpath[1]}/_delegation"``).
"""

from __future__ import annotations

import argparse

from delegation.machine import State

SHELLS = ("bash", "zsh", "fish", "tcsh")
# The options that name a file or a directory: completed as paths.
_PATHS = {"db", "socket", "runner_config"}


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``delegation completion SHELL``."""
    completion = commands.add_parser(
        "completion",
        help='a shell completion script: eval "$(delegation completion bash)"',
        description="Print the completion script of a shell for every command and option.",
    )
    completion.add_argument("shell", choices=SHELLS)


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script of ``shell`` for ``parser``, the command line's (shtab
    writes it from the parser itself, so it never falls behind a new command or
    option): files for paths, the states for ``--state``."""
    import shtab

    states = " ".join(State)
    named = {"bash": "_delegation_states", "zsh": f"({states})"}
    parsers = [parser]
    for each in parsers:  # grows as subcommands are found
        for action in each._actions:
            if action.dest in _PATHS:
                action.complete = shtab.FILE  # type: ignore[attr-defined]
            if action.dest == "state":
                action.complete = named  # type: ignore[attr-defined]
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    preamble = f'_delegation_states() {{ compgen -W "{states}" -- "$1"; }}'
    return shtab.complete(parser, shell=shell, preamble=preamble if shell == "bash" else "")
