"""How long a host takes to write again once its database accepts writes again (design §19).

    python -m tests.harness.resume_times [--runs N] [--json] [--only restart|failover]

Two disruptions, each ``N`` times (5 unless told), under one host process doing work
(``tests/harness/failover_host.py``: four streaming children and a child started every 0.2 s):

* **restart**: a plain server of its own (tests/harness/postgres.py, ``fsync`` on) restarted
  with ``pg_ctl restart -m fast``;
* **failover**: a pg_auto_failover formation (tests/harness/failover.py) and ``pg_autoctl
  perform failover``; the host has the multi-host URL with
  ``target_session_attrs=read-write``.

A probe beside the host writes (an ``INSERT`` on a connection of its own, a new one
every 10 ms): *down* is when its first write was refused (on the primary of before),
*up* when a write next succeeded (on the primary of after). *Resumed* is the host's
first write answered after that (a start, or a flush of the streamers) minus *up*: it
may be a little below 0 when the host got there before the probe. Writes answered more
than 50 ms before *up* count as before the outage (the probe would have seen the
server). A host that did not write within 20 s is reported as such, and a new host is
started for the next run. Prints each run, then the medians; ``--json``: one line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tests.harness import failover, postgres
from tests.harness.failover import Formation
from tests.harness.failover_host import Host

BOUND_S = 20.0  # a host not writing again by then is reported, not waited for
PROBE_EVERY_S = 0.01
PROBE_SLACK_S = 0.05  # a host's write answered this long before the probe's is of before
STREAMERS = 4


@dataclass
class Run:
    """One disruption: seconds the probe could not write, and until the host wrote."""

    outage_s: float
    resumed_s: float | None  # None: no write within BOUND_S

    def describe(self) -> str:
        resumed = "no write" if self.resumed_s is None else f"{self.resumed_s:.3f} s"
        return f"outage {self.outage_s:.3f} s, host wrote again after {resumed}"


@dataclass
class Series:
    name: str
    runs: list[Run] = field(default_factory=list)
    failed: str = ""  # why the runs stopped short (a host that could not start)

    def summary(self) -> dict[str, Any]:
        resumed = [r.resumed_s for r in self.runs if r.resumed_s is not None]
        return {
            **({"failed": self.failed} if self.failed else {}),
            "runs": len(self.runs),
            "outage_s": _median([r.outage_s for r in self.runs]),
            "resumed_s": _median(resumed),
            "resumed_range_s": [min(resumed), max(resumed)] if resumed else None,
            "no_write": len(self.runs) - len(resumed),
        }


class Probe:
    """Writes to ``before`` until one is refused (*down*), then to ``after`` until one
    succeeds (*up*), in a thread of its own; a new connection for each try."""

    def __init__(self, before: str, after: str) -> None:
        self.before, self.after = before, after
        self.down: float | None = None
        self.up: float | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while self.down is None:
            if not _write(self.before):
                self.down = time.time()
            time.sleep(PROBE_EVERY_S)
        while not _write(self.after):
            time.sleep(PROBE_EVERY_S)
        self.up = time.time()

    def wait(self, timeout: float = 60.0) -> tuple[float, float]:
        self._thread.join(timeout)
        if self.down is None or self.up is None:
            raise RuntimeError(f"the probe saw no outage and return in {timeout} s")
        return self.down, self.up


def _write(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=1, autocommit=True) as conn:
            conn.execute("INSERT INTO probe VALUES (%s)", (time.time(),))
        return True
    except psycopg.Error:
        return False


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def measure(host: Host, disrupt: Callable[[], None], before: str, after: str) -> Run:
    """One run: ``disrupt()`` under the probe; how long the host took after *up*."""
    probe = Probe(before, after)
    disrupt()
    down, up = probe.wait()
    since = max(down, up - PROBE_SLACK_S)
    deadline = time.monotonic() + BOUND_S
    while (first := host.first_write(since)) is None and time.monotonic() < deadline:
        if host.proc.poll() is not None:
            break
        time.sleep(0.01)
    return Run(round(up - down, 3), None if first is None else round(first - up, 3))


def series(
    name: str, url: str, runs: int, disrupt: Callable[[], tuple[str, str, Callable[[], None]]]
) -> Series:
    """``runs`` runs under one host (a new one after a run it did not write again in).
    ``disrupt()`` gives the probe's two addresses and the disruption itself."""
    found = Series(name)
    try:
        host = _host(url)
    except AssertionError as exc:  # the host could not start: say why, measure nothing
        found.failed = _cause(str(exc))
        print(f"{name}: {found.failed}", file=sys.stderr)
        return found
    try:
        for n in range(runs):
            before, after, act = disrupt()
            run = measure(host, act, before, after)
            found.runs.append(run)
            print(f"{name} {n + 1}/{runs}: {run.describe()}", file=sys.stderr, flush=True)
            if run.resumed_s is None:
                _report_refusals(host)
                host.stop()
                host = _host(url)
            time.sleep(1.0)  # the host streams again before the next run
    finally:
        host.stop()
    return found


def _host(url: str) -> Host:
    host = Host(url, f"R{uuid.uuid4().hex[:6]}", STREAMERS, 1)
    try:
        host.ready()
    except AssertionError:
        host.stop()
        raise
    return host


def _cause(said: str) -> str:
    """The last line of a traceback that names an exception."""
    lines = [line.strip() for line in said.splitlines() if "Error" in line]
    return lines[-1] if lines else "the host did not start"


def _report_refusals(host: Host) -> None:
    print(f"  refused (by reason): {host.refusals()}", file=sys.stderr)
    for line in host.stderr[-5:]:
        print(f"  host: {line.rstrip()}", file=sys.stderr)


def _prepare(libpq: str, name: str) -> None:
    """A new database for the host, and one beside it for the probe (``NAME_probe``:
    the engine refuses a database holding tables of others)."""
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
        conn.execute(f'CREATE DATABASE "{name}_probe"')
    with psycopg.connect(_with_database(libpq, f"{name}_probe"), autocommit=True) as conn:
        conn.execute("CREATE TABLE probe (t float8)")


def _with_database(libpq: str, name: str) -> str:
    base, _, query = libpq.partition("?")
    return base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")


def restarts(runs: int) -> Series:
    """``pg_ctl restart -m fast`` of a plain server of our own."""
    server = postgres.start(durable=True)
    try:
        if server.restart is None:
            raise SystemExit(f"a server of its own is needed: unset {postgres.ENV}")
        restart = server.restart
        name = f"resume_{uuid.uuid4().hex[:8]}"
        libpq = server.url.replace("postgresql+psycopg://", "postgresql://", 1)
        _prepare(libpq, name)
        target = _with_database(libpq, f"{name}_probe")
        return series(
            "restart", _with_database(server.url, name), runs, lambda: (target, target, restart)
        )
    finally:
        server.stop()


def failovers(runs: int, formation: Formation | None = None) -> Series:
    """``pg_autoctl perform failover`` on a formation (a new one unless given)."""
    active = formation or failover.start()
    try:
        name = f"resume_{uuid.uuid4().hex[:8]}"
        _prepare(active.url().replace("+psycopg", "", 1), name)

        def disrupt() -> tuple[str, str, Callable[[], None]]:
            active.wait_healthy()
            old = active.primary()
            new = next(node for node in active.nodes if node is not old)
            probe = f"{name}_probe"
            return active.node_url(old, probe), active.node_url(new, probe), _failover(active)

        return series("failover", active.url(name), runs, disrupt)
    finally:
        if formation is None:
            active.stop()


def _failover(formation: Formation) -> Callable[[], None]:
    def act() -> None:
        formation.perform_failover()

    return act


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.harness.resume_times", description=__doc__
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", choices=("restart", "failover"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {}
    if args.only in (None, "restart"):
        report["restart"] = restarts(args.runs).summary()
    if args.only in (None, "failover"):
        report["failover"] = failovers(args.runs).summary()
    if args.json:
        print(json.dumps(report))
    else:
        for name, summary in report.items():
            print(f"{name}: {json.dumps(summary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
