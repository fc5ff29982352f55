"""Every code block of README.md and of the documentation (docs/*.md) runs, so they stay
true (issue 37: 5 of the README's blocks failed when copied as written).

A block runs by its language: ``python`` is executed twice in a new temporary directory
(an example must run again where it ran once);
``sh`` and ``bash`` as a bash script there (``set -e``, the checkout's ``.venv/bin`` or this
Python's ``bin`` first on ``PATH``); ``console`` runs each ``$ `` line and checks it ends
well; ``toml`` is read and, when it configures the command runner, made into one.
``text`` (and a block with no language) is output or a picture, not code.

A block may be marked on the line before it, with its reason in words:

* ``<!-- docs-test: skip (REASON) -->``: not run (it installs from the package index, needs
  a server or a key, or runs for minutes);
* ``<!-- docs-test: syntax (REASON) -->``: only its syntax is checked (a script that calls
  a program this machine does not have).

A mark without a reason fails, and so does an unknown language.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from delegation.runners.command import CommandRunner
from delegation.runners.command_config import settings

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*$")
_MARK = re.compile(r"<!-- docs-test: (skip|syntax) \((.+)\) -->")
RUN = {"python", "sh", "bash", "console", "toml"}
NOT_CODE = {"text", ""}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    mark: str  # "", "skip" or "syntax"
    reason: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in FILES:
        lines = path.read_text(encoding="utf-8").split("\n")
        i = 0
        while i < len(lines):
            fence = _FENCE.match(lines[i])
            if fence is None:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = lines[i - 1] if i else ""
            mark = _MARK.search(before)
            if "docs-test" in before and mark is None:
                raise AssertionError(f"{path}:{i}: a docs-test mark needs its reason: {before}")
            found.append(
                Block(
                    path,
                    i + 1,
                    fence[1],
                    "\n".join(lines[i + 1 : end]) + "\n",
                    mark[1] if mark else "",
                    mark[2] if mark else "",
                )
            )
            i = end + 1
    return found


BLOCKS = blocks()


def test_every_block_has_a_known_language() -> None:
    unknown = [b.name for b in BLOCKS if b.language not in RUN | NOT_CODE]
    assert unknown == []
    assert [b for b in BLOCKS if b.language == "python"], "the docs show the API in Python"


def _environment() -> dict[str, str]:
    venv = ROOT / ".venv" / "bin"
    first = str(venv) if venv.is_dir() else str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{first}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language in RUN], ids=lambda b: b.name)
def test_the_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.mark == "skip":
        pytest.skip(block.reason)
    monkeypatch.chdir(tmp_path)  # examples may create ./delegation.db, ./workspace
    if block.language == "python":
        code = compile(block.code, block.name, "exec")
        if block.mark != "syntax":
            for _ in range(2):  # as a reader runs an example again, in the same folder
                exec(code, {"__name__": "__main__"})
        return
    if block.language == "toml":
        document = tomllib.loads(block.code)
        if "command" in document:
            CommandRunner(**settings(document))
        return
    script = block.code
    if block.language == "console":
        script = "\n".join(line[2:] for line in block.code.splitlines() if line.startswith("$ "))
    check = ["bash", "-n"] if block.mark == "syntax" else ["bash", "-e"]
    done = subprocess.run(
        [*check, "-c", script], cwd=tmp_path, env=_environment(), capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (block.name, done.stdout[-2000:], done.stderr[-2000:])


_PATH = re.compile(r"(?<![\w./-])((?:delegation|tests|tools|migrations|docs)/[\w./-]*\w)")
_MODULE = re.compile(r"python3? -m ((?:delegation|tools)(?:\.\w+)*)")


def test_every_file_and_module_the_docs_name_exists() -> None:
    """A page that names `delegation/follow.py` after it moved sends its reader nowhere."""
    missing = []
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        missing += [f"{path.name}: {p}" for p in _PATH.findall(text) if not (ROOT / p).exists()]
        for name in _MODULE.findall(text):
            if importlib.util.find_spec(name) is None:
                missing.append(f"{path.name}: python -m {name}")
    assert missing == []
