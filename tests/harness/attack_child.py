"""A command child that tries every escape of issue 13 and reports what it got.

    python attack_child.py DB_PATH SOCKET_PATH OUTSIDE_DIR HOST_PID

It prints one ``result`` event whose text is a JSON object: for each attempt,
``"denied"`` or what it obtained. It never raises: a report is the point.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

SECRETS = ("sk-openai-test", "sk-ant-test", "aws-secret-test", "ghp_test")


def attempt(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except OSError as exc:
        return f"denied ({exc.errno})"


def read_environ(host: int) -> str:
    with open(f"/proc/{host}/environ", "rb") as environ:
        data = environ.read()
    leaked = [s for s in SECRETS if s.encode() in data]
    return f"leaked {leaked}" if leaked else "read, no secret"


def read_mem(host: int) -> str:
    with open(f"/proc/{host}/mem", "rb") as mem:
        mem.seek(0x400000)
        mem.read(16)
    return "read"


def read_db(path: str) -> str:
    with open(path, "rb") as db:
        return "read" if db.read(16).startswith(b"SQLite format 3") else "opened"


def register(path: str) -> str:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    frame = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "runner.register",
        "params": {"runnerId": "runner-1", "hostInstanceId": "evil"},
    }
    sock.sendall(json.dumps(frame).encode() + b"\n")
    return "connected: " + sock.recv(4096).decode(errors="replace")[:200]


def read_locked(path: str) -> str:
    with open(path, "rb") as locked:
        return "read: " + locked.read().decode()


def trace(host: int) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(16, host, None, None) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), "ptrace")
    libc.ptrace(17, host, None, None)  # PTRACE_DETACH
    return "attached"


def write(path: str) -> str:
    with open(path, "w") as f:
        f.write("x")
    return "written"


def main() -> None:
    db, sock, outside, host = *sys.argv[1:4], int(sys.argv[4])
    report = {
        "environ": attempt(lambda: read_environ(host)),
        "mem": attempt(lambda: read_mem(host)),
        "ptrace": attempt(lambda: trace(host)),
        "mode_000": attempt(lambda: read_locked("locked.txt")),
        "db": attempt(lambda: read_db(db)),
        "db_dir": attempt(lambda: str(len(os.listdir(os.path.dirname(db))))),
        "socket": attempt(lambda: register(sock)),
        "write_outside": attempt(lambda: write(os.path.join(outside, "escaped.txt"))),
        "write_cwd": attempt(lambda: write("inside.txt")),
        "write_tmp": attempt(lambda: write(os.path.join(os.environ["TMPDIR"], "t.txt"))),
        "signal_host": attempt(lambda: os.kill(host, 0) or "signalled"),
    }
    print(json.dumps({"kind": "result", "text": json.dumps(report)}), flush=True)


if __name__ == "__main__":
    main()
