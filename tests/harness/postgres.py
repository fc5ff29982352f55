"""A real PostgreSQL server for the tests: a temporary cluster, started and stopped here.

``DELEGATION_TEST_POSTGRES_URL``, when set, names a server to use instead. Otherwise the
server binaries of Debian's ``postgresql-NN`` package (``initdb``, ``pg_ctl``, not on
PATH) make a cluster in a temporary directory, as an unprivileged user when the tests
run as root (PostgreSQL refuses to run as root), listening on a free port of 127.0.0.1
only, with trust authentication for the loopback (or, given a password, a server that
asks for it on TCP); it is stopped at the end.
"""

from __future__ import annotations

import glob
import os
import pwd
import shlex
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
    # pg_ctl on this cluster ("stop", "-m", "fast"; "start"), None for a given server.
    ctl: Callable[..., None] | None = None
    # pg_ctl restart -m fast, waited for; None for a server named by the environment
    restart: Callable[[], None] | None = None
    # A shell command line that restarts the cluster as its owner, the server away for
    # at least the seconds given (a soak's --db-restart-command); None for a given server.
    restart_command: Callable[[float], str] | None = None


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


def _authentication(root: Path, password: str | None) -> list[str]:
    """initdb's options: trust everywhere, or the password asked for on TCP."""
    if password is None:
        return ["--auth=trust"]
    secret = root / "password"
    secret.write_text(password + "\n")
    os.chown(secret, *_owner())
    return ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={secret}"]


def _owner() -> tuple[int, int]:
    """Who the cluster's files belong to: the unprivileged user when run as root."""
    if os.geteuid() != 0:
        return os.geteuid(), os.getegid()
    user = pwd.getpwnam(UNPRIVILEGED)
    return user.pw_uid, user.pw_gid


def start(*, durable: bool = True, password: str | None = None) -> Server:
    """Start a temporary cluster (or use ``$DELEGATION_TEST_POSTGRES_URL``).

    ``durable=False`` turns ``fsync`` off: the test suite's server, where thousands of
    databases are created and dropped and no test kills the server itself (a killed
    *host* loses nothing either way). The benchmarks keep ``fsync`` on.

    ``password``: always a cluster of its own, whose superuser ``postgres`` has this
    password and must give it on TCP (``scram-sha-256``); the URL names no password.
    """
    given = os.environ.get(ENV)
    if given and password is None:
        return Server(given, lambda: None)
    bin_dir = binaries()
    if bin_dir is None:
        raise RuntimeError("no PostgreSQL server: install Debian's postgresql-15 or set " + ENV)
    root = Path(tempfile.mkdtemp(prefix="delegation-pg-"))
    demote = _as_user()
    os.chown(root, *_owner())
    data, port = root / "data", _free_port()
    run = {"preexec_fn": demote, "capture_output": True, "text": True, "check": True}
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": str(root)}
    try:
        subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
             *_authentication(root, password), "-E", "UTF8", "--no-sync"],
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

    started_args = ["-l", str(root / "log"), "-o", options, "-w", "-t", "60"]

    def ctl(*args: str) -> None:
        started = started_args if "start" in args else []
        subprocess.run(
            [str(bin_dir / "pg_ctl"), "-D", str(data), *started, *args],
            env=env, **run,  # type: ignore[arg-type]
        )  # fmt: skip

    def restart() -> None:
        subprocess.run(
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-m", "fast",
             "-w", "-t", "60", "restart"],
            env=env, **run,  # type: ignore[arg-type]
        )  # fmt: skip

    def restart_command(down_s: float) -> str:
        pg_ctl = [str(bin_dir / "pg_ctl"), "-D", str(data)]
        stop_, start_ = [*pg_ctl, "-m", "fast", "-w", "stop"], [*pg_ctl, *started_args, "start"]
        script = f"{shlex.join(stop_)} && sleep {down_s:g} && {shlex.join(start_)}"
        owner = ["runuser", "-u", UNPRIVILEGED, "--"] if demote is not None else []
        return shlex.join([*owner, "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                           "sh", "-c", script])  # fmt: skip

    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    return Server(url, stop, ctl, restart, restart_command)
