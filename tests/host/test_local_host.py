"""``LocalHost`` (design §30): a first child with nothing to invent but a name.

It writes exactly the rows a host writing the embedding guide's calls by hand writes
(runner, connection, tool grant, lease, child), on SQLite and PostgreSQL; the same name
is the same child; and the script of docs/first-host.md, killed with SIGKILL half-way
and run again on the same database, resumes its child without recording a step twice.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from delegation import (
    ChildContext,
    Engine,
    Event,
    LocalHost,
    Params,
    Preset,
    Request,
    RequestIdReused,
    Result,
    Runner,
)
from delegation.run.context import Recovery, Run
from delegation.wire import Identity
from tests.harness import rows

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "first-host.md"


async def echo(ctx: ChildContext) -> None:
    await ctx.admit()
    said = await ctx.step("say", str.upper, ctx.request.message)
    ctx.emit(Event(kind="result", text=said))


class ByHand:
    """The embedding guide's runner: ``prepare`` returns the run."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        return echo


async def _to_the_end(engine: Engine, child: Result) -> None:
    async for _ in engine.follow(child.conversation_id):
        pass


async def by_local_host(url: str, workspace: Path) -> None:
    async with LocalHost(url, echo, workspace=str(workspace)) as host:
        child = await host.start("greeting", "hello")
        await _to_the_end(host.engine, child)


async def by_hand(url: str, workspace: Path) -> None:
    """What a host writes with docs/embedding.md's calls and LocalHost's ids."""
    runner: Runner = ByHand()
    async with Engine(url, runner=runner) as engine:
        conn = await engine.connect(runner_id="local", host_instance_id="local")
        tool = await engine.open_tool(
            conn,
            run_id="local-run",
            conversation_id="local-conversation",
            tool_call_id="local-call",
            extension_id="local",
            presets=[Preset(name="default", extension_id="local", generation=1)],
            workspace=str(workspace),
        )
        request = Request(
            request_id="greeting", profile="default", message="hello", lease_id="lease-greeting"
        )
        owner = {"run_id": "local-run", "tool_call_id": "local-call", "extension_id": "local"}
        params = Params(**owner, generation=1, lease_id="lease-greeting", request=request)
        await _to_the_end(engine, await engine.start(conn, params))
        await engine.close_tool(tool)
        await engine.disconnect(conn)


# What a host decides in each row, without the ids and times the engine makes up.
SHAPE = {
    "runners": "SELECT runner_id, host_instance_id, generation, connection_id IS NULL FROM runners",
    "connections": "SELECT runner_id, generation, host_instance_id, closed_at IS NULL"
    " FROM connections ORDER BY generation",
    "grants": "SELECT kind, runner_id, run_id, conversation_id, tool_call_id, extension_id,"
    " lease_id, workspace, presets, generations, depth, policy, closed_at IS NULL,"
    " revoked_at IS NULL, expires_at IS NULL, activated_at IS NULL,"
    " origin_grant_id IS NULL FROM grants ORDER BY kind",
    "children": "SELECT lease_id, request_id, runner_id, runner_host_instance_id,"
    " parent_conversation_id, parent_run_id, extension_id, profile, generation, request,"
    " preset, cwd, depth, state, error, output, options FROM children",
    "steps": "SELECT name, value FROM steps",
}


def shape(url: str) -> dict[str, list[tuple[Any, ...]]]:
    return {
        table: [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in found]
        for table, sql in SHAPE.items()
        if (found := rows.rows(url, sql))
    }


def test_a_local_host_writes_the_rows_a_host_writes_by_hand(
    db_url: str, tmp_path: Path, template_db: Path
) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    hand = tmp_path / "hand.db"
    hand.write_bytes(template_db.read_bytes())
    asyncio.run(by_local_host(db_url, workspace))
    asyncio.run(by_hand(rows.url_of(hand), workspace))
    local = shape(db_url)
    assert local == shape(rows.url_of(hand))
    # And what those rows are: one runner, its connection closed, the tool call closed,
    # the lease still live (it outlives the tool call), the child done.
    assert local["runners"] == [("local", "local", 1, True)]
    assert local["connections"] == [("local", 1, "local", False)]
    grants = {row[0]: row for row in local["grants"]}
    assert set(grants) == {"lease", "tool"}
    assert grants["tool"][1:8] == (
        "local",
        "local-run",
        "local-conversation",
        "local-call",
        "local",
        None,
        str(workspace),
    )
    assert not grants["tool"][12]  # closed at the end of the `async with`
    assert grants["lease"][6] == "lease-greeting"
    assert grants["lease"][13:15] == (True, False)  # not revoked, expires
    (child,) = local["children"]
    assert child[:3] == ("lease-greeting", "greeting", "local")
    assert child[13:16] == ("done", "", "HELLO")
    assert local["steps"] == [("say", b'"HELLO"')]


def test_the_same_name_is_the_same_child(db_url: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with LocalHost(db_url, echo, workspace=str(tmp_path)) as host:
            first = await host.start("twice", "hi")
            events = [e async for e in host.follow(first)]
            again = await host.start("twice", "hi")
            assert again.conversation_id == first.conversation_id
            assert again.run_id == first.run_id
            assert [e.text for e in events] == ["HI"]
            with pytest.raises(RequestIdReused):
                await host.start("twice", "another message")
            with pytest.raises(ValueError, match="an id"):
                await host.start("two words")
        # Reopened (a new process would be the same): the same child, with its output.
        async with LocalHost(db_url, echo, workspace=str(tmp_path)) as host:
            reopened = await host.start("twice", "hi")
            assert reopened.conversation_id == first.conversation_id
            assert reopened.done and reopened.output == "HI"

    asyncio.run(main())
    assert rows.scalar(db_url, "SELECT count(*) FROM children") == 1


def test_a_closed_local_host_refuses_its_connection() -> None:
    host = LocalHost("unused.db", echo)
    with pytest.raises(RuntimeError, match="not open"):
        _ = host.conn


def page_script() -> str:
    """The script docs/first-host.md saves as first_host.py (its heredoc)."""
    text = PAGE.read_text(encoding="utf-8")
    found = re.search(r"cat > first_host.py <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    assert found is not None
    return found[1]


def test_the_page_s_script_is_short_and_its_block_kills_it() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert "python first_host.py & sleep 2.5; kill -9 $!" in text
    assert 'LocalHost("first.db", work)' in page_script()
    code = [line for line in page_script().splitlines() if line.strip()]
    assert len(code) <= 20


def _wait_for(proc: subprocess.Popen[str], lines: list[str], prefix: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while not any(line.startswith(prefix) for line in lines):
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the host ended before {prefix!r}: {lines}")
        lines.append(line.rstrip("\n"))
        assert time.monotonic() < deadline, f"no {prefix!r} within {timeout} s: {lines}"


@pytest.mark.timeout(180)
def test_the_first_host_page_killed_with_sigkill_resumes_its_child(
    db_url: str, tmp_path: Path
) -> None:
    script = tmp_path / "first_host.py"
    script.write_text(page_script().replace('"first.db"', repr(db_url)))
    run = [sys.executable, str(script)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        run, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    printed: list[str] = []
    try:
        _wait_for(first, printed, "3 text", 60)
    finally:
        first.send_signal(signal.SIGKILL)  # no cleanup, no last write: a crash
        first.wait()
        assert first.stdout is not None
        first.stdout.close()
    assert printed[:3] == [
        "1 text 1 squared is 1",
        "2 text 2 squared is 4",
        "3 text 3 squared is 9",
    ]
    (state,) = rows.rows(db_url, "SELECT state FROM children")
    assert state == ("running",)
    recorded = dict(rows.rows(db_url, "SELECT name, recorded_at FROM steps"))
    assert {"square 1", "square 2", "square 3"} <= set(recorded)
    assert len(recorded) < 8

    second = subprocess.run(
        run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert second.returncode == 0, second.stderr[-2000:]
    lines = second.stdout.splitlines()
    squares = [line for line in lines if " squared is " in line]
    assert [line.split(" text ")[1] for line in squares] == [
        f"{n} squared is {n * n}" for n in range(1, 9)
    ]  # each event once: the emits before the kill were not written again
    assert any(" recovery " in line for line in lines)
    # Done, every step recorded once, those recorded before the kill untouched.
    assert rows.rows(db_url, "SELECT state, error FROM children") == [("done", "")]
    after = dict(rows.rows(db_url, "SELECT name, recorded_at FROM steps"))
    assert sorted(after) == sorted(f"square {n}" for n in range(1, 9))
    assert {name: after[name] for name in recorded} == recorded
    bodies = rows.rows(db_url, "SELECT body FROM events ORDER BY sequence")
    events = [json.loads(bytes(body)) for (body,) in bodies]
    assert [e["sequence"] for e in events] == list(range(1, len(events) + 1))
    assert [e["kind"] for e in events].count("recovery") == 1
