"""The command runner's children as the launcher confines them (design §10): no Unix socket
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
from delegation.runners import child_launcher, seccomp_filter
from delegation.runners.command import CommandRunner
from delegation.runners.containment import Containment, landlock_abi
from tests.harness import rows
from tests.harness.confinement import _ended

HERE = Path(__file__).resolve().parents[1] / "harness"
linux = pytest.mark.skipif(sys.platform != "linux", reason="Linux containment")
needs_landlock = pytest.mark.skipif(landlock_abi() < 1, reason="Landlock needed")


@pytest.fixture
def place(tmp_path: Path) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dlg-r-", dir="/tmp"))
    for name in ("db", "ws", "outside"):
        (root / name).mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _launch(
    argv: list[str], cwd: Path, tmp: Path, contained: Containment | None = None
) -> subprocess.CompletedProcess[str]:
    """``argv`` through the real launcher, confined as a command child is."""
    r, w = os.pipe()
    full = (contained or Containment()).launcher(argv, str(cwd), str(tmp), r)
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


def _run_bpf(program: bytes, nr: int, arch: int, *args: int) -> int:
    padded = [*args, *[0] * (6 - len(args))]
    data = struct.pack("=iIQ6Q", nr, arch, 0, *padded)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = struct.unpack_from("=HBBI", program, pc * 8)
        if code == 0x20:
            (acc,) = struct.unpack_from("=I", data, k)
            pc += 1
        elif code == 0x54:  # and
            acc &= k
            pc += 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"opcode {code:#x}")


ALLOW, EACCES = 0x7FFF0000, 0x00050000 | 13
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_VSOCK = 1, 2, 10, 16, 17, 40
STREAM, DGRAM, RAW, SEQPACKET = 1, 2, 3, 5
NONBLOCK_CLOEXEC = 0o4000 | 0o2000000


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_socket_filter_leaves_no_architecture_and_no_io_uring_open(machine: str) -> None:
    program = seccomp_filter.compiled(machine)
    native = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[machine]
    socket_nr = {"x86_64": 41, "aarch64": 198}[machine]
    assert _run_bpf(program, socket_nr, native, AF_UNIX, STREAM) == EACCES
    assert _run_bpf(program, socket_nr, native, AF_INET, STREAM) == ALLOW
    assert _run_bpf(program, 425, native) != ALLOW, "io_uring_setup makes sockets too"
    if machine == "x86_64":
        assert _run_bpf(program, 359, 0x40000003, AF_UNIX, STREAM) != ALLOW
        assert _run_bpf(program, 359, 0x40000003, AF_INET, STREAM, 262) != ALLOW, "i386 MPTCP"
        assert _run_bpf(program, 102, 0x40000003) != ALLOW, "i386 socketcall"
        assert _run_bpf(program, 425, 0x40000003) != ALLOW, "i386 io_uring_setup"
        assert _run_bpf(program, 0x40000000 + 41, native, AF_INET, STREAM) != ALLOW, "x32"
    else:  # arm32 compat tasks on arm64: socket is 281 there
        assert _run_bpf(program, 281, 0x40000028, 1) != ALLOW, "AUDIT_ARCH_ARM is let through"


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
@pytest.mark.parametrize(
    ("family", "kind", "protocol", "allowed"),
    [
        (AF_INET, STREAM, 0, True),
        (AF_INET, STREAM, 6, True),
        (AF_INET6, STREAM | NONBLOCK_CLOEXEC, 0, True),
        (AF_INET, DGRAM, 0, True),
        (AF_INET6, DGRAM, 17, True),
        (AF_INET, STREAM, 262, False),  # MPTCP: Landlock's TCP rules do not see it
        (AF_INET6, STREAM, 262, False),
        (AF_INET, STREAM, 132, False),  # SCTP
        (AF_INET, SEQPACKET, 132, False),
        (AF_INET, DGRAM, 1, False),  # ICMP (ping sockets)
        (AF_INET, DGRAM, 136, False),  # UDP-Lite
        (AF_INET, RAW, 6, False),
        (AF_UNIX, STREAM, 0, False),
        (AF_NETLINK, DGRAM, 0, False),
        (AF_PACKET, RAW, 0, False),
        (AF_VSOCK, STREAM, 0, False),
        (AF_INET | (1 << 32), STREAM, 0, True),  # the high half of an int is not read
    ],
)
def test_the_socket_filter_allows_tcp_and_udp_only(
    machine: str, family: int, kind: int, protocol: int, allowed: bool
) -> None:
    program = seccomp_filter.compiled(machine)
    native = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[machine]
    socket_nr = {"x86_64": 41, "aarch64": 198}[machine]
    verdict = _run_bpf(program, socket_nr, native, family, kind, protocol)
    assert verdict == (ALLOW if allowed else EACCES)


EPERM = 0x00050000 | 1


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_no_setuid_bit_and_no_other_parent_death_signal(machine: str) -> None:
    """The review of issue 35: through the idmapped workspace a root host's child set
    mode 6755 on a copy of python, root's on disk, and any local user became root with
    it; and a program that cleared its parent-death signal outlived its killed host."""
    program = seccomp_filter.compiled(machine)
    native = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[machine]
    fchmod, fchmodat, prctl = {"x86_64": (91, 268, 157), "aarch64": (52, 53, 167)}[machine]
    calls = [(fchmod, 1), (fchmodat, 2), (452, 2)] + ([(90, 1)] if machine == "x86_64" else [])
    for nr, at in calls:
        for mode, verdict in ((0o755, ALLOW), (0o4755, EPERM), (0o2755, EPERM), (0o6777, EPERM)):
            args = [0, 0, 0]
            args[at] = mode
            assert _run_bpf(program, nr, native, *args) == verdict, (nr, oct(mode))
    assert _run_bpf(program, prctl, native, 1, 9) == ALLOW, "PR_SET_PDEATHSIG, SIGKILL"
    assert _run_bpf(program, prctl, native, 1, 0) == EPERM, "cleared"
    assert _run_bpf(program, prctl, native, 1, 15) == EPERM, "a signal it may catch"
    assert _run_bpf(program, prctl, native, 38, 1) == ALLOW, "PR_SET_NO_NEW_PRIVS and others"
    if machine == "x86_64":  # i386: chmod 15, fchmodat 306, prctl 172
        assert _run_bpf(program, 15, 0x40000003, 0, 0o4755) == EPERM
        assert _run_bpf(program, 306, 0x40000003, 0, 0, 0o2755) == EPERM
        assert _run_bpf(program, 172, 0x40000003, 1, 0) == EPERM


@linux
def test_a_child_sets_no_setuid_bit_and_keeps_its_parent_death_signal(place: Path) -> None:
    """The same, with the real launcher: modes without those bits still work."""
    tmp = place / "tmp"
    tmp.mkdir()
    (place / "ws" / "f").write_text("x")
    code = (
        "import ctypes, os\n"
        "os.chmod('f', 0o700)\n"
        "for mode in (0o4755, 0o2755):\n"
        "    try:\n"
        "        os.chmod('f', mode); print('set', oct(mode))\n"
        "    except OSError as e: print('refused', e.errno)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('prctl', libc.prctl(1, 0, 0, 0, 0), ctypes.get_errno())\n"
    )
    done = _launch([sys.executable, "-c", code], place / "ws", tmp)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["refused 1", "refused 1", "prctl -1 1"], done.stdout
    assert oct((place / "ws" / "f").stat().st_mode & 0o7777) == "0o700"


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_listen_and_socket_pairs_as_the_filter_says(machine: str) -> None:
    native = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[machine]
    pair, listen = {"x86_64": (53, 50), "aarch64": (199, 201)}[machine]
    closed, opened = seccomp_filter.compiled(machine), seccomp_filter.compiled(machine, listen=True)
    assert _run_bpf(closed, listen, native, 3, 16) == EACCES
    assert _run_bpf(opened, listen, native, 3, 16) == ALLOW
    assert _run_bpf(closed, pair, native, AF_UNIX, STREAM) == ALLOW
    assert _run_bpf(closed, pair, native, AF_INET, STREAM) == EACCES


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


# --- no channel between children, no user namespace (SPEC §31) ---------------------------

# add_key, request_key, keyctl, unshare, clone per architecture; clone3 is 435 on each.
_CHANNELS = {
    "x86_64": (0xC000003E, (248, 249, 250), 272, 56),
    "aarch64": (0xC00000B7, (217, 218, 219), 97, 220),
    "i386": (0x40000003, (286, 287, 288), 310, 120),
}
ENOSYS = 0x00050000 | 38
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_filter_closes_keyrings_user_namespaces_and_clone3(machine: str) -> None:
    """The fifth attack: a key a child of parent A stored was read by a later child of
    parent B (every child of a root host runs as one user), and unshare(CLONE_NEWUSER)
    succeeded inside a child."""
    program = seccomp_filter.compiled(machine)
    archs = [machine] + (["i386"] if machine == "x86_64" else [])
    for arch in archs:
        audit, keyrings, unshare, clone = _CHANNELS[arch]
        for nr in keyrings:
            assert _run_bpf(program, nr, audit, 0, 0) == EPERM, (arch, nr)
        for nr in (unshare, clone):
            assert _run_bpf(program, nr, audit, CLONE_NEWUSER) == EPERM, (arch, nr)
            assert _run_bpf(program, nr, audit, CLONE_NEWUSER | CLONE_NEWNET) == EPERM
        assert _run_bpf(program, clone, audit, SIGCHLD) == ALLOW, "fork as glibc makes it"
        assert _run_bpf(program, unshare, audit, CLONE_NEWNET) == ALLOW, "the kernel's to judge"
        assert _run_bpf(program, 435, audit, 0) == ENOSYS, "clone3: flags behind a pointer"


CHANNELS = """
import ctypes, os, platform, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
keyctl = {"x86_64": 250, "aarch64": 219}[platform.machine()]
add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
def errno(result):
    return "ok" if result >= 0 else os.strerror(ctypes.get_errno())
print("keyctl", errno(libc.syscall(keyctl, 0, -4, 1)))  # KEYCTL_GET_KEYRING_ID, user keyring
print("add_key", errno(libc.syscall(add_key, b"user", b"note", b"secret", 6, -4)))
print("unshare", errno(libc.unshare(0x10000000 | 0x40000000)))
seen = []
thread = threading.Thread(target=lambda: seen.append(1)); thread.start(); thread.join()
print("thread", "ok" if seen else "none")
print("spawn", subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True,
      text=True).stdout.strip())
pid = os.fork()
if pid == 0:
    os._exit(3)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@linux
def test_a_child_gets_no_keyring_and_no_user_namespace_yet_forks_and_threads(
    place: Path,
) -> None:
    """The same through the real launcher: the C library's clone3 falls back to clone,
    so threads, fork and subprocess still work."""
    if not seccomp_filter.available():
        pytest.skip("no filter for this architecture")
    tmp = place / "tmp"
    tmp.mkdir()
    done = _launch([sys.executable, "-c", CHANNELS], place / "ws", tmp)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:7] == [
        "keyctl Operation not permitted",
        "add_key Operation not permitted",
        "unshare Operation not permitted",
        "thread ok",
        "spawn 7",
        "fork 3",
        "",
    ], done.stdout


SYSV = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
key, make = int(sys.argv[1]), sys.argv[2] == "make"
shm = libc.shmget(key, 4096, (0o1000 | 0o600) if make else 0)  # IPC_CREAT
print("made" if make and shm >= 0 else "found" if shm >= 0 else os.strerror(ctypes.get_errno()))
"""


@linux
def test_no_system_v_segment_of_one_child_is_anothers(place: Path) -> None:
    """Each child has an IPC namespace of its own: a System V segment (a channel, and
    memory that outlives its maker) one child left is not there for the next."""
    if Containment().namespaces is None:
        pytest.skip("namespaces are not allowed here")
    tmp = place / "tmp"
    tmp.mkdir()
    key = str(0x5EED0000 + os.getpid() % 0xFFFF)
    made = _launch([sys.executable, "-c", SYSV, key, "make"], place / "ws", tmp)
    found = _launch([sys.executable, "-c", SYSV, key, "find"], place / "ws", tmp)
    assert made.stdout.strip() == "made", made.stderr
    assert found.stdout.strip() == "No such file or directory", found.stdout
    assert not _host_segment(int(key)), "the segment outlived its child on the host"


def _host_segment(key: int) -> bool:
    """Whether the host's IPC namespace has a System V segment of ``key``."""
    with open("/proc/sysvipc/shm") as table:
        next(table)
        return any(int(line.split()[0]) == key for line in table if line.strip())


# shmget, semget, msgget, mq_open per architecture (and i386's ipc multiplexer).
_SYSV = {
    "x86_64": (29, 64, 68, 240),
    "aarch64": (194, 190, 186, 180),
    "i386": (395, 393, 399, 277, 117),
}


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_without_namespaces_the_filter_refuses_system_v_and_message_queues(machine: str) -> None:
    """The review of SPEC §31: the IPC namespace is made only where namespaces are
    allowed; elsewhere System V objects and POSIX queues would be every child's."""
    shared, own = seccomp_filter.compiled(machine, ipc=False), seccomp_filter.compiled(machine)
    for arch in [machine] + (["i386"] if machine == "x86_64" else []):
        audit = _CHANNELS[arch][0]
        for nr in _SYSV[arch]:
            assert _run_bpf(shared, nr, audit, 0x5EED, 4096) == EPERM, (arch, nr)
            assert _run_bpf(own, nr, audit, 0x5EED, 4096) == ALLOW, (arch, nr)


@linux
def test_without_namespaces_a_child_makes_no_system_v_segment(place: Path) -> None:
    if not seccomp_filter.available():
        pytest.skip("no filter for this architecture")
    tmp = place / "tmp"
    tmp.mkdir()
    contained = Containment()
    contained.namespaces = None  # as on a host that allows none
    key = str(0x5EED0000 + (os.getpid() + 1) % 0xFFFF)
    made = _launch([sys.executable, "-c", SYSV, key, "make"], place / "ws", tmp, contained)
    assert made.stdout.strip() == "Operation not permitted", made.stdout + made.stderr
    assert not _host_segment(int(key)), "a segment outlives its child on the host"
