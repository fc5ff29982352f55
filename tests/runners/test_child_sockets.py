"""A command child creates only TCP and UDP sockets and Unix socket pairs, and listens
only where allowed (design §23), tried with real children as issue 35 found them:

- MPTCP (protocol 262) walked around Landlock's TCP rules: a child connected to the
  test's PostgreSQL and to any local port, where plain TCP was refused;
- ``listen()`` without ``bind()`` autobound a port Landlock's bind rule never saw, and an
  outside client connected to the child;
- netlink, vsock, packet, raw and SCTP sockets opened.

As root (CI runs as root) through the engine, and as an ordinary user (uid 65534)
through the launcher itself where this machine allows.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from delegation.runners import child_launcher, seccomp_filter
from delegation.runners.command import CommandRunner
from delegation.runners.containment import landlock_abi
from tests.harness.command_children import ended, first_text, hosted, script

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="Linux containment"),
    pytest.mark.skipif(not seccomp_filter.available(), reason="no socket filter here"),
]
needs_net_rules = pytest.mark.skipif(landlock_abi() < 4, reason="Landlock ABI 4 needed")

# What the child tries: (name, family, type, protocol, connect to the port given).
TRIES = """
    import json, socket, sys
    listener, database = int(sys.argv[1]), int(sys.argv[2])
    MPTCP, SCTP, ICMP = 262, 132, 1
    tries = {
        "tcp": (socket.AF_INET, socket.SOCK_STREAM, 0, listener),
        "tcp_to_postgres": (socket.AF_INET, socket.SOCK_STREAM, 6, database),
        "mptcp": (socket.AF_INET, socket.SOCK_STREAM, MPTCP, listener),
        "mptcp_to_postgres": (socket.AF_INET, socket.SOCK_STREAM, MPTCP, database),
        "mptcp6": (socket.AF_INET6, socket.SOCK_STREAM, MPTCP, None),
        "sctp": (socket.AF_INET, socket.SOCK_STREAM, SCTP, listener),
        "sctp_seqpacket": (socket.AF_INET, socket.SOCK_SEQPACKET, SCTP, None),
        "icmp": (socket.AF_INET, socket.SOCK_DGRAM, ICMP, None),
        "raw": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP, None),
        "packet": (17, socket.SOCK_RAW, 0, None),
        "netlink": (16, socket.SOCK_RAW, 0, None),
        "vsock": (40, socket.SOCK_STREAM, 0, None),
        "unix": (socket.AF_UNIX, socket.SOCK_STREAM, 0, None),
        "udp": (socket.AF_INET, socket.SOCK_DGRAM, 0, None),
        "udp6": (socket.AF_INET6, socket.SOCK_DGRAM, 17, None),
    }
    report = {}
    for name, (family, kind, protocol, port) in tries.items():
        try:
            s = socket.socket(family, kind, protocol)
        except OSError as exc:
            report[name] = f"denied ({exc.errno})" if exc.errno == 13 else f"failed ({exc.errno})"
            continue
        try:
            if port is not None:
                s.settimeout(5)
                s.connect(("127.0.0.1", port))
                report[name] = "connected"
            else:
                report[name] = "created"
        except OSError as exc:
            report[name] = f"denied ({exc.errno})" if exc.errno == 13 else f"failed ({exc.errno})"
        finally:
            s.close()
    try:
        a, b = socket.socketpair()
        report["socketpair"] = "created"
    except OSError as exc:
        report["socketpair"] = f"denied ({exc.errno})"
    try:
        s = socket.socket()
        s.listen()  # no bind: the kernel picks a port
        report["listen"] = "listening"
    except OSError as exc:
        report["listen"] = f"denied ({exc.errno})"
    print(json.dumps({"kind": "result", "text": json.dumps(report)}), flush=True)
"""

EXPECTED = {
    "tcp": "denied (13)",  # Landlock: not a net_connect port
    "tcp_to_postgres": "denied (13)",
    "mptcp": "denied (13)",  # the filter: MPTCP is not TCP to Landlock
    "mptcp_to_postgres": "denied (13)",
    "mptcp6": "denied (13)",
    "sctp": "denied (13)",
    "sctp_seqpacket": "denied (13)",
    "icmp": "denied (13)",
    "raw": "denied (13)",
    "packet": "denied (13)",
    "netlink": "denied (13)",
    "vsock": "denied (13)",
    "unix": "denied (13)",  # a pathname socket's connect is nothing Landlock bounds
    "udp": "created",
    "udp6": "created",
    "socketpair": "created",
    "listen": "denied (13)",  # unless the TOML says listen = true
}


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def _ports(listener: socket.socket, postgres_url: str) -> list[str]:
    database = urlsplit(postgres_url).port
    assert database is not None
    return [str(listener.getsockname()[1]), str(database)]


@needs_net_rules
async def test_a_child_creates_only_tcp_and_udp_sockets(
    tmp_path: Path, listener: socket.socket, postgres_url: str
) -> None:
    """Each family and protocol tried against a listener the test opens and against the
    test's PostgreSQL: only TCP (which Landlock bounds) and UDP sockets, and Unix socket
    pairs, can be had; MPTCP, SCTP, raw, packet, netlink, vsock and Unix are refused."""
    runner = CommandRunner({"worker": script(TRIES, *_ports(listener, postgres_url))})
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        assert await ended(h, started.conversation_id) == ""
        record = await h.engine.get_child(started.conversation_id)
    assert record is not None
    assert json.loads(record.output) == EXPECTED


LISTEN = """
    import json, socket
    server = socket.socket()
    server.listen()  # no bind: the kernel picks a port, on every address
    port = server.getsockname()[1]
    print(json.dumps({"kind": "text", "text": str(port)}), flush=True)
    server.settimeout(20)
    peer, _ = server.accept()
    peer.sendall(b"from the child")
    peer.close()
"""


async def test_listen_is_the_tomls_to_allow(tmp_path: Path) -> None:
    """With ``listen = true`` an outside client reaches what the child listens on (the
    port the kernel picked: Landlock still refuses every bind); without it, see above."""
    toml = tmp_path / "runner.toml"
    argv = script(LISTEN)
    toml.write_text(
        f"[command]\nlisten = true\n[command.profiles.worker]\nargv = {json.dumps(argv)}\n"
    )
    runner = CommandRunner.from_file(toml)
    assert runner.containment.listen is True
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        port = int(await first_text(h, started.conversation_id))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await reader.read() == b"from the child"
        writer.close()
        assert await ended(h, started.conversation_id) == ""


@pytest.mark.parametrize("value", ["yes", 1, []])
def test_listen_is_true_or_false(value: object) -> None:
    with pytest.raises(ValueError, match="listen must be true or false"):
        CommandRunner({"worker": ["true"]}, listen=value)  # type: ignore[arg-type]


@needs_net_rules
@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_an_ordinary_users_child_creates_only_tcp_and_udp_sockets(
    listener: socket.socket, postgres_url: str
) -> None:
    """The launcher as uid 65534 (what an ordinary user's host runs), with the host's
    filter and network rules: the same refusals as a root host's child."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for another user")
    place = Path(tempfile.mkdtemp(prefix="dlg-nobody-", dir="/tmp"))
    try:
        os.chmod(place, 0o777)
        launcher = place / "child_launcher.py"
        shutil.copy(child_launcher.__file__, launcher)
        go_read, go_write = os.pipe()
        os.write(go_write, b"1")
        os.close(go_write)
        spec = {
            "parent": os.getpid(),
            "cwd": str(place),
            "read_write": [str(place)],
            "read_only": ["/usr", "/lib", "/lib64", "/etc", "/proc", "/bin", "/dev"],
            "net_connect": [],
            "seccomp": seccomp_filter.compiled().hex(),
            "go_fd": go_read,
        }
        source = script(TRIES, *_ports(listener, postgres_url))[2]
        try:
            run = subprocess.run(
                [python, "-I", "-S", str(launcher), json.dumps(spec), python, "-c",
                 source.replace("{{", "{").replace("}}", "}"), *_ports(listener, postgres_url)],
                user=65534, group=65534, extra_groups=[], pass_fds=(go_read,),
                capture_output=True, text=True, timeout=60, check=False, cwd="/",
            )  # fmt: skip
        finally:
            os.close(go_read)
        assert run.returncode == 0, run.stderr
        report = json.loads(json.loads(run.stdout)["text"])
        assert report == EXPECTED
    finally:
        shutil.rmtree(place, ignore_errors=True)
