"""A command child reaches nothing that stands for the database (design §17), tried with
real processes as issue 23 found them:

- it sees no other process, and every process it starts dies with it: on its end (even
  when a ``setsid`` descendant holds its stdout), on cancel and on a graceful close;
- TCP only to ``net_connect`` ports, no bind: not a listener the test opens, not the
  test's PostgreSQL;
- an ordinary user's host gets the same namespaces through a user namespace;
- what cannot be had is said once in the log.

The host's death with a ``setsid`` descendant, and root hosts, are in
tests/runners/test_containment.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from delegation import Engine
from delegation.runners import child_launcher
from delegation.runners.command import CommandConfigError, CommandRunner
from delegation.runners.containment import Containment, landlock_abi, namespace_mode
from tests.harness.command_children import ended, first_text, hosted, script
from tests.harness.support import PRESET, open_harness
from tests.harness.trees import alive, child_tree, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux containment")
needs_namespaces = pytest.mark.skipif(namespace_mode() is None, reason="no namespaces here")
needs_net_rules = pytest.mark.skipif(landlock_abi() < 4, reason="Landlock ABI 4 needed")


def marked(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker`` reversed: the escapees below
    are given it so, to be told apart from the programs given it as it is."""
    marker, found = marker[::-1], []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
    return found


@pytest.fixture
def escapees() -> Iterator[str]:
    """A marker for the escapees a test starts; whatever survives is killed after it."""
    marker = f"escapee-{os.getpid()}-{os.urandom(4).hex()}"
    yield marker
    for pid in marked(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# --- its own process tree ---------------------------------------------------------

LOOK = """
    import json, os, sys
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    print(json.dumps({"kind": "text", "text": json.dumps([os.getpid(), pids])}), flush=True)
    sys.stdin.read()  # open until the child is cancelled
"""


@needs_namespaces
async def test_a_child_sees_no_process_but_its_own(tmp_path: Path) -> None:
    """Two children at once: each is process 1 of its own namespace and sees only
    itself: not the host, not the other."""
    runner = CommandRunner({"worker": script(LOOK)}, grace_s=0.2)
    async with hosted(tmp_path, runner) as h:
        first, second = await h.start("q1"), await h.start("q2")
        seen = [json.loads(await first_text(h, c.conversation_id)) for c in (first, second)]
        assert len(child_tree()) == 4, "both run at once (a keeper and a program each)"
        for child in (first, second):
            await h.engine.call(h.conn, "child.cancel", h.params(child_id=child.conversation_id))
    assert seen == [[1, [1]], [1, [1]]]


ESCAPE = """
    import json, os, sys, time
    if os.fork() == 0:  # a double fork into a session of its own, holding stdout
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c",
                     "import time\\nwhile True:\\n open('alive', 'a').write('.')\\n"
                     " time.sleep(0.05)", sys.argv[1][::-1]])
        os._exit(0)
    os.wait()
    print(json.dumps({"kind": "text", "text": "escaped"}), flush=True)
    if sys.argv[2] == "exit":
        sys.exit(0)
    time.sleep(600)
"""


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespace", "no-namespace"])
async def test_a_program_that_exits_ends_its_child_though_a_descendant_holds_stdout(
    tmp_path: Path, escapees: str, namespaces: bool
) -> None:
    """Issue 23, finding 4: the child stayed `running` for ever. It ends now either way;
    in a PID namespace the ``setsid`` escapee dies with the program, and without one it
    dies when the child's control groups are emptied (a root host's)."""
    if namespaces and namespace_mode() is None:
        pytest.skip("no namespaces here")
    runner = CommandRunner({"worker": script(ESCAPE, escapees, "exit")}, grace_s=0.2)
    if not namespaces:
        runner.containment.namespaces = None
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        assert await ended(h, started.conversation_id) == ""
        assert [e.text for e in await h.engine.events(started.conversation_id)][:1] == ["escaped"]
        if namespaces or runner.containment.cgroups is not None:
            wait_for(lambda: not marked(escapees))  # its namespace's end, or its group's
        else:  # the documented limit: without a namespace, setsid leaves the group
            assert marked(escapees), "the escapee is the test's premise"


@needs_namespaces
async def test_a_setsid_escapee_dies_on_cancel(tmp_path: Path, escapees: str) -> None:
    runner = CommandRunner({"worker": script(ESCAPE, escapees, "stay")}, grace_s=0.2)
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        assert await first_text(h, started.conversation_id) == "escaped"
        assert len(marked(escapees)) == 1
        await h.engine.call(h.conn, "child.cancel", h.params(child_id=started.conversation_id))
        assert (await ended(h, started.conversation_id)).startswith("cancelled")
        wait_for(lambda: not marked(escapees))


@needs_namespaces
async def test_a_setsid_escapee_dies_on_a_graceful_close(
    tmp_path: Path, escapees: str, caplog: pytest.LogCaptureFixture
) -> None:
    runner = CommandRunner({"worker": script(ESCAPE, escapees, "stay")}, grace_s=0.2)
    caplog.set_level(logging.WARNING)
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1", lease_id="")
        assert await first_text(h, started.conversation_id) == "escaped"
        assert len(marked(escapees)) == 1
    wait_for(lambda: not marked(escapees))
    assert [r for r in caplog.records if r.exc_info] == [], "the close logged a traceback"


# --- the network ceiling ------------------------------------------------------------

CONNECT = """
    import json, socket, sys
    def attempt(port):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
            return "connected"
        except OSError as exc:
            return f"denied ({exc.errno})" if exc.errno == 13 else f"failed ({exc.errno})"
    def bind():
        try:
            socket.socket().bind(("127.0.0.1", 0))
            return "bound"
        except OSError as exc:
            return f"denied ({exc.errno})"
    report = {port: attempt(int(port)) for port in sys.argv[1:]}
    report["bind"] = bind()
    print(json.dumps({"kind": "result", "text": json.dumps(report)}), flush=True)
"""


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


async def _reach(tmp_path: Path, ports: list[int], **settings: object) -> dict[str, str]:
    runner = CommandRunner({"worker": script(CONNECT, *map(str, ports))}, **settings)  # type: ignore[arg-type]
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        assert await ended(h, started.conversation_id) == ""
        record = await h.engine.get_child(started.conversation_id)
    assert record is not None
    report: dict[str, str] = json.loads(record.output)
    return report


@needs_net_rules
async def test_a_child_connects_to_no_port_it_is_not_given(
    tmp_path: Path, listener: socket.socket, postgres_url: str
) -> None:
    """Issue 23, finding 2: the database server and the operator's page were a connect
    away. A listener of the test's and the test's PostgreSQL are refused, and so is
    every bind; the default ceiling is HTTPS."""
    mine = listener.getsockname()[1]
    database = urlsplit(postgres_url).port
    assert database is not None
    report = await _reach(tmp_path, [mine, database])
    assert report == {str(mine): "denied (13)", str(database): "denied (13)",
                      "bind": "denied (13)"}  # fmt: skip


@needs_net_rules
async def test_net_connect_names_the_ports_a_child_may_reach(
    tmp_path: Path, listener: socket.socket
) -> None:
    mine = listener.getsockname()[1]
    report = await _reach(tmp_path, [mine], net_connect=[mine])
    assert report == {str(mine): "connected", "bind": "denied (13)"}


@pytest.mark.parametrize("ports", [[0], [65536], ["443"], [True], 443, [1.5]])
def test_net_connect_takes_tcp_ports_only(ports: object) -> None:
    with pytest.raises(CommandConfigError, match="net_connect"):
        CommandRunner({"worker": ["true"]}, net_connect=ports)  # type: ignore[arg-type]


def test_net_connect_comes_from_the_toml(tmp_path: Path) -> None:
    toml = tmp_path / "runner.toml"
    toml.write_text('[command]\nnet_connect = [443, 8443]\n'
                    '[command.profiles.worker]\nargv = ["true"]\n')  # fmt: skip
    assert CommandRunner.from_file(toml).containment.net_connect == (443, 8443)


# --- what cannot be had is said once ------------------------------------------------


async def test_what_this_machine_cannot_enforce_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = CommandRunner({"worker": ["/bin/true"]})
    runner.containment.landlock = 3  # a kernel with Landlock but no network rules
    runner.containment.namespaces = None  # a machine that allows no namespaces
    caplog.set_level(logging.WARNING, logger="delegation.runners.command")
    async with hosted(tmp_path, runner) as h:
        for i in range(3):
            started = await h.start(f"q{i}")
            assert await ended(h, started.conversation_id) == ""
    actions = [getattr(r, "action", "") for r in caplog.records]
    assert actions.count("landlock_network_unavailable") == 1
    assert actions.count("namespaces_unavailable") == 1


# --- a refusal is named in the host's log -----------------------------------------------

needs_landlock = pytest.mark.skipif(landlock_abi() < 1, reason="Landlock needed")


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    found = [r for r in caplog.records if getattr(r, "action", "") == "child_access_refused"]
    return [record.getMessage() for record in found]


@needs_landlock
async def test_a_path_outside_a_childs_reach_is_named_in_the_hosts_log_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 29: the child hears a bare "Permission denied"; the host's log now says
    which path was beyond its reach, once for the child, however often it tried."""
    (tmp_path / "outside").mkdir()
    secret = tmp_path / "outside" / "secret.txt"
    secret.write_text("not for the child")
    argv = ["sh", "-c", 'cat "$0"; cat "$0"; exit 3', str(secret)]
    caplog.set_level(logging.WARNING, logger="delegation.runners.command")
    async with hosted(tmp_path, CommandRunner({"worker": argv})) as h:
        started = await h.start()
        error = await ended(h, started.conversation_id)
    assert f"cat: {secret}: Permission denied" in error, error
    (said,) = refusals(caplog)
    assert f"its confinement refused what its stderr names: {secret} (outside it)" in said
    assert said.startswith(f"command child {started.conversation_id}: ")


@needs_landlock
async def test_a_refusal_naming_no_path_gets_the_childs_roots_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where it stops: a path the program names relative to its cwd is not resolved; the
    log lists what the child may reach instead."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("not for the child")
    argv = ["sh", "-c", "cat ../outside/secret.txt"]
    caplog.set_level(logging.WARNING, logger="delegation.runners.command")
    async with hosted(tmp_path, CommandRunner({"worker": argv})) as h:
        started = await h.start()
        assert "Permission denied" in await ended(h, started.conversation_id)
    (said,) = refusals(caplog)
    assert "names no path beyond its reach: it may write beneath " in said, said
    assert str((tmp_path / "ws").resolve()) in said and "read beneath /usr" in said


async def test_a_child_that_reports_no_refusal_leaves_no_such_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["sh", "-c", "echo something else went wrong >&2; exit 1"]
    caplog.set_level(logging.WARNING, logger="delegation.runners.command")
    async with hosted(tmp_path, CommandRunner({"worker": argv})) as h:
        started = await h.start()
        assert "something else went wrong" in await ended(h, started.conversation_id)
    assert refusals(caplog) == []


def test_a_refused_path_is_placed_against_the_childs_roots(tmp_path: Path) -> None:
    contained = Containment(read_only=("/usr",), read_write=(), landlock=7, socket_filter=True)
    cwd, tmp = str(tmp_path / "ws"), str(tmp_path / "tmp")
    stderr = (
        "sh: 1: cannot create /usr/x: Permission denied\n"
        f"cat: {cwd}/mode000: Permission denied\n"  # its file mode, not Landlock
        "PermissionError: [Errno 13] Permission denied: '/srv/elsewhere/y'\n"
        "cat: /srv/\x1b[31mred: Permission denied\n"
    )
    said = contained.refused_reach(stderr, cwd, tmp)
    assert said == (
        "its confinement refused what its stderr names: /usr/x (read-only for it),"
        " /srv/elsewhere/y (outside it), /srv/ (outside it)"
    )
    only_mode = contained.refused_reach(f"cat: {cwd}/f: Permission denied", cwd, tmp)
    assert only_mode is not None and only_mode.startswith("its stderr says")
    assert only_mode.endswith("connect to TCP ports 443; create only TCP and UDP sockets")
    assert contained.refused_reach("cat: /x: No such file or directory", cwd, tmp) is None
    contained.landlock = 0  # nothing confined it: nothing to explain
    assert contained.refused_reach("cat: /x: Permission denied", cwd, tmp) is None


# --- an ordinary user's host ---------------------------------------------------------

NOBODY_PROGRAM = """
import json, os, sys
if os.fork() == 0:
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)",
                              sys.argv[1][::-1]])
status = open("/proc/self/status").read().splitlines()
caps = [line.split()[1] for line in status if line.startswith(("CapEff", "CapPrm", "CapBnd"))]
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print(json.dumps([os.getpid(), os.getuid(), len(pids), caps]), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_an_ordinary_users_child_gets_its_own_namespace(tmp_path: Path, escapees: str) -> None:
    """The launcher as uid 65534 (what an ordinary user's host runs): a user namespace
    with only its own uid, a PID namespace where it is process 1, no capability, and
    its ``setsid`` child dies when it ends. The launcher needs only the standard library,
    so a system Python runs it from a copy any user may read."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for another user")
    place = Path(tempfile_dir(tmp_path))
    launcher = place / "child_launcher.py"
    shutil.copy(child_launcher.__file__, launcher)
    probe = subprocess.run([python, "-I", "-S", str(launcher), "--probe"], user=65534,
                           group=65534, extra_groups=[], capture_output=True, text=True,
                           timeout=30, check=False, cwd="/")  # fmt: skip
    if (json.loads(probe.stdout or "{}") or {}).get("namespaces") != "user":
        pytest.skip(f"unprivileged user namespaces are not allowed here: {probe.stdout}")
    go_read, go_write = os.pipe()
    os.write(go_write, b"1")
    os.close(go_write)
    spec = {"parent": os.getpid(), "cwd": str(place), "read_write": [str(place)],
            "read_only": ["/usr", "/lib", "/lib64", "/etc", "/proc", "/bin"],
            "net_connect": [], "namespaces": "user", "go_fd": go_read}  # fmt: skip
    try:
        run = subprocess.run([python, "-I", "-S", str(launcher), json.dumps(spec), python, "-c",
                              NOBODY_PROGRAM, escapees], user=65534, group=65534,
                             extra_groups=[], pass_fds=(go_read,), capture_output=True,
                             text=True, timeout=30, check=False, cwd="/")  # fmt: skip
    finally:
        os.close(go_read)
    assert run.returncode == 0, run.stderr
    pid, uid, processes, caps = json.loads(run.stdout)
    assert (pid, uid) == (1, 65534)
    assert processes <= 2, "itself and its setsid child, nothing of the host"
    assert caps == ["0000000000000000"] * 3
    wait_for(lambda: not marked(escapees))


def tempfile_dir(tmp_path: Path) -> str:
    """A directory uid 65534 may enter and write (pytest's tmp_path is root's, 0700)."""

    place = tempfile.mkdtemp(prefix="dlg-nobody-", dir="/tmp")
    os.chmod(place, 0o777)
    return place


# --- how an operator checks it --------------------------------------------------------


def test_delegation_containment_prints_what_a_child_got(tmp_path: Path) -> None:
    """The operator's check starts a real child: each line is something it just tried."""
    toml = tmp_path / "runner.toml"
    toml.write_text('[command]\nnet_connect = [8443]\n[command.profiles.p]\nargv = ["true"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "containment", "--runner-config", str(toml),
         "--json", "--bench", "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["net_connect"] == [8443]
    assert report["capabilities"] == report["bounding_set"] == "0000000000000000"
    assert (report["no_new_privs"], report["seccomp"]) == ("1", "2")
    assert report["write_workspace"] == "allowed"
    assert report["unix_socket"].startswith("denied (13")
    assert report["keyring"].startswith("denied (1 "), report  # SPEC §31: no channel
    assert report["user_namespace"].startswith("denied (1 "), report
    denied = ["write_outside", "read_outside"] if landlock_abi() else []
    denied += ["tcp_connect_other_port", "tcp_bind"] if landlock_abi() >= 4 else []
    assert [key for key in denied if not report[key].startswith("denied")] == [], report
    if namespace_mode() is not None:
        assert (report["pid"], report["processes_visible"], report["host_visible"]) == (1, 1, False)
    assert set(report["spawn_to_first_line"]) >= {"bare_ms", "launcher_no_namespace_ms"}


# --- libpq's credentials --------------------------------------------------------------


@pytest.mark.parametrize("named_in", ["PGPASSFILE", "passfile", "sslkey", "service"])
async def test_libpqs_password_file_is_unreadable_and_no_workspace_may_hold_it(
    tmp_path: Path, postgres_db: str, monkeypatch: pytest.MonkeyPatch, named_in: str
) -> None:
    """Issue 23's gap: a PGPASSFILE under a ``read_only`` directory (``/etc`` is one by
    default) was readable by every child; issue 35's: a ``passfile`` named in the URL
    was not protected at all (a child read it and logged in). design §23: the child runs,
    the file carved out of what it may read; a workspace that holds it is refused.
    Named by libpq's variable, by the URL (``passfile``, ``sslkey``), or by the entry of
    the URL's ``service`` in a service file."""
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    (secrets_dir / "pgpass").write_text("*:*:*:*:hunter2\n")
    (secrets_dir / "pgpass").chmod(0o644)  # its mode would not keep the child out
    (secrets_dir / "beside.txt").write_text("readable")
    secret = str(secrets_dir / "pgpass")
    if named_in == "PGPASSFILE":
        monkeypatch.setenv("PGPASSFILE", secret)
    elif named_in == "service":
        services = tmp_path / "services.conf"  # a service file beside: no child reads it
        services.write_text(f"[mine]\nsslkey={secret}\n")
        monkeypatch.setenv("PGSERVICEFILE", str(services))
        postgres_db += "&service=mine" if "?" in postgres_db else "?service=mine"
    else:
        postgres_db += f"{'&' if '?' in postgres_db else '?'}{named_in}={secret}"
    (tmp_path / "ws").mkdir()
    reader = script(READ_BOTH, str(secrets_dir / "pgpass"), str(secrets_dir / "beside.txt"))
    runner = CommandRunner({"worker": reader}, read_only=[str(secrets_dir)])
    async with Engine(postgres_db, runner=runner) as engine:
        h = await open_harness(engine, runner, tmp_path / "ws", [PRESET])
        started = await h.start("q1")
        assert await ended(h, started.conversation_id) == ""
        read = json.loads(await first_text(h, started.conversation_id))
    assert read["beside.txt"] == "readable", "the rest of the directory stays readable"
    assert read["pgpass"].startswith("denied"), read
    async with Engine(postgres_db, runner=runner) as engine:
        h = await open_harness(engine, runner, secrets_dir, [PRESET])
        started = await h.start("q1")
        error = await ended(h, started.conversation_id)
    assert error == f"child confinement would reach the host: {secrets_dir}"


READ_BOTH = """
    import json, os, sys
    found = {}
    for path in sys.argv[1:]:
        try:
            found[os.path.basename(path)] = open(path).read()
        except OSError as exc:
            found[os.path.basename(path)] = f"denied ({exc.errno})"
    print(json.dumps({"kind": "text", "text": json.dumps(found)}), flush=True)
"""
