"""``python -m tools.start_floor``: what a start costs beside the least a start
can cost (SQLite).

The engine's start (``child.start`` answered after the admission commit, as ``start_seq``
times it) beside a bare prototype of the same start on the same schema: the same nine
statements (two ``PRAGMA synchronous``, two ``BEGIN IMMEDIATE``, the authority
``SELECT``, the reservation's ``INSERT``, the admission's ``UPDATE … RETURNING``, two
``COMMIT``), one future per caller, one task per run that admits and then holds, and
nothing else: no authority or validation, no telemetry, no batching, fencing, retries
or registry. Each run times both, alternating, over the same number of sequential
starts after a warm-up, and prints the medians of the wall and CPU time per start.

``--dir /dev/shm`` (a tmpfs) takes the disk out: what is left is CPU. README's
Benchmarks section says what the two figures mean for issue 25's start target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from delegation import Engine, Request, Result
from tools.bench_base import Bench, Runner, Starter, median, starter_of

# The statements of a start, as the engine sends them (its trace), with parameters.
_SELECT = (
    "SELECT r.runner_id, r.host_instance_id, r.generation, r.connection_id, g.id, g.kind,"
    " g.runner_id, g.connection_id, g.run_id, g.conversation_id, g.tool_call_id,"
    " g.extension_id, g.lease_id, g.origin_grant_id, g.workspace, g.presets, g.generations,"
    " g.depth, g.created_at, g.expires_at, g.closed_at, g.activated_at, g.revoked_at,"
    " g.revoke_reason, g.policy, (SELECT COUNT(*) FROM children n WHERE n.grant_id = g.id),"
    " (SELECT e.id FROM children e WHERE e.grant_id = g.id AND e.request_id = ?)"
    " FROM runners r LEFT JOIN grants g ON g.run_id = ? AND g.tool_call_id = ?"
    " AND g.kind = 'tool' AND g.runner_id = r.runner_id AND g.closed_at IS NULL"
    " WHERE r.runner_id = ?"
)
_INSERT = (
    "INSERT INTO children (state, engine_instance_id, cancel_requested_at, cancel_reason,"
    " error, output, recovery_attempts, admitted_at, finished_at, origin_grant_id,"
    " trace_context, options, lease_id, followup, updated_at, conversation_id, run_id,"
    " grant_id, request_id, runner_id, runner_host_instance_id, parent_conversation_id,"
    " parent_run_id, extension_id, profile, generation, request, preset, cwd, depth,"
    " created_at) VALUES ('prepared', ?, NULL, NULL, '', '', 0, NULL, NULL, ?, NULL,"
    " x'7b7d', NULL, 0, ?, ?, ?, ?, ?, 'bench-runner', 'bench-host', 'conv-1', 'run-1',"
    " 'ext', 'bench', 1, ?, ?, ?, 1, ?) RETURNING id"
)
_UPDATE = (
    "UPDATE children SET admitted_at = ?, engine_instance_id = ?, state = 'running',"
    " updated_at = ? WHERE id = ? AND state IN ('prepared') AND cancel_requested_at IS NULL"
    " RETURNING id, conversation_id, run_id, grant_id, lease_id, request_id, runner_id,"
    " runner_host_instance_id, parent_conversation_id, parent_run_id, extension_id, profile,"
    " generation, request, preset, cwd, depth, followup, state, engine_instance_id,"
    " cancel_requested_at, cancel_reason, error, output, recovery_attempts, created_at,"
    " updated_at, admitted_at, finished_at, origin_grant_id, trace_context, options"
)
_PRESET = b'{"name":"bench","extensionId":"ext","generation":1}'
_WARM_UP = 300


async def _starter(path: Path) -> Starter:
    """An engine on a new file at ``path`` (the benchmarks' settings, children held), and
    a runner of it starting children as ``start_seq`` does."""
    runner = Runner()
    runner.hold = True
    engine: Engine = await Bench(path.parent).engine(path, runner)
    return await starter_of(engine)


async def _engine(path: Path, starts: int) -> tuple[float, float]:
    """Seconds of wall and CPU time per start of the engine (``start_seq``'s start)."""
    starter = await _starter(path)
    try:
        for i in range(_WARM_UP):
            await starter.start(f"w{i}")
        return await _timed(starts, lambda i: starter.start(f"q{i}"))
    finally:
        await starter.engine.close()


async def _timed(starts: int, start: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(starts):
        await start(i)
    return (time.perf_counter() - wall) / starts, (time.process_time() - cpu) / starts


class _Floor:
    """The bare start on a file the engine made (its runner, instance and tool call)."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        (self.grant,) = self.db.execute(
            "SELECT id FROM grants WHERE tool_call_id = 'call-0'"
        ).fetchone()
        (self.instance,) = self.db.execute("SELECT id FROM engine_instances").fetchone()
        self.cwd = tempfile.gettempdir()
        self.encode = msgspec.json.Encoder().encode
        self.runs: list[asyncio.Task[None]] = []

    def _reserve(self, request: Request) -> int:
        db, now = self.db, time.time()
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("BEGIN IMMEDIATE")
        db.execute(_SELECT, (request.request_id, "run-1", "call-0", "bench-runner")).fetchone()
        values = (
            self.instance, self.grant, now, f"c-{os.urandom(16).hex()}",
            f"r-{os.urandom(16).hex()}", self.grant, request.request_id,
            self.encode(request), _PRESET, self.cwd, now,
        )  # fmt: skip
        (child_id,) = db.execute(_INSERT, values).fetchone()
        db.execute("COMMIT")
        db.execute("PRAGMA synchronous=FULL")
        return int(child_id)

    def _admit(self, child_id: int) -> Result:
        db, now = self.db, time.time()
        db.execute("BEGIN IMMEDIATE")
        row = db.execute(_UPDATE, (now, self.instance, now, child_id)).fetchone()
        db.execute("COMMIT")
        return Result(
            runner_id=row[6], host_instance_id=row[7], conversation_id=row[1], run_id=row[2],
            parent_conversation_id=row[8], parent_run_id=row[9], extension_id=row[10],
            profile=row[11], done=False, cancelled=False, error="", output="", events=[],
        )  # fmt: skip

    async def _run(self, child_id: int, first: asyncio.Future[Result]) -> None:
        await asyncio.sleep(0)  # the run's own first step (its prepare)
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[Result] = loop.create_future()
        loop.call_soon(lambda: admitted.set_result(self._admit(child_id)))
        first.set_result(await admitted)
        await asyncio.Event().wait()  # held, as the engine's bench runner holds

    async def start(self, request_id: str) -> Result:
        loop = asyncio.get_running_loop()
        request = Request(request_id=request_id, profile="bench", message="go")
        reserved: asyncio.Future[int] = loop.create_future()
        loop.call_soon(lambda: reserved.set_result(self._reserve(request)))
        child_id = await reserved
        first: asyncio.Future[Result] = loop.create_future()
        self.runs.append(asyncio.create_task(self._run(child_id, first)))
        return await first

    async def close(self) -> None:
        for run in self.runs:
            run.cancel()
        await asyncio.gather(*self.runs, return_exceptions=True)
        self.db.close()


async def _floor(path: Path, starts: int) -> tuple[float, float]:
    """Seconds of wall and CPU time per start of the bare prototype."""
    starter = await _starter(path)
    try:  # the engine makes the file, its runner, instance and tool call
        await starter.start("w")
    finally:
        await starter.engine.close()
    floor = _Floor(path)
    try:
        for i in range(_WARM_UP):
            await floor.start(f"w{i}")
        return await _timed(starts, lambda i: floor.start(f"q{i}"))
    finally:
        await floor.close()


def measure(folder: Path, starts: int, runs: int) -> dict[str, float]:
    """Medians over ``runs`` alternating runs, microseconds per start."""
    figures: dict[str, list[float]] = {}
    for n in range(runs):
        for name, timed in (("engine", _engine), ("floor", _floor)):
            wall, cpu = asyncio.run(timed(folder / f"{name}-{n}.db", starts))
            figures.setdefault(f"{name}_wall_us", []).append(wall * 1e6)
            figures.setdefault(f"{name}_cpu_us", []).append(cpu * 1e6)
    report = {name: round(median(values), 1) for name, values in figures.items()}
    report["engine_to_floor"] = round(report["engine_wall_us"] / report["floor_wall_us"], 2)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.start_floor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--dir", type=Path, help="where the files go (e.g. /dev/shm)")
    parser.add_argument("--starts", type=int, default=3000, help="timed starts per run")
    parser.add_argument("--runs", type=int, default=5, help="alternating runs (medians)")
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        report = measure(Path(folder), args.starts, args.runs)
    if args.json:
        print(json.dumps(report))
        return
    for name, value in report.items():
        print(f"{name:16} {value:>10}")


if __name__ == "__main__":
    main()
