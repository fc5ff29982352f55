"""The command runner's children as the launcher confines them (SPEC §10): no Unix socket
through io_uring, a socket filter that leaves no architecture open, no Landlock rule for a
directory swapped after the check; a refused start leaks no descriptor, and a clean close
leaves no process record for the next boot to kill."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from delegation import Engine, Params, Preset, Request
from delegation.runners import child_launcher
from delegation.runners.command import CommandRunner
from delegation.runners.containment import Containment, landlock_abi
from tests import rows

HERE = Path(__file__).resolve().parent
linux = pytest.mark.skipif(sys.platform != "linux", reason="Linux containment")
needs_landlock = pytest.mark.skipif(landlock_abi() < 1, reason="Landlock needed")


@pytest.fixture
def place(tmp_path: Path) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dlg-r-", dir="/tmp"))
    for name in ("db", "ws", "outside"):
        (root / name).mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _launch(argv: list[str], cwd: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """``argv`` through the real launcher, confined as a command child is."""
    r, w = os.pipe()
    full = Containment().launcher(argv, str(cwd), str(tmp), r)
    proc = subprocess.Popen(full, pass_fds=(r,), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")  # fmt: skip
    os.close(r)
    os.write(w, b"1")
    os.close(w)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(full, proc.returncode, out, err)


# --- io_uring makes no AF_UNIX socket that seccomp never sees ----------------------------


@linux
def test_a_child_gets_no_unix_socket_through_io_uring(place: Path) -> None:
    sock_path = place / "db" / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    server.listen()
    shutil.copy(HERE / "uring_socket.py", place / "ws")
    tmp = place / "tmp"
    tmp.mkdir()
    try:
        done = _launch([sys.executable, "uring_socket.py", str(sock_path)], place / "ws", tmp)
    finally:
        server.close()
    assert done.returncode == 0, done.stderr
    assert not done.stdout.startswith("connected"), "a contained child reached a Unix socket"


# --- the filter, run by a classic-BPF interpreter ----------------------------------------


def _run_bpf(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = struct.unpack_from("=HBBI", program, pc * 8)
        if code == 0x20:
            (acc,) = struct.unpack_from("=I", data, k)
            pc += 1
        elif code in (0x15, 0x35):
            hit = acc == k if code == 0x15 else acc >= k
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"opcode {code:#x}")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_socket_filter_leaves_no_architecture_and_no_io_uring_open(
    machine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    captured: list[bytes] = []
    monkeypatch.setattr(child_launcher.platform, "machine", lambda: machine)
    monkeypatch.setattr(child_launcher, "_assemble", _capture(child_launcher._assemble, captured))

    class NoLibc:
        def prctl(self, *args: object) -> int:
            return 0

    assert child_launcher.no_unix_sockets(NoLibc())  # type: ignore[arg-type]
    (program,) = captured
    allow = 0x7FFF0000
    native = child_launcher._AUDIT_ARCH[machine]
    assert _run_bpf(program, child_launcher._SOCKET_NR[machine], native, 1) != allow
    assert _run_bpf(program, child_launcher._SOCKET_NR[machine], native, 2) == allow  # AF_INET
    assert _run_bpf(program, 425, native) != allow, "io_uring_setup makes sockets too"
    if machine == "x86_64":
        assert _run_bpf(program, 359, 0x40000003, 1) != allow
        assert _run_bpf(program, 425, 0x40000003) != allow, "i386 io_uring_setup"
    else:  # arm32 compat tasks on arm64: socket is 281 there
        assert _run_bpf(program, 281, 0x40000028, 1) != allow, "AUDIT_ARCH_ARM is let through"


def _capture(assemble, captured):  # type: ignore[no-untyped-def]
    def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        captured.append(assemble(*args, **kwargs))
        return captured[-1]

    return wrapped


# --- Landlock's rule for the cwd follows no path the check no longer holds ---------------

SWAP = """
import json, os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import child_launcher as contain
ws, secret, ro = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
real = contain.landlock
def swapped(libc, rw, ro, *ports):  # another child swaps the directory after the check
    os.rename(ws, ws + ".real"); os.symlink(secret, ws)
    return real(libc, rw, ro, *ports)
contain.landlock = swapped
r, w = os.pipe(); os.write(w, b"1"); os.close(w)
spec = {"parent": os.getppid(), "cwd": ws, "read_write": [ws], "read_only": ro,
        "seccomp": False, "go_fd": r}
code = "open(%r, 'w').write('x')" % os.path.join(secret, "pwned")
contain.main(["contain", json.dumps(spec), sys.executable, "-c", code])
"""


@linux
@needs_landlock
def test_a_directory_swapped_after_the_check_gets_no_landlock_rule(place: Path) -> None:
    ws, secret = place / "ws", place / "outside"
    ro = list(Containment().read_only)
    proc = subprocess.run(
        [sys.executable, "-c", SWAP, child_launcher.__file__, str(ws), str(secret), json.dumps(ro)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert not (secret / "pwned").exists(), ("written outside the workspace", proc.stderr)


# --- a refused start leaks no end of the go-ahead pipe ----------------------------------


def _pipes() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    return count


def _params(request_id: str, profile: str, lease_id: str = "") -> Params:
    ask = Request(request_id=request_id, profile=profile, message="m", lease_id=lease_id)
    return Params(run_id="run", tool_call_id="call", extension_id="ext", generation=1,
                  request=ask, lease_id=lease_id)  # fmt: skip


async def _tool(engine: Engine, profile: str, workspace: Path):  # type: ignore[no-untyped-def]
    conn = await engine.connect("runner-1", "host-a")
    await engine.open_tool(
        conn, run_id="run", conversation_id="conv", tool_call_id="call", extension_id="ext",
        presets=[Preset(name=profile, extension_id="ext", generation=1)],
        workspace=str(workspace),
    )  # fmt: skip
    return conn


async def _ended(engine: Engine, conversation_id: str):  # type: ignore[no-untyped-def]
    while (record := await engine.get_child(conversation_id)) and not record.terminal:
        await asyncio.sleep(0.01)
    return record


@linux
async def test_a_refused_confinement_leaks_no_descriptor(place: Path) -> None:
    ws = place / "ws"
    runner = CommandRunner({"pwd": ["/bin/pwd"]})
    before = _pipes()
    async with Engine(f"sqlite:///{ws}/x.db", runner=runner) as engine:
        conn = await _tool(engine, "pwd", ws)
        for i in range(5):
            started = await engine.call(conn, "child.start", _params(f"q{i}", "pwd"))
            record = await _ended(engine, started.conversation_id)
            assert record.error.startswith("child confinement would reach")
    assert _pipes() <= before, "each refused start leaves a pipe open"


# --- a clean close leaves no process record that the next boot would killpg() ------------


def _processes(url: str) -> list[tuple[object, ...]]:
    return rows.rows(url, "SELECT * FROM processes")


@linux
async def test_a_clean_close_leaves_no_process_record(place: Path, db_url: str) -> None:
    runner = CommandRunner({"wait": ["/bin/sh", "-c", "read l; read l"]}, grace_s=0.1)
    async with Engine(db_url, runner=runner) as engine:
        conn = await _tool(engine, "wait", place / "ws")
        await engine.call(conn, "child.start", _params("q1", "wait", lease_id="L1"))
        for _ in range(500):
            if _processes(db_url):
                break
            await asyncio.sleep(0.01)
        assert _processes(db_url)
    assert _processes(db_url) == [], "reaped at close, yet killpg'd at next boot"
