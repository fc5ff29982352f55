"""A real PgBouncer in front of the test session's PostgreSQL server (design §25).

Debian's ``pgbouncer`` (``/usr/sbin/pgbouncer``), started here on a free port of
127.0.0.1 with ``trust`` authentication for ``postgres``, every database routed to the
test server, as an unprivileged user when the tests run as root (PgBouncer refuses to
run as root). The tests skip without it, unless ``DELEGATION_REQUIRE_PGBOUNCER=1``
(CI's ``.ci/run`` installs it and sets that): then its absence fails them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import make_url

from tests.harness.postgres import _as_user, _free_port, _owner

REQUIRE = "DELEGATION_REQUIRE_PGBOUNCER"
BINARY = "/usr/sbin/pgbouncer"


def binary() -> str:
    found = shutil.which("pgbouncer") or (BINARY if os.path.exists(BINARY) else None)
    if found is None:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail("pgbouncer is not installed (apt-get install pgbouncer)")
        pytest.skip("pgbouncer is not installed")
    return found


@contextlib.contextmanager
def bouncer(server_url: str, pool_mode: str) -> Iterator[int]:
    """PgBouncer in ``pool_mode`` before the server of ``server_url``; its port."""
    server = make_url(server_url)
    root = Path(tempfile.mkdtemp(prefix="delegation-pgbouncer-"))
    port = _free_port()
    (root / "users.txt").write_text('"postgres" ""\n')
    (root / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={server.host} port={server.port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {root / 'users.txt'}\n"
        f"pool_mode = {pool_mode}\nmax_client_conn = 500\ndefault_pool_size = 100\n"
        f"logfile = {root / 'log'}\npidfile = {root / 'pid'}\n"
    )
    os.chown(root, *_owner())
    for name in ("users.txt", "pgbouncer.ini"):
        os.chown(root / name, *_owner())
    proc = subprocess.Popen(
        [binary(), str(root / "pgbouncer.ini")],
        preexec_fn=_as_user(),
        stdout=subprocess.DEVNULL,
        # Its log goes to its logfile too: a pipe nobody reads would fill and stop it
        # (it writes every connection to stderr, and blocks there once 64 KiB wait).
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (root / "log").read_text() if (root / "log").exists() else ""
                raise RuntimeError(f"pgbouncer did not start: {log}")
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def through(url: str, port: int) -> str:
    """``url`` (a database of the test server) reached through the bouncer at ``port``."""
    return make_url(url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
