"""Shell completion (design §13): ``delegation completion SHELL`` prints a script written
from the parser itself; sourced in a real bash, it completes commands, options, choices
and paths."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from delegation.cli.commands import build_parser
from delegation.cli.completion import SHELLS

ROOT = Path(__file__).resolve().parents[2]
# Completes one command line as bash does on TAB: the function `complete -p` names is
# called with COMP_WORDS and COMP_CWORD set; prints what it offers, one a line.
COMPLETE = r"""
source <("$PYTHON" -m delegation.cli completion bash)
spec=$(complete -p delegation) || exit 3
fn=$(sed -n 's/.*-F \([^ ]*\) .*/\1/p' <<<"$spec")
COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 ))
COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}
"$fn" delegation "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}"
"""


def commands() -> list[str]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def complete(*words: str, cwd: Path = ROOT) -> list[str]:
    """What bash offers for ``words`` (the last one being completed)."""
    done = subprocess.run(
        ["bash", "-c", COMPLETE, "complete", "delegation", *words],
        capture_output=True, text=True, timeout=60, cwd=cwd, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return sorted(line for line in done.stdout.splitlines() if line)


@pytest.mark.parametrize("shell", SHELLS)
def test_a_script_for_each_shell_names_every_command(shell: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "completion", shell],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    assert len(done.stdout.splitlines()) > 10
    for word in [*commands(), "wide", "json", "runner-config"]:
        assert word in done.stdout, word


def test_bash_completes_commands_options_choices_and_paths(tmp_path: Path) -> None:
    assert complete("") == sorted(commands())
    assert complete("ch") == ["children"]
    assert complete("db", "") == ["current", "upgrade"]
    assert complete("children", "--w") == ["--wide"]
    assert {"--db", "--json", "--lease", "--limit", "--parent", "--state"} <= set(
        complete("children", "--")
    )
    assert complete("children", "--state", "") == sorted(
        ["prepared", "queued", "admitted", "running", "waiting", "done", "cancelled"]
    )
    assert complete("serve", "--log-level", "w") == ["warning"]
    assert complete("completion", "") == sorted(SHELLS)
    (tmp_path / "mine.db").touch()
    (tmp_path / "other.txt").touch()
    assert complete("--db", "mi", cwd=tmp_path) == ["mine.db"]
    assert complete("leases", "--db", "mi", cwd=tmp_path) == ["mine.db"]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_other_shells_read_their_script(shell: str, tmp_path: Path) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell} on this machine")
    script = tmp_path / f"delegation.{shell}"
    done = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "completion", shell],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=True,
    )  # fmt: skip
    script.write_text(done.stdout)
    checked = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    if shell == "fish":  # fish completes a command line itself: complete -C
        line = f'source {script}; complete -C "delegation db "; complete -C "delegation ch"'
        offered = subprocess.run(["fish", "-c", line], capture_output=True, text=True)
        words = [row.split("\t")[0] for row in offered.stdout.splitlines()]
        assert words == ["current", "upgrade", "children"], offered.stderr
