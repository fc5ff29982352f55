"""What other tests use of cli/test_postgres_cli.py, kept here so that no test module imports
another: COMMANDS, ROOT, cli, needs_postgres, one_line."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


needs_postgres = pytest.mark.skipif(
    "postgres" not in os.environ.get("DELEGATION_TEST_STORES", "sqlite,postgres").split(","),
    reason="DELEGATION_TEST_STORES leaves PostgreSQL out",
)


def cli(
    *argv: str, cwd: Path = ROOT, timeout: float = 60, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``delegation ARGV`` in a process of its own (stdin empty), in this environment or
    ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "delegation.cli", *argv],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
        stdin=subprocess.DEVNULL,
        env={**(os.environ if env is None else env), "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )  # fmt: skip


def one_line(stderr: str) -> str:
    """The one line a refusal prints on stderr (and asserts there is only that)."""
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert stderr.startswith("delegation: "), stderr
    assert "Traceback" not in stderr
    return stderr.rstrip("\n")


COMMANDS = [
    ("serve", "--stdio"),
    ("demo", "--fast"),
    ("children",),
    ("show", "c-1"),
    ("events", "c-1"),
    ("leases",),
    ("cancel", "c-1"),
    ("steer", "c-1", "go"),
    ("db", "upgrade"),
    ("db", "current"),
]
