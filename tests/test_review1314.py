"""Review 1314: failing tests for what the containment, control and client changes miss."""

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

from delegation import ChildContext, Engine, EngineConfig, Params, Preset, Request, errors
from delegation.client import Client
from delegation.runners import contain
from delegation.runners.command import CommandRunner
from delegation.runners.containment import Containment, landlock_abi
from tests import rows
from tests.support import ScriptRunner, hold, open_harness
from tests.test_push_control import operator

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


# --- 1. io_uring makes AF_UNIX sockets seccomp never sees ---------------------------------


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


# --- 2. the filter, run by a classic-BPF interpreter --------------------------------------


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
    monkeypatch.setattr(contain.platform, "machine", lambda: machine)
    monkeypatch.setattr(contain, "_assemble", _capture(contain._assemble, captured))

    class NoLibc:
        def prctl(self, *args: object) -> int:
            return 0

    assert contain.no_unix_sockets(NoLibc())  # type: ignore[arg-type]
    (program,) = captured
    allow = 0x7FFF0000
    native = contain._AUDIT_ARCH[machine]
    assert _run_bpf(program, contain._SOCKET_NR[machine], native, 1) != allow
    assert _run_bpf(program, contain._SOCKET_NR[machine], native, 2) == allow  # AF_INET
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


# --- 3. Landlock's rule for the cwd follows a path the check no longer holds --------------

SWAP = """
import json, os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import contain
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
        [sys.executable, "-c", SWAP, contain.__file__, str(ws), str(secret), json.dumps(ro)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert not (secret / "pwned").exists(), ("written outside the workspace", proc.stderr)


# --- 4. the go-ahead pipe's write end leaks when the start is refused ---------------------


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


# --- 5. a clean close leaves process records that the next boot killpg()s ----------------


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


# --- 6, 7. operator cancel -------------------------------------------------------------------


async def test_an_operator_cancel_of_a_slow_child_is_not_reported_as_no_live_host(
    db_url: str, workspace: Path
) -> None:
    async def slow(ctx: ChildContext) -> None:
        await ctx.admit()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.sleep(4))  # a CLI agent saving its work
            raise

    runner = ScriptRunner(slow)
    async with Engine(db_url, runner=runner, config=EngineConfig(release_drain_s=10)) as engine:
        h = await open_harness(engine, runner, workspace)
        child = await h.start("q1", lease_id="L1")
        code, out, err = await operator("cancel", child.conversation_id, "--json", db=db_url)
        assert code == 0, err
        assert json.loads(out)["applied"] is True, out
        assert (await _ended(engine, child.conversation_id)).state == "cancelled"


async def test_a_cancel_left_while_down_stops_the_child_before_it_runs_again(
    db_url: str, workspace: Path
) -> None:
    runner = ScriptRunner(hold(asyncio.Event()))
    async with Engine(db_url, runner=runner) as engine:
        h = await open_harness(engine, runner, workspace)
        child = await h.start("q1", lease_id="L1")
    code, out, err = await operator("cancel", child.conversation_id, db=db_url)
    assert code == 0 and "queued" in out, err
    resumed = ScriptRunner(hold(asyncio.Event()))
    async with Engine(db_url, runner=resumed) as engine:
        record = await _ended(engine, child.conversation_id)
        assert (record.state, record.error) == ("cancelled", "cancelled by operator")
    assert resumed.started == 0, "the cancelled command ran again from its start"


# --- 8. the client --------------------------------------------------------------------------


async def test_an_answer_to_an_abandoned_call_is_not_why_the_connection_ended(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "s.sock")
    got: asyncio.Queue[bytes] = asyncio.Queue()
    peer: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer.append(writer)
        while line := await reader.readline():
            await got.put(line)

    server = await asyncio.start_unix_server(serve, path)
    client = await Client.connect(path)
    try:
        first = asyncio.create_task(client.call("child.read", {}))
        await got.get()
        first.cancel()  # the caller gave up (a timeout)
        failure = {"code": -32602, "message": "child not found",
                   "data": {"reason": "child_not_found"}}  # fmt: skip
        peer[0].write(json.dumps({"jsonrpc": "2.0", "id": 1, "error": failure}).encode() + b"\n")
        await peer[0].drain()
        second = asyncio.create_task(client.call("child.read", {}))
        await got.get()
        peer[0].close()  # the host goes away
        with pytest.raises(errors.DelegationError) as raised:
            await asyncio.wait_for(second, 5)
        assert type(raised.value) is errors.HostClosing, repr(raised.value)
    finally:
        await client.close()
        server.close()
