"""The command runner carries a version from its TOML (SPEC §27, issue 48): ``version``
and ``resumes`` in ``[command]`` are checked when the file is read, and the engine records
the version on every child the runner runs, through ``Engine`` and through
``delegation serve --runner command --runner-config``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from delegation import Engine, EngineConfig, Operator
from delegation.cli.commands import main
from delegation.runners import load_runner
from delegation.runners.command import CommandConfigError, CommandRunner
from tests.harness.support import PRESET, open_harness

VERSION = "2026.12.1"


def runner_toml(path: Path, settings: str, profile: str = PRESET.name) -> Path:
    path.write_text(f'[command]\n{settings}\n[command.profiles.{profile}]\nargv = ["true"]\n')
    return path


@pytest.fixture(autouse=True)
def no_version_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELEGATION_RUNNER_VERSION", raising=False)


async def test_a_child_started_through_a_versioned_toml_records_its_version(
    db_url: str, workspace: Path, tmp_path: Path
) -> None:
    toml = runner_toml(tmp_path / "runner.toml", f'version = "{VERSION}"\nresumes = ["2026.11"]')
    runner = CommandRunner.from_file(toml)
    assert (runner.version, runner.resumes) == (VERSION, ("2026.11",))
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        assert (engine.config.runner_version, engine.config.runner_resumes) == (
            VERSION, ("2026.11",),
        )  # fmt: skip
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        record = await h.wait_done(started.conversation_id)
    assert (record.state, record.error) == ("done", "")
    assert (record.version, record.attempt_version) == (VERSION, VERSION)
    assert record.pinned_version is None


def test_without_a_version_the_runner_is_unversioned(tmp_path: Path) -> None:
    runner = CommandRunner.from_file(runner_toml(tmp_path / "runner.toml", ""))
    assert (runner.version, runner.resumes) == (None, ())
    loaded = load_runner("command", runner_toml(tmp_path / "v.toml", 'version = "v1"'))
    assert getattr(loaded, "version", None) == "v1"


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ('version = ""', "version: a runner version must be printable text of 1 to 128 bytes"),
        (f'version = "{"v" * 129}"', "version: a runner version must be printable"),
        ('version = " v1"', "version: a runner version must be printable"),
        ('version = "v\\u0001"', "version: a runner version must be printable"),
        ("version = 3", "version: a runner version must be printable text"),
        ('resumes = "v1"', "resumes must be a list of runner versions, not 'v1'"),
        ('resumes = ["v1", ""]', "resumes: a runner version must be printable"),
        ("resumes = [1]", "resumes: a runner version must be printable"),
    ],
)
def test_a_bad_version_is_refused_when_the_config_is_read(
    tmp_path: Path, settings: str, says: str
) -> None:
    toml = runner_toml(tmp_path / "runner.toml", settings)
    with pytest.raises(CommandConfigError) as refused:
        CommandRunner.from_file(toml)
    assert str(refused.value).startswith(f"{toml}: "), refused.value
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_largest_version_is_taken() -> None:
    most = "v" * 128
    assert CommandRunner({"p": ["true"]}, version=most, resumes=[most]).version == most
    with pytest.raises(CommandConfigError, match=r"^version: "):
        CommandRunner({"p": ["true"]}, version="é" * 65)  # 130 bytes


@pytest.mark.parametrize(("settings"), ['version = ""', 'resumes = ["x" ]\nversion = "  "'])
def test_serve_refuses_a_bad_version_in_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], settings: str
) -> None:
    toml = runner_toml(tmp_path / "runner.toml", settings)
    db = tmp_path / "d.db"
    argv = ["serve", "--stdio", "--runner", "command", "--runner-config", str(toml)]
    assert main([*argv, "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "version: a runner version must be" in err, err
    assert not db.exists()


async def test_serve_with_a_versioned_toml_records_the_version(
    db_url: str, workspace: Path, tmp_path: Path
) -> None:
    """``delegation serve --runner command --runner-config`` in its own process: the
    child it runs records the TOML's version."""
    from delegation.client.api import Client
    from tests.harness.client_hosts import ROOT, setup, start_params

    toml = runner_toml(tmp_path / "runner.toml", f'version = "{VERSION}"', profile="scripted")
    env = {k: v for k, v in os.environ.items() if k != "DELEGATION_RUNNER_VERSION"}
    argv = ["--db", db_url, "--runner", "command", "--runner-config", str(toml)]
    async with await Client.spawn(argv, env=env, cwd=ROOT) as client:
        await setup(client, workspace)
        started = await client.start(start_params("q1", "hello"))
        child = {"runId": "run-1", "toolCallId": "call-1", "extensionId": "ext",
                 "generation": 3, "childId": started.conversation_id}  # fmt: skip
        deadline = asyncio.get_running_loop().time() + 60
        while not (result := await client.read(child)).done:
            assert asyncio.get_running_loop().time() < deadline, result
            await asyncio.sleep(0.02)
        assert (result.error, result.pinned_version) == ("", "")

    def recorded() -> tuple[str | None, str | None]:
        with Operator(db_url) as op:
            found = op.show(started.conversation_id)
            assert found is not None
            return found.version, found.attempt_version

    assert await asyncio.to_thread(recorded) == (VERSION, VERSION)
