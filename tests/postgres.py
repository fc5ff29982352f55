"""A real PostgreSQL server for the tests: a temporary cluster, started and stopped here.

``DELEGATION_TEST_POSTGRES_URL``, when set, names a server to use instead. Otherwise the
server binaries of Debian's ``postgresql-NN`` package (``initdb``, ``pg_ctl``, not on
PATH) make a cluster in a temporary directory, as an unprivileged user when the tests
run as root (PostgreSQL refuses to run as root), listening on a free port of 127.0.0.1
only, with trust authentication for the loopback; it is stopped at the end.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV = "DELEGATION_TEST_POSTGRES_URL"
UNPRIVILEGED = "nobody"


@dataclass
class Server:
    url: str  # postgresql+psycopg://…/postgres
    stop: Callable[[], None]


def binaries() -> Path | None:
    """The newest installed server's binary directory, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=_version)
    return Path(found[-1]).parent if found else None


def _version(path: str) -> int:
    try:
        return int(Path(path).parent.parent.name)
    except ValueError:
        return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_user() -> Callable[[], None] | None:
    """Drop to an unprivileged user in the child, when the tests run as root."""
    if os.geteuid() != 0:
        return None
    user = pwd.getpwnam(UNPRIVILEGED)

    def demote() -> None:
        os.setgid(user.pw_gid)
        os.setgroups([])
        os.setuid(user.pw_uid)

    return demote


def start(*, durable: bool = True) -> Server:
    """Start a temporary cluster (or use ``$DELEGATION_TEST_POSTGRES_URL``).

    ``durable=False`` turns ``fsync`` off: the test suite's server, where thousands of
    databases are created and dropped and no test kills the server itself (a killed
    *host* loses nothing either way). The benchmarks keep ``fsync`` on.
    """
    given = os.environ.get(ENV)
    if given:
        return Server(given, lambda: None)
    bin_dir = binaries()
    if bin_dir is None:
        raise RuntimeError("no PostgreSQL server: install Debian's postgresql-15 or set " + ENV)
    root = Path(tempfile.mkdtemp(prefix="delegation-pg-"))
    demote = _as_user()
    if demote is not None:
        user = pwd.getpwnam(UNPRIVILEGED)
        os.chown(root, user.pw_uid, user.pw_gid)
    data, port = root / "data", _free_port()
    run = {"preexec_fn": demote, "capture_output": True, "text": True, "check": True}
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": str(root)}
    try:
        subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
             "-E", "UTF8", "--no-sync"],
            env=env, **run,  # type: ignore[arg-type]
        )  # fmt: skip
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=300" + (
            "" if durable else " -c fsync=off -c full_page_writes=off"
        )
        subprocess.run(
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-o", options,
             "-w", "-t", "60", "start"],
            env=env, **run,  # type: ignore[arg-type]
        )  # fmt: skip
    except subprocess.CalledProcessError as exc:
        log = (root / "log").read_text() if (root / "log").exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"PostgreSQL did not start: {exc.stderr}{log}") from exc

    def stop() -> None:
        subprocess.run(
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            env=env, preexec_fn=demote, capture_output=True, check=False,
        )  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)

    return Server(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", stop)
