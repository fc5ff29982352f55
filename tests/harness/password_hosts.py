"""What other tests use of cli/test_cli_passwords.py, kept here so that no test module imports
another: a_child_on_a_host."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.harness.serving import OWNER, ROOT, Client, start_params


async def a_child_on_a_host(env: dict[str, str], log: Path, workspace: Path, *argv: str) -> str:
    """``delegation serve --stdio ARGV`` in ``env`` runs one child to its end and exits
    0; what it logged on stderr."""
    with log.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "delegation.cli", "serve", "--stdio", *argv,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr,
            cwd=ROOT, env={**env, "DELEGATION_SCRIPTED_DELAY": "0.01"},
        )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    client = Client(proc.stdout, proc.stdin)
    try:
        await client.setup(workspace)
        started = await client.ok("child.start", start_params("q1"))
        result, _ = await client.read_until_done({**OWNER, "childId": started["conversationId"]})
        assert result["output"].startswith("finished 3 steps"), result
    finally:
        proc.stdin.close()
        code = await asyncio.wait_for(proc.wait(), 20)
        await client.close()
    assert code == 0, log.read_text()
    return log.read_text()
