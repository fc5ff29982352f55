"""A command profile's own options (issue 29): ``timeout_s`` (a child running longer is
cancelled with "cancelled: child deadline exceeded") and ``close_stdin`` (a command that reads its
stdin to the end finishes), with real commands through a real Engine."""

from __future__ import annotations

import asyncio
import logging
import sys
import textwrap
import time
from pathlib import Path

import pytest

from delegation import AdmissionFailed, Engine, EngineConfig
from delegation.runners.command import CommandConfigError, CommandRunner
from tests.harness.support import PRESET, Harness, ScriptRunner, open_harness
from tests.harness.trees import alive, child_tree

DEADLINE = "cancelled: child deadline exceeded"


async def texts(h: Harness, conversation_id: str) -> list[str]:
    return [e.text for e in await h.engine.events(conversation_id, limit=1000)]


async def until_text(h: Harness, conversation_id: str, text: str) -> None:
    deadline = time.monotonic() + 60
    while text not in await texts(h, conversation_id):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in {await texts(h, conversation_id)}")
        await asyncio.sleep(0.01)


async def run_one(
    db_url: str,
    workspace: Path,
    profile: object,
    config: EngineConfig | None = None,
    message: str = "hello",
) -> tuple[str, str, list[str]]:
    """Start one child of ``profile`` and wait for its end: its state, error and texts."""
    runner = CommandRunner(profiles={PRESET.name: profile})  # type: ignore[dict-item]
    async with Engine(db_url, runner=runner, config=config or EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start(message=message)
        record = await h.wait_done(started.conversation_id)
        return record.state, record.error, await texts(h, started.conversation_id)


# --- timeout_s --------------------------------------------------------------------


async def test_a_profiles_timeout_s_ends_a_real_command_with_child_deadline_exceeded(
    db_url: str, workspace: Path
) -> None:
    runner = CommandRunner(profiles={PRESET.name: {"argv": ["sleep", "1000"], "timeout_s": 0.5}})
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        waited = time.monotonic() + 60
        while not (tree := child_tree()) and time.monotonic() < waited:
            await asyncio.sleep(0.01)
        record = await h.wait_done(started.conversation_id)
        assert (record.state, record.error) == ("cancelled", DEADLINE)
        assert tree and not any(alive(pid) for pid in tree), "sleep 1000 was stopped"


@pytest.mark.parametrize(("timeout_s", "max_run_s"), [(0.5, 3600.0), (3600.0, 0.5)])
async def test_the_smaller_of_timeout_s_and_max_run_s_applies(
    db_url: str, workspace: Path, timeout_s: float, max_run_s: float
) -> None:
    profile = {"argv": ["sleep", "1000"], "timeout_s": timeout_s}
    config = EngineConfig(max_run_s=max_run_s)
    state, error, _ = await run_one(db_url, workspace, profile, config)
    assert (state, error) == ("cancelled", DEADLINE)


async def test_a_command_reading_stdin_to_its_end_is_still_bounded_by_timeout_s(
    db_url: str, workspace: Path
) -> None:
    """Without close_stdin, stdin stays open for steers: `cat` never sees its end, and
    only the profile's timeout_s ends it."""
    state, error, said = await run_one(db_url, workspace, {"argv": ["cat"], "timeout_s": 1})
    assert (state, error) == ("cancelled", DEADLINE)
    assert said == ["hello"], "it echoed the message, then waited for more"


async def test_a_runs_max_run_s_that_is_not_seconds_fails_the_run_clearly(
    db_url: str, workspace: Path
) -> None:
    """Another runner's Run may carry max_run_s too; a bad one is the run's error."""

    class Limited(ScriptRunner):
        async def prepare(self, *args: object) -> object:  # type: ignore[override]
            run = await super().prepare(*args)  # type: ignore[arg-type]
            run.max_run_s = "soon"  # type: ignore[attr-defined]
            return run

    runner = Limited()
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        with pytest.raises(AdmissionFailed, match="max_run_s must be a positive number of seconds"):
            await h.start()


# --- close_stdin ------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "said"), [(["cat"], "hello"), (["wc", "-c"], "6")])
async def test_close_stdin_lets_a_command_that_reads_stdin_to_its_end_finish(
    db_url: str, workspace: Path, argv: list[str], said: str
) -> None:
    state, error, texts_said = await run_one(db_url, workspace, {"argv": argv, "close_stdin": True})
    assert (state, error) == ("done", "")
    assert [text.strip() for text in texts_said] == [said]


# Reads stdin to its end, says so, then waits for the test's file "go".
READS_THEN_WAITS = (
    textwrap.dedent(
        """
    import os, sys, time
    print("read " + sys.stdin.read().strip(), flush=True)
    while not os.path.exists("go"):
        time.sleep(0.01)
    """
    )
    .replace("{", "{{")
    .replace("}", "}}")
)


async def test_a_steer_to_a_command_with_close_stdin_stays_queued_and_is_logged(
    db_url: str, workspace: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="delegation.runners.command")
    argv = [sys.executable, "-c", READS_THEN_WAITS]
    runner = CommandRunner(profiles={PRESET.name: {"argv": argv, "close_stdin": True}})
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        child = started.conversation_id
        await until_text(h, child, "read do the task")
        for request_id in ("s1", "s2"):
            steer = h.params(child_id=child, request_id=request_id, message="go left")
            assert (await engine.call(h.conn, "child.steer", steer)).outcome == "injected"
        (workspace / "go").touch()
        record = await h.wait_done(child)
        assert (record.state, record.error) == ("done", "")
        assert await texts(h, child) == ["read do the task"]
    logged = [r for r in caplog.records if getattr(r, "action", "") == "steers_not_delivered"]
    assert len(logged) == 1, "once per child"
    assert "closes the command's stdin" in logged[0].getMessage()


# --- configuration ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ("timeout_s = 0", "timeout_s must be a finite number of seconds > 0"),
        ("timeout_s = -5", "timeout_s must be a finite number of seconds > 0"),
        ("timeout_s = nan", "not nan"),
        ("timeout_s = inf", "not inf"),
        ("timeout_s = 1e300", "at most 1000000000"),
        ("timeout_s = '30'", "not '30'"),
        ("timeout_s = true", "not True"),
        ("close_stdin = 'yes'", "close_stdin must be true or false, not 'yes'"),
        ("close_stdin = 1", "close_stdin must be true or false"),
        ("timeout = 30", "may set only argv, close_stdin, timeout_s (not timeout)"),
    ],
)
def test_a_bad_profile_option_is_one_line_at_load(tmp_path: Path, table: str, says: str) -> None:
    path = tmp_path / "runner.toml"
    path.write_text(f"[command.profiles.worker]\nargv = ['cat']\n{table}\n")
    with pytest.raises(CommandConfigError) as refused:
        CommandRunner.from_file(path)
    message = str(refused.value)
    assert says in message and "\n" not in message, message
    assert message.startswith(f"{path}: ")


def test_a_profile_table_without_argv_is_refused() -> None:
    with pytest.raises(CommandConfigError, match=r"\[command.profiles.w\] must set argv"):
        CommandRunner(profiles={"w": {"timeout_s": 5}})


def test_the_options_are_read_from_the_toml(tmp_path: Path) -> None:
    path = tmp_path / "runner.toml"
    path.write_text(
        "[command.profiles.reader]\nargv = ['wc', '-c']\ntimeout_s = 30\nclose_stdin = true\n"
        "[command.profiles.plain]\nargv = ['cat']\n"
    )
    runner = CommandRunner.from_file(path)
    assert runner.profiles == {"reader": ("wc", "-c"), "plain": ("cat",)}
    reader, plain = runner.options["reader"], runner.options["plain"]
    assert (reader.timeout_s, reader.close_stdin) == (30.0, True)
    assert (plain.timeout_s, plain.close_stdin) == (None, False)
