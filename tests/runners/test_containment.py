"""Command children are contained (design §10): real children try every escape of issue 13.

- a child reads the host's environment, memory, database, and registers on its socket;
- a child that leaves a grandchild behind when the host is killed: the next boot kills
  it before resuming, and exactly one copy runs;
- a directory swapped for a symlink while children start: none runs outside.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from delegation import (
    ChildRecord,
    Engine,
    EngineConfig,
    Params,
    Preset,
    Request,
    RunnerConnection,
)
from delegation import os_processes as processes
from delegation.authority import within
from delegation.runners.command import CommandRunner
from delegation.runners.containment import landlock_abi, namespace_mode
from tests.harness.contain_host import tree_runner
from tests.harness.fuzzing import snapshot
from tests.harness.trees import LAUNCHER_MARK, launchers, program_of

HERE = Path(__file__).resolve().parents[1] / "harness"
ROOT = HERE.parents[1]
HOST = HERE / "contain_host.py"
SECRETS = {
    "OPENAI_API_KEY": "sk-openai-test",
    "ANTHROPIC_API_KEY": "sk-ant-test",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-test",
    "GITHUB_TOKEN": "ghp_test",
}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux containment")
needs_landlock = pytest.mark.skipif(landlock_abi() < 6, reason="Landlock ABI 6 needed")


def processes_with(marker: str, launchers: bool = False) -> list[int]:
    """Live (not zombie) processes whose command line holds ``marker``: programs only,
    unless ``launchers`` (a program's keeper carries its command line too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        mine = launchers or LAUNCHER_MARK not in cmdline
        if marker.encode() in cmdline and state != "Z" and mine:
            found.append(int(entry.name))
    return found


@pytest.fixture
def place(tmp_path: Path) -> Iterator[Path]:
    """A short directory for a socket path, with the database apart from the workspace."""
    root = Path(f"/tmp/dlg-{os.getpid()}-{tmp_path.name[-12:]}")
    root.mkdir()
    for name in ("db", "ws", "outside"):
        (root / name).mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@needs_landlock
@pytest.mark.parametrize(
    ("user", "namespaces"), [("ordinary", "no-ns"), ("root", "ns"), ("root", "no-ns")]
)
def test_a_child_gets_nothing_it_tries(place: Path, user: str, namespaces: str) -> None:
    """As an ordinary user or as root (design §17: no root powers), in a PID namespace of
    its own or not: the host's environ, memory and ptrace, a file of mode 000, the
    database, the socket, writes outside, signals. (A root without capabilities, as the
    ordinary case is made, may not map uid 0 into a user namespace: it gets none; an
    ordinary user's namespaces are tested in tests/runners/test_child_reach.py.)"""
    if user == "root" and os.geteuid() != 0:
        pytest.skip("the root case needs a root test run (CI is one)")
    if namespaces == "ns" and namespace_mode() is None:
        pytest.skip("namespaces are not allowed here")
    db, sock = place / "db" / "delegation.db", place / "db" / "host.sock"
    locked = place / "ws" / "locked.txt"
    locked.write_text("private")
    locked.chmod(0)
    env = {**os.environ, **SECRETS}
    proc = subprocess.run(
        [sys.executable, str(HOST), "attack", str(db), str(place / "ws"), str(sock),
         str(place / "outside"), user, namespaces],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout.splitlines()[-1])
    assert outcome["error"] == "", outcome
    report = json.loads(outcome["output"])
    attempts = ("environ", "mem", "ptrace", "mode_000", "db", "db_dir", "socket",
                "write_outside", "signal_host")  # fmt: skip
    for attempt in attempts:
        assert report[attempt].startswith("denied"), (attempt, report)
    assert report["socket"] == "denied (13)", "seccomp refuses the AF_UNIX socket"
    if namespaces == "ns":  # not even there: the host is no process of its namespace
        assert (report["environ"], report["ptrace"]) == ("denied (2)", "denied (3)"), report
    assert (report["write_cwd"], report["write_tmp"]) == ("written", "written")
    assert (place / "ws" / "inside.txt").exists()
    assert not (place / "outside" / "escaped.txt").exists()
    assert outcome["lease_revoked"] == [False], "no re-registration revoked the lease"


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespace", "no-namespace"])
def test_no_copy_of_a_child_survives_its_hosts_kill(place: Path, namespaces: bool) -> None:
    """In a PID namespace the whole tree dies with the host; without one a grandchild
    outlives it, and the next boot kills it before resuming. Either way one copy runs."""
    if namespaces and namespace_mode() is None:
        pytest.skip("namespaces are not allowed here")
    db = place / "db" / "delegation.db"
    mode = "ns" if namespaces else "no-ns"
    host = subprocess.Popen(
        [sys.executable, str(HOST), "orphan", str(db), str(place / "ws"), mode],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert host.stdout is not None
    conversation = host.stdout.readline().split()[1]
    child, grand = f"child-{conversation}", f"grand-{conversation}"
    try:
        (old_child,), (old_grand,) = processes_with(child), processes_with(grand)
        host.send_signal(signal.SIGKILL)
        host.wait(10)
        host.stdout.close()
        _wait_for(lambda: not processes_with(child))  # the parent-death signal
        if namespaces:
            _wait_for(lambda: not processes_with(grand))  # its namespace ended with it
        else:
            assert processes_with(grand) == [old_grand], "a grandchild outlives the host"
        asyncio.run(_resume_and_count(db, conversation, old_grand, old_child, namespaces))
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        for pid in processes_with(conversation, launchers=True):
            os.kill(pid, signal.SIGKILL)


async def _resume_and_count(
    db: Path, conversation: str, old_grand: int, old: int, namespaces: bool
) -> None:
    config = EngineConfig(release_drain_s=2.0)
    async with Engine(f"sqlite:///{db}", runner=tree_runner(namespaces), config=config) as e:
        assert not Path(f"/proc/{old_grand}").exists() or old_grand not in processes_with(
            f"grand-{conversation}"
        ), "boot killed the orphan before resuming"
        await _until_async(lambda: len(processes_with(f"grand-{conversation}")) == 1, e)
        assert len(processes_with(f"child-{conversation}")) == 1, "exactly one copy runs"
        assert old not in processes_with(f"child-{conversation}")
        result = await e.cancel_child(conversation)
        assert result.cancelled
    assert processes_with(conversation, launchers=True) == [], "cancel reaped the whole tree"


async def _tool(engine: Engine, profile: str, workspace: Path) -> RunnerConnection:
    """Connect the usual runner and open a tool call offering ``profile``."""
    conn = await engine.connect("runner-1", "host-a")
    preset = Preset(name=profile, extension_id="ext", generation=1)
    await engine.open_tool(
        conn, run_id="run", conversation_id="conv", tool_call_id="call",
        extension_id="ext", presets=[preset], workspace=str(workspace),
    )  # fmt: skip
    return conn


def _params(request_id: str, profile: str, **request: str) -> Params:
    ask = Request(request_id=request_id, profile=profile, message="m", **request)
    return Params(run_id="run", tool_call_id="call", extension_id="ext", generation=1, request=ask)


async def _ended(engine: Engine, conversation_id: str) -> ChildRecord:
    while (record := await engine.get_child(conversation_id)) and not record.terminal:
        await asyncio.sleep(0.01)
    assert record is not None
    return record


async def _until_async(check: object, engine: Engine) -> None:
    for _ in range(500):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def _wait_for(check: object) -> None:
    for _ in range(500):
        if check():  # type: ignore[operator]
            return
        threading.Event().wait(0.01)
    raise AssertionError("timed out")


async def test_a_swapped_directory_never_moves_a_child_out(place: Path) -> None:
    """Issue 13, finding 5: 19 of 300 starts ran outside with a swap loop."""
    ws, outside = place / "ws", place / "outside"
    (ws / "sub").mkdir()
    runner = CommandRunner({"pwd": ["/bin/pwd", "-P"]}, grace_s=0.1)
    stop = threading.Event()

    def swap() -> None:  # the directory and a symlink to outside take turns
        while not stop.is_set():
            os.rename(ws / "sub", ws / "sub.real")
            os.symlink(outside, ws / "sub")
            stop.wait(0.002)
            os.unlink(ws / "sub")
            os.rename(ws / "sub.real", ws / "sub")
            stop.wait(0.003)

    config = EngineConfig(max_children_per_grant=1000)
    outcomes: list[str] = []
    async with Engine(f"sqlite:///{place / 'db' / 'x.db'}", runner=runner, config=config) as e:
        conn = await _tool(e, "pwd", ws)
        swapper = threading.Thread(target=swap)
        swapper.start()
        try:
            for batch in range(25):
                starts = [_one(e, conn, f"q{batch}-{i}") for i in range(8)]
                outcomes += await asyncio.gather(*starts)
        finally:
            stop.set()
            swapper.join()
    assert len(outcomes) == 200
    ran = [o.removeprefix("ran in ") for o in outcomes if o.startswith("ran in ")]
    # Renamed to sub.real after the child stood in it, it is still the same directory.
    escaped = [where for where in ran if not within(where, str(ws))]
    assert escaped == [], escaped
    assert ran, outcomes


async def _one(engine: Engine, conn: RunnerConnection, request_id: str) -> str:
    try:
        started = await engine.call(conn, "child.start", _params(request_id, "pwd", cwd="sub"))
    except Exception as exc:  # refused at the start or at admission: nothing ran
        return f"refused: {exc}"
    record = await _ended(engine, started.conversation_id)
    events = await engine.events(started.conversation_id)
    if record.error:
        return f"failed: {record.error}"
    return "ran in " + events[0].text.strip()


async def test_a_database_inside_the_workspace_is_never_given_to_a_child(place: Path) -> None:
    ws = place / "ws"
    runner = CommandRunner({"pwd": ["/bin/pwd"]})
    async with Engine(f"sqlite:///{ws}/x.db", runner=runner) as engine:
        conn = await _tool(engine, "pwd", ws)
        started = await engine.call(conn, "child.start", _params("q1", "pwd"))
        record = await _ended(engine, started.conversation_id)
    assert record.error.startswith("child confinement would reach the host database")


async def test_a_kernel_without_landlock_is_said_once(
    place: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = CommandRunner({"pwd": ["/bin/pwd"]})
    runner.containment.landlock = 0  # as on a kernel before 5.13
    caplog.set_level(logging.WARNING, logger="delegation.runners.command")
    async with Engine(f"sqlite:///{place / 'db' / 'x.db'}", runner=runner) as engine:
        conn = await _tool(engine, "pwd", place / "ws")
        for i in range(3):
            started = await engine.call(conn, "child.start", _params(f"q{i}", "pwd"))
            assert (await _ended(engine, started.conversation_id)).error == ""
    said = [r for r in caplog.records if getattr(r, "action", "") == "landlock_unavailable"]
    assert len(said) == 1


async def test_a_childs_process_is_recorded_while_it_runs(place: Path) -> None:
    runner = CommandRunner({"wait": ["/bin/sh", "-c", "read line; read line"]}, grace_s=0.1)
    db = place / "db" / "x.db"
    async with Engine(f"sqlite:///{db}", runner=runner) as engine:
        conn = await _tool(engine, "wait", place / "ws")
        started = await engine.call(conn, "child.start", _params("q1", "wait"))
        await _until_async(lambda: bool(snapshot(db)["processes"]), engine)
        ((_, pid, start, boot, _),) = snapshot(db)["processes"]
        assert processes.alive(processes.ProcessId(pid, start, boot))
        assert pid in launchers(), "the launcher is what is recorded"

        def program_started() -> bool:
            comm = Path(f"/proc/{program_of(pid)}/comm")
            return comm.exists() and comm.read_text().strip() == "sh"  # exec'd

        await _until_async(program_started, engine)
        status = Path(f"/proc/{program_of(pid)}/status").read_text()
        assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status
        await engine.cancel_child(started.conversation_id)
        assert snapshot(db)["processes"] == [], "the record ends with the run"
        assert not processes.alive(processes.ProcessId(pid, start, boot))
