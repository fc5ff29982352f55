"""``python -m delegation.bench``: the engine beside raw ``sqlite3``, in the same run.

Every scenario runs on temporary files with the engine's production durability
(WAL, ``synchronous=FULL``), and its raw baseline does the same durable work with the
stdlib ``sqlite3`` module under the same journal mode and ``synchronous``. Caps that
would stop a long benchmark (children per grant) are raised; nothing that affects
durability is changed. Prints a table, or with ``--json`` one line of JSON.

``--url postgresql+psycopg://USER@HOST/DB`` runs every scenario on that PostgreSQL
server instead, beside raw psycopg 3 on the same server: each scenario on a new
database it creates and drops (the role needs ``CREATEDB``; nothing is written to
``DB`` itself). See :mod:`tools.bench_postgres`. With ``--hosts`` besides: 1, 2
and 3 host processes on one database, and the takeover of a killed one
(:mod:`tools.bench_hosts`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from delegation import Engine, Event, Params, Result
from delegation.cli.progress import Progress
from delegation.run.context import ChildContext, Run
from delegation.store import stores
from tools import bench_admission, bench_rewind, bench_waiting
from tools.bench_base import Bench, Runner, machine, median, rss_mb, starter_of


@dataclass(frozen=True)
class Sizes:
    starts: int
    callers: int
    events_children: int
    events_each: int
    events_single: int
    page_events: int
    recover: int
    expire: int
    rss_small: int
    rss_large: int
    steps: int
    waiting_small: int
    waiting_large: int
    answers: int
    queued: int
    rewind_steps: int


FULL = Sizes(
    2000,
    50,
    100,
    200,
    20000,
    1_000_000,
    10_000,
    5_000,
    1_000,
    100_000,
    2000,
    1_000,
    100_000,
    500,
    10_000,
    1_000,
)
QUICK = Sizes(
    200, 50, 20, 50, 2000, 20_000, 500, 500, 100, 1_000, 200, 100, 1_000, 50, 1_000, 1_000
)


def ratio(engine: float, baseline: float) -> dict[str, float]:
    return {
        "engine": round(engine, 1),
        "raw": round(baseline, 1),
        "ratio": round(engine / baseline, 3),
    }


# --- scenarios ----------------------------------------------------------------------------


async def start_seq(bench: Bench, sizes: Sizes) -> dict[str, float]:
    runner = Runner()
    runner.hold = True
    engine = await bench.engine(bench.new(), runner)
    starter = await starter_of(engine)
    started = time.perf_counter()
    for i in range(sizes.starts):
        await starter.start(f"q{i}")
    rate = sizes.starts / (time.perf_counter() - started)
    await engine.close()
    return ratio(rate, bench.raw_commits(sizes.starts))


async def start_concurrent(bench: Bench, sizes: Sizes) -> dict[str, float]:
    runner = Runner()
    runner.hold = True
    engine = await bench.engine(bench.new(), runner)
    starter = await starter_of(engine)
    each = max(1, sizes.starts // sizes.callers)

    async def caller(c: int) -> None:
        for i in range(each):
            await starter.start(f"q{c}-{i}")

    started = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in range(sizes.callers)))
    rate = each * sizes.callers / (time.perf_counter() - started)
    await engine.close()
    return ratio(rate, bench.raw_commits(sizes.starts))


async def _events(bench: Bench, children: int, each: int) -> float:
    runner = Runner()
    runner.hold = True
    engine = await bench.engine(bench.new(), runner)
    contexts: list[ChildContext] = []
    original = runner.prepare

    async def capture(*args: Any) -> Run:
        inner = await original(*args)

        async def run(ctx: ChildContext) -> None:
            contexts.append(ctx)
            await inner(ctx)

        return run

    runner.prepare = capture  # type: ignore[method-assign,assignment]
    starter = await starter_of(engine)
    for i in range(children):
        await starter.start(f"q{i}")

    async def emitter(ctx: ChildContext) -> None:
        for n in range(each):
            ctx.emit(Event(kind="text", text=f"event {n}"))
            if n % 100 == 99:
                await ctx.flush()
        await ctx.flush()

    started = time.perf_counter()
    await asyncio.gather(*(emitter(ctx) for ctx in contexts))
    rate = children * each / (time.perf_counter() - started)
    await engine.close()
    return rate


async def events_100(bench: Bench, sizes: Sizes) -> dict[str, float]:
    rate = await _events(bench, sizes.events_children, sizes.events_each)
    total = sizes.events_children * sizes.events_each
    return ratio(rate, bench.raw_batches(total, sizes.events_children))


async def events_1(bench: Bench, sizes: Sizes) -> dict[str, float]:
    rate = await _events(bench, 1, sizes.events_single)
    return ratio(rate, bench.raw_batches(sizes.events_single, 1))


async def steps_seq(bench: Bench, sizes: Sizes) -> dict[str, float]:
    """One child recording small steps one after another (design §15): each
    ``await ctx.step(f"s{i}", fn)`` commits its result before it returns, so every step
    is one durable commit, beside raw single-row commits."""
    timed: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def small(i: int) -> dict[str, int]:
        return {"turn": i}

    class Stepper(Runner):
        async def prepare(self, *args: Any) -> Run:
            async def run(ctx: ChildContext) -> None:
                await ctx.admit()
                started = time.perf_counter()
                try:
                    for i in range(sizes.steps):
                        await ctx.step(f"s{i}", small, i)
                except BaseException as exc:  # the scenario fails, rather than waits
                    timed.set_exception(exc)
                    raise
                timed.set_result(time.perf_counter() - started)

            return run

    engine = await bench.engine(bench.new(), Stepper())
    await (await starter_of(engine)).start("q-steps")
    rate = sizes.steps / await timed
    await engine.close()
    return ratio(rate, bench.raw_commits(sizes.steps))


async def rewind_copy(bench: Bench, sizes: Sizes) -> dict[str, float]:
    """A rewind of a run of many steps, every step copied (design §35): steps copied
    per second, beside raw single-row commits (:mod:`tools.bench_rewind`)."""
    rate = await bench_rewind.rewind_copy(bench, sizes.rewind_steps)
    return ratio(rate, bench.raw_commits(sizes.rewind_steps))


async def read_page(bench: Bench, sizes: Sizes) -> dict[str, float]:
    runner = Runner()
    runner.hold = True
    path = bench.new()
    engine = await bench.engine(path, runner)
    starter = await starter_of(engine)
    started = await starter.start("q-read")
    child = await engine.get_child(started.conversation_id)
    assert child is not None
    body = b'{"sequence":0,"kind":"text","text":"a page of events to read back"}'
    bench.fill_events(path, child.id, sizes.page_events, body)
    cursor = sizes.page_events // 2
    read = Params(run_id="run-1", tool_call_id="call-0", extension_id="ext", generation=1,
                  child_id=started.conversation_id, after=cursor)  # fmt: skip
    # Engine and raw reads alternate on the same file in the same state (a large WAL
    # not yet checkpointed reads slower than a checkpointed file).
    baseline = bench.page_reader(path)
    timings, raw_timings = [], []
    for _ in range(300):
        t = time.perf_counter()
        result = await engine.call(starter.conn, "child.read", read)
        timings.append(time.perf_counter() - t)
        assert isinstance(result, Result)
        assert len(result.events) == 128
        t = time.perf_counter()
        rows = baseline.read(child.id, cursor)
        raw_timings.append(time.perf_counter() - t)
        assert len(rows) == 128
    baseline.close()
    await engine.close()
    engine_ms, raw_ms = median(timings) * 1000, median(raw_timings) * 1000
    return {"engine_ms": round(engine_ms, 3), "raw_ms": round(raw_ms, 3),
            "ratio": round(engine_ms / raw_ms, 2)}  # fmt: skip


async def _leased(bench: Bench, path: Path | str, n: int, **config: Any) -> Engine:
    """An engine holding ``n`` admitted, running children, each under its own lease."""
    runner = Runner()
    runner.hold = True
    engine = await bench.engine(path, runner, **config)
    starter = await starter_of(engine)
    for base in range(0, n, 500):
        await asyncio.gather(
            *(starter.start(f"q{i}", lease=f"L{i}") for i in range(base, min(n, base + 500)))
        )
    return engine


async def recover(bench: Bench, sizes: Sizes) -> float:
    path = bench.new()
    engine = await _leased(bench, path, sizes.recover)
    await engine.close()
    runner = Runner()
    runner.hold = True
    started = time.perf_counter()
    engine = await bench.engine(path, runner)
    while len(await engine.list_children(state="running", limit=sizes.recover)) < sizes.recover:
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - started
    await engine.close()
    return round(elapsed, 3)


async def expire(bench: Bench, sizes: Sizes) -> float:
    path = bench.new()
    engine = await _leased(bench, path, sizes.expire, lease_lifetime_s=3600.0)
    engine.timers.arm(None)
    engine.clock = _Shifted(engine.clock, 3601.0)
    started = time.perf_counter()
    await engine.expire_due()
    while await engine.list_children(state="running", limit=1):
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    await engine.close()
    return round(elapsed, 3)


class _Shifted:
    """A clock some seconds ahead: the shared deadline has passed."""

    def __init__(self, clock: Any, ahead: float) -> None:
        self._clock = clock
        self._ahead = ahead

    def now(self) -> float:
        return float(self._clock.now()) + self._ahead


async def rss_growth(bench: Bench, sizes: Sizes) -> float:
    runner = Runner()
    engine = await bench.engine(bench.new(), runner)
    starter = await starter_of(engine)

    async def finish(start: int, stop: int) -> None:
        for base in range(start, stop, 500):
            await asyncio.gather(
                *(starter.start(f"q{i}") for i in range(base, min(stop, base + 500)))
            )
        await engine._db.barrier()

    await finish(0, sizes.rss_small)
    gc.collect()
    small = rss_mb()
    await finish(sizes.rss_small, sizes.rss_large)
    gc.collect()
    grown = rss_mb() - small
    await engine.close()
    return round(grown, 1)


_FOLLOWER = """
import json, os, sys, time
from delegation.usecases.inspector import Inspector
with Inspector(os.environ["DELEGATION_BENCH_URL"]) as inspector:
    print("ready", flush=True)
    for event in inspector.follow(sys.argv[1]):
        print(json.dumps([event.sequence, time.time()]), flush=True)
"""


async def follow_latency(bench: Bench, sizes: Sizes) -> dict[str, dict[str, float]]:
    """From an event's commit (its flush returning) to its arrival at a ``follow``
    consumer: ``Engine.follow`` in the host's process, and ``Inspector.follow`` (what
    ``delegation events --follow`` uses) in another process. Milliseconds."""
    count = max(50, sizes.events_single // 100)
    committed: dict[int, float] = {}
    gate = asyncio.Event()

    class Paced(Runner):
        async def prepare(self, *args: Any) -> Run:
            async def run(ctx: ChildContext) -> None:
                await ctx.admit()
                await gate.wait()
                for _ in range(count):
                    sequence = ctx.emit(Event(kind="text", text="tick"))
                    await ctx.flush()
                    committed[sequence] = time.time()
                    await asyncio.sleep(0.01)

            return run

    path = bench.new()
    engine = await bench.engine(path, Paced())
    started = await (await starter_of(engine)).start("q-follow")
    other = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FOLLOWER, started.conversation_id,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "DELEGATION_BENCH_URL": bench.url(path)},  # not on ps's line
    )  # fmt: skip
    assert other.stdout is not None
    await other.stdout.readline()  # ready
    here: dict[int, float] = {}

    async def consume() -> None:
        async for event in engine.follow(started.conversation_id):
            here[event.sequence] = time.time()

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0.2)  # the other process is watching
    gate.set()
    await consumer
    lines = (await other.stdout.read()).decode().splitlines()
    await other.wait()
    there = dict(msgspec.json.decode(line) for line in lines)
    await engine.close()
    return {"in_process": _latency(committed, here), "other_process": _latency(committed, there)}


def _latency(committed: dict[int, float], arrived: dict[int, float]) -> dict[str, float]:
    """Median and p99 in ms; an arrival before the flush returned counts as 0 (the
    follower was woken by the very commit the emitter was still waiting on)."""
    delays = sorted(max(0.0, arrived[s] - t) * 1000 for s, t in committed.items() if s in arrived)
    p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
    return {"median_ms": round(median(delays), 2), "p99_ms": round(p99, 2)}


SCENARIOS: dict[str, Callable[[Bench, Sizes], Awaitable[Any]]] = {
    "start_seq": start_seq,
    "start_concurrent": start_concurrent,
    "events_100": events_100,
    "events_1": events_1,
    "steps_seq": steps_seq,
    "rewind_copy": rewind_copy,
    "read_page": read_page,
    "recover_10k_s": recover,
    "expire_5k_s": expire,
    "rss_growth_mb": rss_growth,
    "follow_latency": follow_latency,
    "waiting_100k": lambda bench, sizes: bench_waiting.waiting(
        bench, sizes.waiting_small, sizes.waiting_large, sizes.answers
    ),
    "admit_queued": lambda bench, sizes: bench_admission.admit_queued(bench, sizes.queued),
}


def _bench(folder: Path, url: str | None) -> Bench:
    if url is None:
        return Bench(folder)
    from tools.bench_postgres import PostgresBench  # psycopg: the postgres extra

    return PostgresBench(folder, url)


async def run_all(
    sizes: Sizes, only: list[str] | None, url: str | None = None, *, quiet: bool = False
) -> dict[str, Any]:
    """Every scenario (or those ``only`` names) on temporary SQLite files, or with
    ``url`` on new databases of that PostgreSQL server. Unless ``quiet``, each scenario's
    figures go to stderr as it ends, under a progress line on a terminal."""
    report: dict[str, Any] = {}
    chosen = [name for name in SCENARIOS if not only or name in only]
    with (
        tempfile.TemporaryDirectory(prefix="delegation-bench-") as folder,
        Progress("bench", len(chosen), quiet=quiet) as progress,
    ):
        bench = _bench(Path(folder), url)
        try:
            for done, name in enumerate(chosen):
                progress.update(name, done=done)
                gc.collect()  # each scenario starts clean of the last one's garbage
                report[name] = await SCENARIOS[name](bench, sizes)
                bench.engines.clear()  # every one closed by the scenario
                bench.cleanup()
                progress.note(f"  {name}: {report[name]}")
            progress.update("done", done=len(chosen))
            report["machine"] = machine() | bench.describe()
        finally:
            await bench.close_engines()
            bench.close()
    return report


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = []
    if m.get("store") == "postgresql":
        settings = ", ".join(f"{k}={v}" for k, v in m["settings"].items())
        lines.append(f"store: PostgreSQL {m['postgresql']} at {m['server']} ({settings})")
    raw_name = "raw psycopg" if m.get("store") == "postgresql" else "raw sqlite3"
    lines.append(f"{'scenario':<18} {'engine':>12} {raw_name:>12} {'ratio':>8}")
    for name, value in report.items():
        if name == "machine":
            continue
        if isinstance(value, dict) and "engine" in value:
            lines.append(
                f"{name:<18} {value['engine']:>10}/s {value['raw']:>10}/s {value['ratio']:>8}"
            )
        elif isinstance(value, dict) and "in_process" in value:
            for where, figures in value.items():
                lines.append(
                    f"{name + ' ' + where:<32} median {figures['median_ms']} ms,"
                    f" p99 {figures['p99_ms']} ms"
                )
        elif isinstance(value, dict) and "resume_ms" in value:
            lines.append(
                f"{name:<18} {value['children']} waiting: RSS +{value['rss_growth_mb']} MB"
                f" ({value['bytes_per_child']} B/child), {value['tasks_held']} tasks held;"
                f" answer to resume p50 {value['resume_ms']['median']} ms,"
                f" p99 {value['resume_ms']['p99']} ms; plain start p50"
                f" {value['start_ms']['median']} ms, p99 {value['start_ms']['p99']} ms"
            )
        elif isinstance(value, dict):
            lines.append(
                f"{name:<18} {value['engine_ms']:>9} ms {value['raw_ms']:>9} ms {value['ratio']:>8}"
            )
        else:
            lines.append(f"{name:<18} {value:>12}")
    lines.append(f"machine: {m['cores']} cores, Python {m['python']}, SQLite {m['sqlite']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m delegation.bench", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one line, one JSON object")
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--only", nargs="*", choices=list(SCENARIOS), help="some scenarios")
    parser.add_argument(
        "--url",
        help="a PostgreSQL server, postgresql+psycopg://USER@HOST/DB: USER needs CREATEDB;"
        " each scenario runs on a new database, dropped after it (default: SQLite files)",
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="with --url: 1, 2 and 3 host processes on one database (starts/s, events/s)"
        " and the takeover time after a kill, instead of the scenarios",
    )
    args = parser.parse_args(argv)
    if args.hosts and args.url is None:
        parser.error("--hosts needs --url: several hosts share one PostgreSQL database")
    if args.url is not None:
        try:
            postgres = stores.store_name(args.url) == "postgresql"
        except ValueError as exc:
            parser.error(f"--url: {exc}")
        if not postgres:
            parser.error("--url takes a PostgreSQL URL; SQLite runs on temporary files")
    resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE))
    if args.hosts:
        from tools import bench_hosts

        sizes = bench_hosts.QUICK if args.quick else bench_hosts.FULL
        report = asyncio.run(bench_hosts.run_all(args.url, sizes, quiet=args.json))
        print(msgspec.json.encode(report).decode() if args.json else bench_hosts.table(report))
        return 0
    report = asyncio.run(
        run_all(QUICK if args.quick else FULL, args.only, args.url, quiet=args.json)
    )
    print(msgspec.json.encode(report).decode() if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
