"""``delegation containment``: what a command child gets on this machine, as one child
sees it (design §17).

It starts a real child through the same launcher and confinement a command runner
uses (with a runner TOML's settings, if given) in a scratch workspace, and the child
reports what it could and could not do: its user, its view of processes, its
capabilities, the file system (``/etc/shadow`` too), the network, the sockets it may
create, the host's environment, the kernel's keyring and a new user namespace; the host
adds the child's limits. Nothing is assumed from the kernel's version: every line is
something a child just tried.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from delegation import os_processes as processes
from delegation.runners.containment import Containment, refusal
from delegation.runners.limits import ChildLimits

# Run by the child with -I: the standard library only. Each attempt is "allowed",
# "denied (errno)" or what it saw.
_PROBE = r"""
import ctypes, json, os, platform, socket, sys
host, outside, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])

def attempt(fn):
    try:
        return fn()
    except OSError as exc:
        return f"denied ({exc.errno} {os.strerror(exc.errno)})"

def status(name):
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return "?"

def write(path):
    with open(path, "w") as f:
        f.write("x")
    return "allowed"

def connect(family, address):
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(address)
    return "allowed"

def bind():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
    return "allowed"

def make(family, kind, protocol=0):
    socket.socket(family, kind, protocol).close()
    return "allowed"

def listen():
    with socket.socket() as s:
        s.listen()
    return "allowed"

def read(path):
    with open(path, "rb") as f:
        f.read(1)
    return "allowed"

libc = ctypes.CDLL(None, use_errno=True)
KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())

def syscall(result):
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return "allowed"

pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print(json.dumps({
    "uid": os.getuid(),
    "pid": os.getpid(),
    "processes_visible": len(pids),
    "host_visible": os.path.exists(f"/proc/{host}"),
    "capabilities": status("CapEff"),
    "bounding_set": status("CapBnd"),
    "no_new_privs": status("NoNewPrivs"),
    "seccomp": status("Seccomp"),
    "write_workspace": attempt(lambda: write("probe.txt")),
    "write_outside": attempt(lambda: write(os.path.join(outside, "probe.txt"))),
    "read_outside": attempt(lambda: str(len(os.listdir(outside))) and "allowed"),
    "host_environ": attempt(lambda: open(f"/proc/{host}/environ", "rb").read() and "allowed"),
    "tcp_connect_other_port": attempt(lambda: connect(socket.AF_INET, ("127.0.0.1", port))),
    "tcp_bind": attempt(bind),
    "listen": attempt(listen),
    "unix_socket": attempt(lambda: connect(socket.AF_UNIX, "/nonexistent") or "allowed"),
    "mptcp_socket": attempt(lambda: make(socket.AF_INET, socket.SOCK_STREAM, 262)),
    "netlink_socket": attempt(lambda: make(16, socket.SOCK_RAW)),
    "udp_socket": attempt(lambda: make(socket.AF_INET, socket.SOCK_DGRAM)),
    "read_etc_shadow": attempt(lambda: read("/etc/shadow")),
    "keyring": attempt(lambda: syscall(libc.syscall(KEYCTL, 0, -4, 1))) if KEYCTL else "?",
    # The last: where it is allowed, the probe is in a user namespace of its own after it.
    "user_namespace": attempt(lambda: syscall(libc.unshare(0x10000000))),
}))
"""


def observe(containment: Containment) -> dict[str, Any]:
    """Start one probe child under ``containment`` and return what it reported, with
    the host's side of the settings (``landlock``, ``namespaces``, ``net_connect``)."""
    processes.make_undumpable()  # as a host is before its first command child
    scratch = Path(tempfile.mkdtemp(prefix="delegation-check-"))
    scratch.chmod(0o755)  # one anyone may enter: what stops the child there is Landlock
    workspace, outside = scratch / "workspace", scratch / "outside"
    workspace.mkdir()
    outside.mkdir()
    listener = socket.create_server(("127.0.0.1", 0))  # a port the child is not given
    go_read, go_write = os.pipe()
    bounds = containment.bounds()
    try:
        os.write(go_write, b"1")
        os.close(go_write)
        port = str(listener.getsockname()[1])
        program = [sys.executable, "-I", "-c", _PROBE, str(os.getpid()), str(outside), port]
        argv = containment.launcher(program, str(workspace), str(workspace), go_read, bounds=bounds)
        done = subprocess.run(
            argv, pass_fds=(go_read,), capture_output=True, text=True, timeout=60, check=False,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd="/",
        )  # fmt: skip
    finally:
        os.close(go_read)
        listener.close()
        shutil.rmtree(scratch, ignore_errors=True)
        _gone(bounds)
    host = {
        "landlock_abi": containment.landlock,
        "namespaces": containment.namespaces,
        "net_connect": list(containment.net_connect),
        "socket_filter": containment.socket_filter,
        "host_uid": os.geteuid(),
        "limits": "cgroups" if containment.cgroups is not None else "rlimits",
        "max_processes": containment.max_processes,
        "max_memory": containment.max_memory,
    }
    if done.returncode != 0:
        why = refusal(done.returncode, done.stderr) or done.stderr.strip()[-500:]
        return {**host, "error": why or f"the probe exited with {done.returncode}"}
    report: dict[str, Any] = json.loads(done.stdout)
    return {**host, **report}


# What each line means, in the order a reader checks them; (key, label).
_LINES = (
    ("host_uid", "host uid"),
    ("landlock_abi", "Landlock ABI (0: none)"),
    ("namespaces", "namespaces (root, user, or none)"),
    ("uid", "child's uid"),
    ("pid", "child's pid (1: first of its own namespace)"),
    ("processes_visible", "processes it sees"),
    ("host_visible", "host visible in its /proc"),
    ("capabilities", "effective capabilities"),
    ("bounding_set", "capability bounding set"),
    ("no_new_privs", "no_new_privs"),
    ("seccomp", "seccomp (2: filter on)"),
    ("write_workspace", "write in its workspace"),
    ("write_outside", "write outside it"),
    ("read_outside", "read outside it"),
    ("host_environ", "read the host's environ"),
    ("net_connect", "TCP ports it may connect to"),
    ("tcp_connect_other_port", "TCP connect to another port"),
    ("tcp_bind", "TCP bind"),
    ("listen", "listen"),
    ("udp_socket", "UDP socket"),
    ("unix_socket", "Unix socket"),
    ("mptcp_socket", "MPTCP socket"),
    ("netlink_socket", "netlink socket"),
    ("read_etc_shadow", "read /etc/shadow"),
    ("keyring", "its user's kernel keyring"),
    ("user_namespace", "a new user namespace"),
    ("limits", "limits (cgroups or rlimits)"),
    ("max_processes", "max processes"),
    ("max_memory", "max memory, bytes"),
    ("spawn_to_first_line", "spawn to first line, median ms"),
    ("error", "the probe child failed"),
)


def _gone(bounds: ChildLimits) -> None:
    """Remove the probe's control groups once its processes have left them."""
    for _ in range(50):
        if bounds.remove():
            return
        time.sleep(0.02)


def render(report: dict[str, Any]) -> str:
    """The report for people: one line per thing tried."""
    width = max(len(label) for _, label in _LINES)
    lines = []
    for key, label in _LINES:
        if key in report:
            value = report[key]
            shown = (
                "none"
                if value is None
                else value
                if isinstance(value, str | int)
                else json.dumps(value)
            )
            lines.append(f"{label:<{width}}  {shown}")
    return "\n".join(lines)


def spawn_cost(containment: Containment, n: int) -> dict[str, float]:
    """Median milliseconds from spawn to the first line of ``/bin/echo``: bare (no
    launcher), through the launcher without namespaces, and with them (where allowed).
    The engine's own part of a start (recording the pid) is not in these figures."""
    scratch = tempfile.mkdtemp(prefix="delegation-check-")
    ways: dict[str, Containment | None] = {"bare": None}
    ways["launcher_no_namespace"] = dataclasses.replace(containment, namespaces=None)
    if containment.namespaces:
        ways["launcher_namespace"] = containment
    try:
        return {
            f"{name}_ms": round(statistics.median(_spawns(way, scratch, n)), 2)
            for name, way in ways.items()
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _spawns(containment: Containment | None, workspace: str, n: int) -> list[float]:
    took = []
    for _ in range(n):
        go_read, go_write = os.pipe()
        argv = ["/bin/echo", "first line"]
        if containment is not None:
            argv = containment.launcher(argv, workspace, workspace, go_read)
        began = time.perf_counter()
        with subprocess.Popen(
            argv, stdout=subprocess.PIPE, pass_fds=(go_read,), cwd="/", env={}
        ) as child:
            os.close(go_read)
            if containment is not None:
                os.write(go_write, b"1")  # as the host does once the pid is recorded
            os.close(go_write)
            assert child.stdout is not None
            child.stdout.readline()
            took.append((time.perf_counter() - began) * 1000)
    return took
