"""A pg_auto_failover formation for the failover tests (design §19): a monitor and two
PostgreSQL nodes, primary and secondary, on 127.0.0.1 only, in a temporary directory.

``pg_autoctl`` (Debian's ``postgresql-15-auto-failover``) runs each of them, as the
unprivileged user of tests/harness/postgres.py when the tests run as root, each under its own
``tests/harness/reaper.py`` so that every process of a node is found and ended, whatever was
killed. The clusters are made by ``initdb`` here first (trust for the loopback, sockets
in the temporary directory, small shared buffers, ``fsync`` left on: a failover test is
a durability test); ``pg_autoctl create`` takes them over (the secondary is a
``pg_basebackup`` of the primary). The monitor's health checks are made fast (a node is
unhealthy 2 s after it stopped answering; the monitor waits 3 s for a dead primary to
demote itself before promoting its standby).

The tests skip without ``pg_autoctl``, unless ``DELEGATION_REQUIRE_FAILOVER=1`` (CI's
``.ci/run`` sets it after installing the package): then its absence is a failure.
``DELEGATION_FAILOVER_TARGET`` changes the ``target_session_attrs`` of ``url`` (design
§19's ``read-write`` unless set; ``primary`` reaches the same node by another test,
for an engine whose sessions are still read-only ones).

    formation = start()
    formation.url("db")      # postgresql+psycopg://postgres@/db?host=…,…&port=…,…&target_session_attrs=read-write
    formation.uri()          # what ``pg_autoctl show uri`` prints: postgres://h1:p1,h2:p2/postgres?…
    formation.perform_failover()
    formation.kill_primary() # SIGKILL to every process of the primary's node
    formation.revive(node)   # ``pg_autoctl run`` again: it rejoins as a secondary
    formation.stop()
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.harness import postgres

REQUIRE = "DELEGATION_REQUIRE_FAILOVER"
TARGET = os.environ.get("DELEGATION_FAILOVER_TARGET", "read-write")
ROOT = Path(__file__).resolve().parents[2]
MONITOR_DB = "pg_auto_failover"
# The monitor's health checks, fast (the defaults take about 30 s to fail a dead primary
# over): a node is unhealthy 2 s after its last answer; a primary that does not report
# its demotion is given up on after 3 s (it is dead: the tests kill, never cut off).
MONITOR_SETTINGS = {
    "pgautofailover.health_check_period": "1000",
    "pgautofailover.health_check_timeout": "1000",
    "pgautofailover.health_check_max_retries": "1",
    "pgautofailover.health_check_retry_delay": "500",
    "pgautofailover.node_considered_unhealthy_timeout": "2000",
    "pgautofailover.primary_demote_timeout": "3000",
    "pgautofailover.startup_grace_period": "2000",
}
# Appended to each cluster's postgresql.conf, after pg_autoctl's include: its tuning
# would give each server a quarter of the machine's memory. Checkpoints are not spread
# out (the secondary's pg_basebackup waits for one: 7 s of a 16 s start, spread).
CLUSTER_SETTINGS = "shared_buffers = 32MB\ncheckpoint_completion_target = 0\n"
WRITABLE = ("primary", "wait_primary", "single")


def executable() -> Path | None:
    """``pg_autoctl``, if installed (Debian puts it on PATH, others beside pg_ctl)."""
    found = shutil.which("pg_autoctl", path="/usr/bin:/usr/local/bin")
    if found:
        return Path(found)
    bin_dir = postgres.binaries()
    candidate = bin_dir / "pg_autoctl" if bin_dir else None
    return candidate if candidate and candidate.exists() else None


def require_failover() -> Path:
    """``pg_autoctl``; skip the test without it (fail under ``DELEGATION_REQUIRE_FAILOVER=1``)."""
    found = executable()
    if found is not None and postgres.binaries() is not None:
        return found
    why = "no pg_autoctl here (Debian's postgresql-15-auto-failover)"
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{why}, and {REQUIRE}=1 requires it")
    pytest.skip(f"{why}: apt-get install postgresql-15-auto-failover")


@dataclass
class Node:
    """A monitor or a node: its port, its data directory, the reaper it runs under."""

    name: str
    port: int
    pgdata: Path
    log: Path
    reaper: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.reaper is not None and self.reaper.poll() is None


@dataclass
class Formation:
    """A running formation (see the module); ``timings``: seconds each step took."""

    root: Path
    pg_autoctl: Path
    bin_dir: Path
    monitor: Node
    nodes: list[Node]
    timings: dict[str, float] = field(default_factory=dict)

    # --- addresses ------------------------------------------------------------------

    def url(self, database: str = "postgres", attrs: str = TARGET) -> str:
        """The engine's URL for ``database``: both nodes, the writable one chosen
        (``attrs``: libpq's ``target_session_attrs``)."""
        ports = ",".join(str(node.port) for node in self.nodes)
        hosts = ",".join("127.0.0.1" for _ in self.nodes)
        query = f"host={hosts}&port={ports}&target_session_attrs={attrs}"
        return f"postgresql+psycopg://postgres@/{database}?{query}"

    def node_url(self, node: Node, database: str = "postgres") -> str:
        """One node only, as libpq takes it (for probes that must not follow a failover)."""
        return f"postgresql://postgres@127.0.0.1:{node.port}/{database}"

    def uri(self) -> str:
        """The formation's URI as ``pg_autoctl show uri`` prints it (``postgres://h1:p1,h2:p2/…``)."""
        shown = self._ctl("show", "uri", "--formation", "default", "--pgdata", self.monitor.pgdata)
        return shown.stdout.strip()

    def create_database(self, name: str) -> None:
        """A new database on the primary (the secondary gets it by replication)."""
        with psycopg.connect(_libpq(self.url()), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    # --- state ------------------------------------------------------------------------

    def state(self) -> list[dict[str, Any]]:
        """``pg_autoctl show state --json``: each node's reported and assigned state."""
        shown = self._ctl("show", "state", "--json", "--pgdata", self.monitor.pgdata)
        return list(json.loads(shown.stdout or "[]"))

    def node(self, port: int) -> Node:
        return next(node for node in self.nodes if node.port == port)

    def primary(self) -> Node:
        """The node the monitor has as the writable one (raises when none is)."""
        for row in self.state():
            if row["current_group_state"] in WRITABLE and row["assigned_group_state"] in WRITABLE:
                return self.node(int(row["nodeport"]))
        raise RuntimeError(f"no primary: {self.describe()}")

    def healthy(self) -> bool:
        states = sorted((r["current_group_state"], r["assigned_group_state"]) for r in self.state())
        return states == [("primary", "primary"), ("secondary", "secondary")]

    def describe(self) -> str:
        rows = self.state()
        return ", ".join(
            f"{r['nodename']}:{r['nodeport']} {r['current_group_state']}"
            f"->{r['assigned_group_state']}"
            for r in rows
        )

    def wait_healthy(self, timeout: float = 60.0) -> float:
        """Wait until one node is primary and the other secondary; seconds waited."""
        return _wait(self.healthy, timeout, lambda: f"formation not healthy: {self.describe()}")

    # --- failures ---------------------------------------------------------------------

    def perform_failover(self, timeout: float = 60.0) -> Node:
        """``pg_autoctl perform failover``, waited for: the secondary is promoted, the
        old primary demoted; the new primary."""
        old = self.primary()
        self._ctl("perform", "failover", "--pgdata", self.monitor.pgdata, "--wait", "60",
                  timeout=timeout + 10)  # fmt: skip
        return self.wait_promoted(old, timeout)

    def kill_primary(self) -> Node:
        """SIGKILL to every process of the primary's node (its pg_autoctl and its
        postmaster, and so every backend): the machine died. The monitor fails over to
        the secondary (``wait_promoted``); the killed node, to ``revive``."""
        node = self.primary()
        _kill_tree(node)
        return node

    def wait_promoted(self, old: Node, timeout: float = 60.0) -> Node:
        """Wait until the monitor has a writable node other than ``old``; that node."""
        _wait(lambda: _quietly(self.primary) not in (None, old), timeout, self.describe)
        return self.primary()

    def revive(self, node: Node, timeout: float = 60.0) -> None:
        """Run a killed node again and wait until it is the secondary (it rejoins with
        ``pg_rewind`` if need be); call it once another node was promoted."""
        if not node.running:
            self._run(node, "run", "--pgdata", str(node.pgdata))
        _wait(lambda: self.healthy() and self.primary() is not node, timeout, self.describe)

    def stop(self) -> None:
        """End every process (bounded) and remove the temporary directory."""
        for node in [*self.nodes, self.monitor]:
            self._end(node)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- plumbing ---------------------------------------------------------------------

    def _env(self, pghost: Path) -> dict[str, str]:
        return _env(self.root, self.bin_dir, pghost)

    def _ctl(self, *args: str | Path, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.pg_autoctl), *map(str, args)], env=self._env(self.root / "sockets"),
            preexec_fn=postgres._as_user(), capture_output=True, text=True, check=True,
            timeout=timeout, cwd=self.root,
        )  # fmt: skip

    def _run(self, node: Node, *args: str) -> None:
        """``pg_autoctl ARGS`` in the background under a reaper of its own (see the module)."""
        with node.log.open("ab") as log:
            node.reaper = subprocess.Popen(
                [sys.executable, "-m", "tests.harness.reaper", str(self.pg_autoctl), *args],
                env=self._env(self.root / "sockets"), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, cwd=ROOT,
            )  # fmt: skip

    def _end(self, node: Node) -> None:
        """Stop a node for good: its pg_autoctl first (it would start Postgres again),
        then Postgres with an immediate shutdown (which leaves no shared memory behind),
        then whatever is left, SIGKILLed."""
        if node.reaper is None:
            return
        for pid in _descendants(node.reaper.pid):
            if _comm(pid) == "pg_autoctl":
                _signal(pid, signal.SIGKILL)
        if (node.pgdata / "postmaster.pid").exists():
            subprocess.run(
                [str(self.bin_dir / "pg_ctl"), "-D", str(node.pgdata), "-m", "immediate",
                 "-t", "10", "-w", "stop"],
                env=self._env(self.root / "sockets"), preexec_fn=postgres._as_user(),
                capture_output=True, check=False, timeout=20,
            )  # fmt: skip
        _kill_tree(node)


# --- starting ---------------------------------------------------------------------------


def start() -> Formation:
    """A monitor and two nodes, running and healthy (see the module)."""
    pg_autoctl, bin_dir = require_failover(), postgres.binaries()
    assert bin_dir is not None
    root = Path(tempfile.mkdtemp(prefix="delegation-failover-"))
    os.chown(root, *postgres._owner())
    for sub in ("sockets", "config", "share", "run", "tmp"):
        (root / sub).mkdir(mode=0o700)
        os.chown(root / sub, *postgres._owner())
    monitor = _node(root, "monitor")
    nodes = [_node(root, "node1"), _node(root, "node2")]
    formation = Formation(root, pg_autoctl, bin_dir, monitor, nodes)
    try:
        _start_all(formation)
    except BaseException:
        _print_logs(formation)
        formation.stop()
        raise
    return formation


def _start_all(formation: Formation) -> None:
    began = time.monotonic()
    _start_monitor(formation)
    formation.timings["monitor_s"] = round(time.monotonic() - began, 2)
    first = time.monotonic()
    _start_node(formation, formation.nodes[0], initdb=True)
    _wait(
        lambda: any(r["current_group_state"] == "single" for r in _quietly(formation.state) or []),
        60, lambda: f"node1 not single: {_quietly(formation.describe)}",
    )  # fmt: skip
    formation.timings["primary_s"] = round(time.monotonic() - first, 2)
    second = time.monotonic()
    _start_node(formation, formation.nodes[1], initdb=False)
    formation.wait_healthy(90)
    formation.timings["secondary_s"] = round(time.monotonic() - second, 2)
    formation.timings["total_s"] = round(time.monotonic() - began, 2)


def _node(root: Path, name: str) -> Node:
    return Node(name, postgres._free_port(), root / name, root / f"{name}.log")


def _start_monitor(formation: Formation) -> None:
    monitor = formation.monitor
    _initdb(formation, monitor)
    formation._run(
        monitor, "create", "monitor", "--pgdata", str(monitor.pgdata),
        "--pgport", str(monitor.port), "--pgctl", str(formation.bin_dir / "pg_ctl"),
        "--hostname", "127.0.0.1", "--listen", "127.0.0.1", "--auth", "trust", "--no-ssl",
        "--run",
    )  # fmt: skip
    _wait(lambda: _monitor_ready(monitor), 60, lambda: f"monitor not ready:\n{_tail(monitor)}")
    with psycopg.connect(_monitor_dsn(monitor), autocommit=True) as conn:
        for name, value in MONITOR_SETTINGS.items():
            conn.execute(f"ALTER SYSTEM SET {name} = {value}")
        conn.execute("SELECT pg_reload_conf()")


def _monitor_ready(monitor: Node) -> bool:
    try:
        with psycopg.connect(_monitor_dsn(monitor), connect_timeout=2) as conn:
            found = conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'pgautofailover'")
            return found.fetchone() is not None
    except psycopg.Error:
        return False


def _monitor_dsn(monitor: Node) -> str:
    return f"postgresql://postgres@127.0.0.1:{monitor.port}/{MONITOR_DB}"


def _start_node(formation: Formation, node: Node, *, initdb: bool) -> None:
    """``pg_autoctl create postgres --run`` (an empty data directory: a secondary)."""
    if initdb:
        _initdb(formation, node)
    monitor = f"postgres://autoctl_node@127.0.0.1:{formation.monitor.port}/{MONITOR_DB}"
    formation._run(
        node, "create", "postgres", "--pgdata", str(node.pgdata), "--pgport", str(node.port),
        "--pgctl", str(formation.bin_dir / "pg_ctl"), "--pghost", str(formation.root / "sockets"),
        "--hostname", "127.0.0.1", "--listen", "127.0.0.1", "--name", node.name,
        "--username", "postgres", "--dbname", "postgres", "--auth", "trust", "--no-ssl",
        "--monitor", f"{monitor}?sslmode=disable", "--run",
    )  # fmt: skip


def _initdb(formation: Formation, node: Node) -> None:
    """A cluster as tests/harness/postgres.py makes one, with sockets in the formation's
    directory."""
    subprocess.run(
        [str(formation.bin_dir / "initdb"), "-D", str(node.pgdata), "-U", "postgres",
         "--auth=trust", "-E", "UTF8", "--no-sync"],
        env=formation._env(formation.root / "sockets"), preexec_fn=postgres._as_user(),
        capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    sockets = formation.root / "sockets"
    with (node.pgdata / "postgresql.conf").open("a") as conf:
        conf.write(f"unix_socket_directories = '{sockets}'\n{CLUSTER_SETTINGS}")


def _env(root: Path, bin_dir: Path, pghost: Path) -> dict[str, str]:
    """Everything pg_autoctl keeps (configuration, state, pid files) under ``root``."""
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": str(root),
        "XDG_CONFIG_HOME": str(root / "config"), "XDG_DATA_HOME": str(root / "share"),
        "XDG_RUNTIME_DIR": str(root / "run"), "TMPDIR": str(root / "tmp"),
        "PGUSER": "postgres", "PGHOST": str(pghost),
    }  # fmt: skip


# --- processes ----------------------------------------------------------------------------


def _descendants(root: int) -> list[int]:
    """Every process under ``root`` (its reaper keeps them all under it)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = _parent(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _kill_tree(node: Node) -> None:
    """SIGSTOP every process of the node (so none starts another), then SIGKILL them
    all; the reaper exits once it has reaped the last."""
    reaper = node.reaper
    if reaper is None:
        return
    stopped: set[int] = set()
    while fresh := set(_descendants(reaper.pid)) - stopped:
        for pid in fresh:
            _signal(pid, signal.SIGSTOP)
        stopped |= fresh
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    try:
        reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait(timeout=10)
    node.reaper = None


# --- waiting ------------------------------------------------------------------------------


def _wait(done: Callable[[], bool], timeout: float, what: Callable[[], object]) -> float:
    """Poll ``done`` every 0.1 s up to ``timeout`` s; seconds waited (raises after)."""
    began = time.monotonic()
    while not done():
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"after {timeout} s: {what()}")
        time.sleep(0.1)
    return time.monotonic() - began


def _quietly(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None while the monitor cannot say (restarting, or no primary yet)."""
    try:
        return fn()
    except (RuntimeError, subprocess.SubprocessError, ValueError):
        return None


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _tail(node: Node, lines: int = 30) -> str:
    if not node.log.exists():
        return ""
    return "\n".join(node.log.read_text(errors="replace").splitlines()[-lines:])


def _print_logs(formation: Formation) -> None:
    for node in [formation.monitor, *formation.nodes]:
        print(f"--- {node.name} ---\n{_tail(node)}", file=sys.stderr)


@contextlib.contextmanager
def running() -> Iterator[Formation]:
    """A formation for the block (see ``start``), stopped after it."""
    formation = start()
    try:
        yield formation
    finally:
        formation.stop()


if __name__ == "__main__":  # python -m tests.harness.failover: start one, say how long it took
    with running() as started:
        print(json.dumps({"timings": started.timings, "uri": started.uri(), "url": started.url()}))
