"""The host's own code and configuration are out of a command child's reach (design §17).

Issue 23's finding: with the host's venv inside the workspace, a child planted a ``.pth``
file in site-packages, and the next host start ran it unconfined. A confinement that
lets a child write the host's Python prefixes, site-packages, the ``delegation``
package or the runner's TOML is refused, as one that reaches the database's directory
is; the engine hands what it protects to every run (``ctx.protected``), so a host's own
runner that wraps the command runner cannot forget it.
"""

from __future__ import annotations

import asyncio
import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import msgspec
import pytest

from delegation import Engine, Identity, Preset, Recovery, Request, Run
from delegation.run.protection import (
    DATABASE_REACHED,
    HOST_REACHED,
    PACKAGE,
    Protected,
    host_code,
    host_imports,
)
from delegation.runners.command import CommandConfigError, CommandRunner
from delegation.runners.containment import ContainmentRefused
from tests.harness.contain_host import start

HERE = Path(__file__).resolve().parents[1] / "harness"
ROOT = HERE.parents[1]
HOST = HERE / "protect_host.py"
RAN = ["/bin/sh", "-c", "echo ran > ran; echo ran"]  # leaves a file where it ran

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux containment")


class Wrapping:
    """A host's own runner that holds a command runner and forwards ``prepare`` only:
    no ``protect_paths`` for the engine to call."""

    def __init__(self, inner: CommandRunner) -> None:
        self._inner = inner

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        return await self._inner.prepare(request, preset, identity, recovery)


async def _run_once(db: Path, runner: object, workspace: Path, profile: str) -> tuple[str, int]:
    """Start one child in ``workspace``; its error and how many events it emitted."""
    async with Engine(f"sqlite:///{db}", runner=runner) as engine:  # type: ignore[arg-type]
        child = await start(engine, profile, str(workspace))
        while (record := await engine.get_child(child.conversation_id)) and not record.terminal:
            await asyncio.sleep(0.01)
        assert record is not None
        return record.error, len(await engine.events(child.conversation_id))


# --- through the engine, with a runner that wraps the command runner --------------------


async def test_a_wrapped_runner_keeps_children_off_the_database(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    runner = Wrapping(CommandRunner({"ran": RAN}))
    error, events = await _run_once(ws / "x.db", runner, ws, "ran")
    assert (error, events) == (f"{DATABASE_REACHED}: {ws}", 0)
    assert not (ws / "ran").exists(), "the program never ran"


async def test_a_runner_toml_inside_the_workspace_is_refused(tmp_path: Path) -> None:
    ws, db = tmp_path / "ws", tmp_path / "db" / "x.db"
    (ws / "conf").mkdir(parents=True)
    db.parent.mkdir()
    toml = ws / "conf" / "runner.toml"
    toml.write_text(f"[command.profiles.ran]\nargv = {json.dumps(RAN)}\n")
    runner = Wrapping(CommandRunner.from_file(toml))
    error, events = await _run_once(db, runner, ws, "ran")
    assert (error, events) == (f"{HOST_REACHED}: {ws}", 0)
    assert not (ws / "ran").exists(), "the program never ran"


def _purelib_package() -> str:
    """A directory inside the host's site-packages."""
    return os.path.dirname(msgspec.__file__)


@pytest.mark.parametrize(
    "workspace",
    [
        pytest.param(os.path.dirname(PACKAGE), id="holds-the-package"),
        pytest.param(sys.prefix, id="is-the-prefix"),
    ],
)
async def test_a_child_that_could_write_the_hosts_code_is_refused(
    tmp_path: Path, workspace: str
) -> None:
    ws = Path(os.path.realpath(workspace))
    (tmp_path / "db").mkdir()
    pwd = CommandRunner({"pwd": ["/bin/pwd"]})  # writes nothing
    error, events = await _run_once(tmp_path / "db" / "x.db", Wrapping(pwd), ws, "pwd")
    assert (error, events) == (f"{HOST_REACHED}: {ws}", 0)


@pytest.mark.parametrize(
    "read_write",
    [
        pytest.param(sysconfig.get_path("purelib"), id="site-packages"),
        pytest.param(_purelib_package(), id="inside-site-packages"),
        pytest.param(str(ROOT), id="holds-a-directory-the-host-imports-from"),
    ],
)
def test_a_read_write_that_reaches_the_hosts_code_is_refused_as_the_host_starts(
    read_write: str,
) -> None:
    """Issue 35, finding 6: such a ``read_write`` was refused only per child."""
    with pytest.raises(CommandConfigError) as refused:
        CommandRunner({"pwd": ["/bin/pwd"]}, read_write=[read_write])
    assert str(refused.value) == f"read_write: {HOST_REACHED}: {read_write}"


# --- the attack itself, with a host whose venv lies in the workspace --------------------


@pytest.mark.parametrize("offered", ["workspace", "read_write"])
def test_a_pth_planted_in_the_hosts_site_packages_never_runs(tmp_path: Path, offered: str) -> None:
    ws, elsewhere, db = tmp_path / "ws", tmp_path / "elsewhere", tmp_path / "db" / "x.db"
    for directory in (ws, elsewhere, db.parent):
        directory.mkdir()
    venv = ws / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = str(venv / "bin" / "python")
    where = [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    purelib = subprocess.run(where, capture_output=True, text=True, check=True).stdout.strip()
    target, mark = Path(purelib) / "zz_planted.pth", tmp_path / "ran-at-start"
    line = f"import pathlib; pathlib.Path({str(mark)!r}).touch()"
    workspace, read_write = (ws, []) if offered == "workspace" else (elsewhere, [purelib])
    # The host's Python is the venv's; delegation and its dependencies come from here.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *site.getsitepackages()])}
    proc = subprocess.run(
        [python, str(HOST), "plant", str(db), str(workspace), str(target), line, *read_write],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    refused = f"{HOST_REACHED}: {workspace}" if offered == "workspace" else purelib
    if offered == "read_write":  # refused as the host starts, before any child
        refused = f"read_write: {HOST_REACHED}: {purelib}"
    assert json.loads(proc.stdout.splitlines()[-1]) == {"error": refused, "events": 0}
    assert not target.exists()
    subprocess.run([python, "-c", "pass"], check=True)  # the host's next start
    assert not mark.exists()


@pytest.mark.parametrize("started", ["script", "-c"])
def test_a_host_started_from_its_workspace_never_gives_it_to_a_child(
    tmp_path: Path, started: str
) -> None:
    """Issue 35, finding 3: a host run from a project directory (``python -m …`` or a
    script in it) imports from that directory first; with it as the workspace a child
    planted ``msgspec.py`` there, which the next host start imported unconfined. Every
    ``sys.path`` entry of the host and ``__main__``'s directory is host code now."""
    project, db = tmp_path / "project", tmp_path / "db" / "x.db"
    project.mkdir()
    db.parent.mkdir()
    target = project / "msgspec.py"
    plant = ["plant", str(db), str(project), str(target), "raise SystemExit('planted')"]
    if started == "script":  # the script's directory is sys.path[0]
        for helper in ("protect_host.py", "contain_host.py"):
            (project / helper).write_text((HERE / helper).read_text())
        argv = [sys.executable, str(project / "protect_host.py"), *plant]
    else:  # -c (and -m) put the working directory first
        run = "import runpy, sys; sys.argv = ['h', *%r]; runpy.run_path(%r, run_name='__main__')"
        argv = [sys.executable, "-c", run % (plant, str(HOST))]
    env = {**os.environ, "PYTHONPATH": str(HERE)}  # the helpers, after sys.path[0]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=project,
                          env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "error": f"{HOST_REACHED}: {project}",
        "events": 0,
    }
    assert not target.exists()


def test_the_hosts_imports_are_its_path_and_mains_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path / "lib"), *sys.path])
    imports = host_imports()
    assert str(tmp_path) in imports and str(tmp_path / "lib") in imports
    protected = Protected.of(imports=imports)
    assert protected.refusal([str(tmp_path)], []) == f"{HOST_REACHED}: {tmp_path}"
    assert protected.refusal([str(tmp_path / "ws")], []) is None, "beneath one is fine"


# --- the rule ---------------------------------------------------------------------------


def test_reading_may_hold_the_hosts_code_writing_may_not(tmp_path: Path) -> None:
    code = tmp_path / "venv"
    (code / "lib").mkdir(parents=True)
    protected = Protected.of(host=[str(code)])
    assert protected.refusal([], [str(tmp_path), str(code / "lib")]) is None
    for root in (tmp_path, code, code / "lib"):
        assert protected.refusal([str(root)], []) == f"{HOST_REACHED}: {root}"


def test_the_database_directory_keeps_its_v2_rule(tmp_path: Path) -> None:
    db_dir = tmp_path / "db"
    (db_dir / "ws").mkdir(parents=True)
    protected = Protected.of(database=[str(db_dir)], host=[str(db_dir)])
    refused = f"{DATABASE_REACHED}: {tmp_path}"
    assert protected.refusal([], [str(tmp_path)]) == refused, "not even to read"
    assert protected.refusal([str(tmp_path)], []) == refused, "named before the host"
    assert Protected.of(database=[str(db_dir)]).refusal([str(db_dir / "ws")], []) is None


def test_symlinks_count_both_ways(tmp_path: Path) -> None:
    code, ws = tmp_path / "code", tmp_path / "ws"
    code.mkdir()
    ws.mkdir()
    (ws / "to-code").symlink_to(code)
    (tmp_path / "to-ws").symlink_to(ws)
    # A root that resolves to the code, and the host's path to its code through a link
    # in the workspace (a child could point the link elsewhere).
    by_target = Protected.of(host=[str(code)])
    by_link = Protected.of(host=[str(ws / "to-code")])
    assert by_target.refusal([str(ws / "to-code")], []) == f"{HOST_REACHED}: {ws / 'to-code'}"
    assert by_link.refusal([str(tmp_path / "to-ws")], []) == f"{HOST_REACHED}: {tmp_path}/to-ws"


def test_the_hosts_code_is_its_prefixes_site_packages_and_package() -> None:
    code = host_code()
    for path in (sys.prefix, sys.base_prefix, sysconfig.get_path("purelib"), PACKAGE):
        assert path in code
    assert os.path.isfile(os.path.join(PACKAGE, "run", "protection.py"))


def test_protect_paths_still_protects_a_directory(tmp_path: Path) -> None:
    runner = CommandRunner({"pwd": ["/bin/pwd"]})
    runner.protect_paths([str(tmp_path / "db")])
    with pytest.raises(ContainmentRefused, match=DATABASE_REACHED):
        runner.containment.launcher(["pwd"], str(tmp_path), "/nowhere", 0, protected=Protected())
