"""``python -m delegation.soak --seconds N [--json] [--seed S] [--url URL] [--hosts N]``: a
soak test of the engine with real crashes, and every invariant checked on the database.

This process (the driver, :mod:`tools.soak.driver`) starts a host process
(:mod:`tools.soak.host`) on a fresh database: an :class:`~delegation.Engine` under a
random workload of several runners with many children (start, read, steer, cancel,
release, tool end, parent finish, reconnect). It lets the host run a random while, then
closes it gracefully (SIGTERM) or kills it (SIGKILL), checks the database
(:mod:`tools.soak.check`) and starts the next host on it, which resumes the leased
children, until the time is up. A last host comes back as a new host instance for every
runner (so every lease is revoked), waits until every child has ended and closes; the
database is checked once more, with nothing left unfinished. Prints a summary, or with
``--json`` one line of JSON; exits non-zero when a violation was found.

The database is a temporary SQLite file, or with ``--url`` a new database on that
PostgreSQL server (:mod:`tools.soak.server`), dropped at the end. There ``--hosts N``
runs N hosts at once and kills, closes and pauses them at random
(:mod:`tools.soak.fleet`); ``--db-restarts`` ends every session of the database now and
then, and ``--db-restart-command CMD`` restarts the server itself by running ``CMD``
(:mod:`tools.soak.faults`).

Each violation's details (what was acknowledged when, what the database held, what the
soak's own record says left it) go to a JSON-lines file beside the report (``--details``;
its path is in the report). ``--busy N`` starves the machine with N busy loops while it
runs (four on two cores is issue 36's starved soak), and ``--runs N`` soaks N times, each
on a new database with the next seed, and reports each and their total.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from delegation.cli.progress import Progress
from tools.soak.driver import Driver
from tools.soak.host import HEARTBEAT_S, HOST_TIMEOUT_S, HostOptions


def summary(report: dict[str, Any]) -> str:
    lines = [
        f"soak: {report['elapsed_s']} s, seed {report['seed']}, {report['hosts']} host(s) on"
        f" {report['store']}: {report['ops']} calls, {report['restarts']} restarts"
        f" ({report['kills']} kill -9, {report['graceful']} graceful), {report['pauses']}"
        f" pauses, {report['takeovers']} takeovers, {report['checks']} checks",
        f"children: {report.get('children', 0)} {report.get('children_by_state', {})},"
        f" events: {report.get('events', 0)}, resumed: {report.get('resumed', 0)},"
        f" purged: {report.get('purged', 0)}",
        f"acknowledged: {report['acked']}",
        f"latency: p50 {report['p50_ms']} ms, p99 {report['p99_ms']} ms,"
        f" max {report['max_ms']} ms; host rss {report['rss_mb']} MB",
        f"calls: {report['calls']}",
        f"refusals: {report['errors_by_reason']}",
        *_faults(report),
        f"violations: {report['violations']}"
        + (f" (details: {report['details']})" if report.get("details") else ""),
    ]
    lines += [f"  {what}" for what in report["violation_samples"]]
    return "\n".join(lines)


def _faults(report: dict[str, Any]) -> list[str]:
    """The database faults' line of the summary, if any was asked for."""
    said = []
    if "db_restarts" in report:
        said.append(f"{report['db_restarts']} times every session ended")
    if "db_server_restarts" in report:
        said.append(
            f"{report['db_server_restarts']} server restarts (the longest"
            f" {report['db_server_restart_max_s']} s, {report['db_server_restart_failures']}"
            " failed)"
        )
    return [f"database: {', '.join(said)}"] if said else []


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through Driver.run, which kills its host


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m delegation.soak", description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to soak")
    parser.add_argument("--json", action="store_true", help="one line, one JSON object")
    parser.add_argument("--seed", type=int, help="the random seed (default: a fresh one)")
    parser.add_argument("--keep", type=Path, help="keep the database and journals here")
    parser.add_argument(
        "--url",
        help="soak on a new database of this PostgreSQL server (postgresql+psycopg://…;"
        " the role needs CREATEDB), dropped at the end, instead of a SQLite file",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="host processes at once, killed, closed and paused at random (more than"
        " one needs --url)",
    )
    parser.add_argument(
        "--db-restarts",
        action="store_true",
        help="end every session of the database now and then, as a server restart does"
        " (needs --url, and a role that may: superuser or pg_signal_backend)",
    )
    parser.add_argument(
        "--db-restart-command",
        metavar="CMD",
        help="restart the database server itself every two to four seconds by running CMD"
        " through the shell (e.g. pg_ctl -D DIR -m fast -w restart, as the data"
        " directory's owner); it must return once the server is up (needs --url)",
    )
    parser.add_argument(
        "--details",
        type=Path,
        help="where each violation's details go, one JSON line each (default: the --keep"
        " folder's violations.jsonl, else soak-violations-SEED.jsonl here)",
    )
    parser.add_argument(
        "--busy", type=int, default=0, help="busy loops that starve the machine meanwhile"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="soak this many times, each with the next seed"
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=HEARTBEAT_S,
        help=f"the hosts' host_heartbeat_s (default {HEARTBEAT_S})",
    )
    parser.add_argument(
        "--host-timeout",
        type=float,
        default=HOST_TIMEOUT_S,
        help=f"the hosts' host_timeout_s (default {HOST_TIMEOUT_S})",
    )
    host = parser.add_argument_group("host process (internal)")
    host.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    host.add_argument("--workspace", help=argparse.SUPPRESS)
    host.add_argument("--journal", help=argparse.SUPPRESS)
    host.add_argument("--epoch", type=int, default=0, help=argparse.SUPPRESS)
    host.add_argument("--instances", default="{}", help=argparse.SUPPRESS)
    host.add_argument("--final", action="store_true", help=argparse.SUPPRESS)
    host.add_argument("--shared", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    if args.host:
        return _host(args, seed)
    if args.hosts < 1:
        parser.error("--hosts must be at least 1")
    if args.host_timeout <= 2 * args.heartbeat or args.heartbeat <= 0:
        parser.error("--host-timeout must be more than two heartbeats (--heartbeat)")
    if args.hosts > 1 and args.url is None:
        parser.error(
            f"--hosts {args.hosts} needs --url: several hosts share one PostgreSQL database"
            " (a SQLite file has one host at a time)"
        )
    if args.db_restarts and args.url is None:
        parser.error("--db-restarts needs --url: only a server's sessions can be ended")
    if args.db_restart_command is not None and args.url is None:
        parser.error("--db-restart-command needs --url: a SQLite file has no server")
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be at least 1, and --busy at least 0")
    signal.signal(signal.SIGTERM, _terminate)
    found = 0
    with _busy(args.busy):
        for run in range(args.runs):
            report = _soak(args, seed + run)
            print(json.dumps(report, separators=(",", ":")) if args.json else summary(report))
            found += report["violations"]
    if args.runs > 1 and not args.json:
        print(f"{args.runs} runs, {found} violations in all")
    return 1 if found else 0


@contextlib.contextmanager
def _busy(loops: int) -> Iterator[None]:
    """``loops`` processes that spin until the soak ends: a starved machine."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
    try:
        yield
    finally:
        for proc in spinning:
            proc.kill()
            proc.wait()


def _soak(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from tools.soak.faults import DatabaseFaults, ServerRestarts
    from tools.soak.fleet import FleetDriver
    from tools.soak.server import SoakDatabase

    with contextlib.ExitStack() as stack:
        folder = args.keep / f"seed-{seed}" if args.keep and args.runs > 1 else args.keep
        if folder is None:
            made = tempfile.TemporaryDirectory(prefix="delegation-soak-")
            folder = Path(stack.enter_context(made))
        folder.mkdir(parents=True, exist_ok=True)
        url = None
        if args.url is not None:
            url = stack.enter_context(SoakDatabase(args.url, keep=args.keep is not None))
        driver = FleetDriver if args.hosts > 1 else Driver
        progress = stack.enter_context(Progress("soak", args.seconds, unit=" s", quiet=args.json))
        details = args.details or (
            folder / "violations.jsonl" if args.keep else Path(f"soak-violations-{seed}.jsonl")
        )
        soak = driver(
            folder,
            args.seconds,
            seed,
            url=url,
            hosts=args.hosts,
            heartbeat_s=args.heartbeat,
            timeout_s=args.host_timeout,
            progress=progress,
            details=details.resolve(),
        )
        command = args.db_restart_command
        faults = DatabaseFaults(url, seed) if args.db_restarts and url is not None else None
        restarts = ServerRestarts(command, seed) if command and url is not None else None
        with contextlib.ExitStack() as faulty:  # stopped before the database is dropped
            for fault in (faults, restarts):
                if fault is not None:
                    faulty.enter_context(fault)
            report = soak.run()
        if faults is not None:
            report.update(db_restarts=faults.count, db_sessions_ended=faults.ended)
        if restarts is not None:
            report.update(restarts.report())
        return report
    raise AssertionError("unreachable")


def _host(args: argparse.Namespace, seed: int) -> int:
    from tools.soak import host as soak_host

    opts = HostOptions(
        os.environ[soak_host.DB_ENV],
        args.workspace,
        args.journal,
        seed,
        args.epoch,
        json.loads(args.instances),
        args.final,
        args.heartbeat,
        args.host_timeout,
        args.shared,
    )
    return soak_host.main(opts)
