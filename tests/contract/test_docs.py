"""Every code block of README.md and of the documentation (docs/*.md) runs, so they stay
true (issue 37: 5 of the README's blocks failed when copied as written).

A block runs by its language, as a reader runs what they paste, each alone: ``python`` is
written to a file and run by a new interpreter, twice, in a new temporary directory (an
example must run again where it ran once), so nothing another block defined, imported or
set is there. Before it runs it is read whole (issue 51): a name it uses that it never
defines or imports fails it, even in a function it never calls (a ``NameError`` waiting
for the reader), and so does a function or class it defines and never uses (a block that
only defines runs nothing, so it proves nothing).
``sh`` and ``bash`` as a bash script there (``set -e``, the checkout's ``.venv/bin`` or this
Python's ``bin`` first on ``PATH``); ``console`` runs each ``$ `` line and checks it ends
well; ``toml`` is read and, when it configures the command runner, made into one.
``text`` (and a block with no language) is output or a picture, not code.

A block may be marked on the line before it, with its reason in words:

* ``<!-- docs-test: skip (REASON) -->``: not run (it installs from the package index, needs
  a server or a key, or runs for minutes);
* ``<!-- docs-test: syntax (REASON) -->``: only its syntax is checked (a script that calls
  a program this machine does not have);
* ``<!-- docs-test: fragment (REASON) -->``: a Python block that defines what something
  else calls (a module a command imports by name); it still runs, and every name it uses
  must still be its own, but what it defines need not be used in it.

A mark without a reason fails, and so does an unknown language. Marks stay rare: a Python
block is never skipped nor only compiled (a fragment still runs), and ``syntax`` is for
shell scripts only.
"""

from __future__ import annotations

import ast
import importlib.util
import json
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

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*$")
_MARK = re.compile(r"<!-- docs-test: (skip|syntax|fragment) \((.+)\) -->")
RUN = {"python", "sh", "bash", "console", "toml"}
NOT_CODE = {"text", ""}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    mark: str  # "", "skip", "syntax" or "fragment"
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
        compile(block.code, block.name, "exec")
        if block.mark == "syntax":
            return
        script = tmp_path.parent / f"{tmp_path.name}.py"  # beside the folder, not in it
        script.write_text(block.code, encoding="utf-8")
        for _ in range(2):  # as a reader runs an example again, in the same folder
            done = subprocess.run(
                [sys.executable, str(script)], cwd=tmp_path, env=_environment(),
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert done.returncode == 0, (block.name, done.stdout[-2000:], done.stderr[-3000:])
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


# What each mark may stand on: a Python example always runs (a fragment too), and only a
# shell script can call a program this machine lacks.
MARKABLE = {"skip": {"sh", "bash", "console"}, "syntax": {"sh", "bash"}, "fragment": {"python"}}


def test_marks_are_rare_and_fit_their_blocks() -> None:
    misplaced = [
        f"{b.name}: {b.mark} on {b.language}"
        for b in BLOCKS
        if b.mark and b.language not in MARKABLE[b.mark]
    ]
    assert misplaced == []


def unfinished(code: str) -> list[str]:
    """What a Python block leaves for its reader to finish: a name it uses and never
    defines or imports (ruff's F821, inside functions too), and a function or class it
    defines at the top and never uses (nor decorates: a decorator registers it)."""
    checked = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F821",
         "--output-format", "json", "--stdin-filename", "block.py", "-"],
        input=code, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    said = [f"line {d['location']['row']}: {d['message']}" for d in json.loads(checked.stdout)]
    tree = ast.parse(code)
    for defined in tree.body:
        if not isinstance(defined, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        others = (node for other in tree.body if other is not defined for node in ast.walk(other))
        used = any(isinstance(n, ast.Name) and n.id == defined.name for n in others)
        if not used and not defined.decorator_list:
            said.append(f"line {defined.lineno}: {defined.name} is defined and never used")
    return said


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.language == "python" and b.mark in ("", "fragment")],
    ids=lambda b: b.name,
)  # fmt: skip
def test_a_python_block_is_whole(block: Block) -> None:
    said = unfinished(block.code)
    if block.mark == "fragment":  # it defines what another program calls
        said = [line for line in said if not line.endswith("is defined and never used")]
    assert said == [], block.name


def test_a_fragment_that_would_fail_when_pasted_is_caught() -> None:
    """The shape issue 51 found: a run function that names what no line imports."""
    fragment = "async def run(ctx):\n    await ctx.step('plan', ask_model)\n"
    assert unfinished(fragment) == [
        "line 2: Undefined name `ask_model`",
        "line 1: run is defined and never used",
    ]
    whole = "def ask_model():\n    return 1\n\n\nprint(ask_model())\n"
    assert unfinished(whole) == []


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
