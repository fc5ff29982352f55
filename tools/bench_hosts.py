"""``python -m delegation.bench --url postgresql+psycopg://USER@HOST/DB --hosts``: several
host processes on one PostgreSQL database (design §12).

* **Rates with 1, 2 and 3 hosts.** For each count, a new database (as every scenario of
  :mod:`tools.bench_postgres`) and that many host processes, each its own
  ``Engine`` with its own runner connection: per host, ``callers`` concurrent callers
  start children that admit and hold (as ``start_concurrent``); then, on another new
  database and new processes, ``emitters`` children per host emit and flush batches of
  100 events (as ``events_100``). Every host counts what was answered (a start) or
  flushed (an event) inside one wall-clock window the parent gives them all, and prints
  its count; the rate is the sum over the hosts divided by that window. The load per
  host is fixed, so more hosts mean more load on the one server.
* **Takeover after a kill.** ``1 + live`` hosts, each with leased children streaming (an
  event flushed every 50 ms), production heartbeats (``EngineConfig`` defaults). One
  host is killed with SIGKILL at a random point of a heartbeat period; the parent
  polls the database (every 10 ms) until every child of the killed host is ``running``
  under another instance with a ``recovery`` event committed (``taken_s``), and until
  each has an event after that one (``streaming_s``: its run goes on under the taker).
  A live host takes over at its next heartbeat (the killed host's advisory lock is free
  at once): ``noticed_s`` is when that heartbeat began (the killed instance's
  ``closed_at``), so ``host_heartbeat_s`` bounds it; the rest is the takeover's work.

* **A lease expiry across three hosts** (design §7, §12). Three hosts, each holding a
  third of ``expiring`` leased children, every child under a lease of its own. The
  parent moves every lease's deadline just past (by SQL, on the database's clock that
  expiry reads) and sends ``GO`` to all three, each of which then expires what is due,
  as their lease timers would at a deadline they share: one host takes the expiry (a
  transaction lock), stops its own children and asks the other hosts to stop theirs (a
  control request and a ``NOTIFY``). The database is not analysed after the bulk
  start, as a new user's is not: the expiry's plans need no statistics. The parent
  polls the database until no child is left unfinished: ``expire_s`` is the time from
  ``GO``.

* **One queue admitted by 1 and by 3 hosts** (design §22). All hosts share one policy
  (``parent:conv-run-A`` at ``ADMIT_SLOTS``); host A starts ``queued`` children with
  ``start_wait_s`` 0: the first ``ADMIT_SLOTS`` take the slots and hold them, the rest
  are queued. At ``GO`` the held runs return and every host's pump admits from the one
  queue (each run returns once admitted); the parent polls the database until every
  child is done: the rate is the queued children over that time.

A host process of the bench is ``python -m tools.bench_hosts MODE NAME COUNT``
(the URL in ``$DELEGATION_BENCH_URL``, kept off ``ps``): it prints ``READY <instance>``,
then in ``expire`` mode reads ``GO`` and expires what is due, in ``starts`` and
``events`` mode reads ``GO <from> <until>`` (epoch seconds) and
prints ``COUNT <n>``; in ``stream`` mode it streams until it is killed.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg

from delegation import (
    AdmissionPolicy,
    ChildContext,
    Engine,
    EngineConfig,
    Event,
    Params,
    Request,
    Result,
)
from delegation.cli.progress import Progress
from delegation.run.context import Recovery, Run
from delegation.store import stores
from delegation.wire import Identity, Preset
from tools import environment
from tools.bench_base import CONFIG, PRESET, machine, median
from tools.bench_postgres import PostgresBench

HOSTS = (1, 2, 3)
URL_ENV = "DELEGATION_BENCH_URL"
START_DELAY_S = 0.5  # from GO being sent to the window opening: every host is waiting


@dataclass(frozen=True)
class HostSizes:
    window_s: float  # the wall-clock window every rate is measured over
    callers: int  # concurrent callers starting children, per host
    emitters: int  # children emitting side by side, per host
    streamers: int  # leased children streaming on each host of a takeover run
    live: int  # live hosts beside the one killed
    takeovers: int  # takeover runs (the median is reported)

    queued: int  # children host A queues for the admission rate (design §22)
    expiring: int  # leased children across three hosts whose leases expire together
    expiries: int  # expiry runs (the median is reported)


FULL = HostSizes(10.0, 50, 100, 10, 2, 5, 10_000, 5_000, 3)
QUICK = HostSizes(1.5, 10, 10, 3, 1, 1, 500, 300, 1)
ADMIT_SLOTS = 64
ADMIT_POLICY = {"parent:conv-run-A": AdmissionPolicy(concurrency=ADMIT_SLOTS, max_queued=10**6)}


# --- the host process -----------------------------------------------------------------


class HostRunner:
    """Children admit, then hold (``starts``, ``events``: their contexts are kept for
    the emitters) or stream an event every 50 ms (``stream``, resumed ones included)."""

    def __init__(self, stream: bool, gated: bool = False) -> None:
        self.stream = stream
        self.contexts: list[ChildContext] = []
        self.gate = asyncio.Event() if gated else None  # ``admit``: runs return at GO

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        if self.gate is not None:
            await self.gate.wait()
            return
        if not self.stream:
            self.contexts.append(ctx)
            await asyncio.Event().wait()
        while True:
            ctx.emit(Event(kind="text", text="tick"))
            await ctx.flush()
            await asyncio.sleep(0.05)


class HostStarter:
    """``bench_base.Starter`` under a run of this host's own: a new tool call every 60
    children, each start one ``child.start`` call (leased, when ``leased``)."""

    def __init__(self, engine: Engine, conn: Any, name: str, leased: bool) -> None:
        self.engine, self.conn, self.run_id, self.leased = engine, conn, f"run-{name}", leased
        self.count = 0
        self.tools: dict[int, asyncio.Future[Any]] = {}

    async def start(self) -> Result:
        index, n = self.count // 60, self.count
        self.count += 1
        if index not in self.tools:
            self.tools[index] = asyncio.ensure_future(
                self.engine.open_tool(
                    self.conn, run_id=self.run_id, conversation_id=f"conv-{self.run_id}",
                    tool_call_id=f"call-{index}", extension_id="ext", presets=[PRESET],
                    workspace=tempfile.gettempdir(),
                )
            )  # fmt: skip
        await self.tools[index]
        lease = f"L{n}" if self.leased else ""
        request = Request(request_id=f"q{n}", profile="bench", message="go", lease_id=lease)
        params = Params(run_id=self.run_id, tool_call_id=f"call-{index}", extension_id="ext",
                        generation=1, lease_id=lease, request=request)  # fmt: skip
        result = await self.engine.call(self.conn, "child.start", params)
        assert isinstance(result, Result)
        return result


def say(line: str) -> None:
    print(line, flush=True)


async def host(mode: str, name: str, count: int) -> None:
    """One host process: see the module. ``count``: callers, emitters or streamers."""
    config = CONFIG if mode != "stream" else EngineConfig()  # production, heartbeats too
    if mode == "admit":
        config = replace(CONFIG, admission=ADMIT_POLICY, start_wait_s=0.0)
    runner = HostRunner(stream=mode == "stream", gated=mode == "admit")
    engine = Engine(os.environ[URL_ENV], runner=runner, config=config)
    await engine.open()
    conn = await engine.connect(f"bench-runner-{name}", f"bench-host-{name}")
    starter = HostStarter(engine, conn, name, leased=mode in ("stream", "expire"))
    if mode == "starts":
        await starter.start()  # the first tool, caches, statements
    elif mode in ("admit", "expire"):
        for base in range(0, count, 500):
            await asyncio.gather(*(starter.start() for _ in range(min(500, count - base))))
    else:
        await asyncio.gather(*(starter.start() for _ in range(count)))
    while mode == "events" and len(runner.contexts) < count:
        await asyncio.sleep(0.01)
    say(f"READY {engine.instance_id}")
    if mode == "stream":
        await asyncio.Event().wait()  # until killed
    if mode == "expire":
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # GO
        await engine.expire_due()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # STOP
        await asyncio.wait_for(engine.close(), 60)
        return
    if mode == "admit":
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # GO
        assert runner.gate is not None
        runner.gate.set()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # STOP
        await asyncio.wait_for(engine.close(), 60)
        return
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    opens, closes = (float(word) for word in line.split()[1:3])
    await asyncio.sleep(max(0.0, opens - time.time()))
    if mode == "starts":
        done = await asyncio.gather(*(_caller(starter, closes) for _ in range(count)))
    else:
        done = await asyncio.gather(*(_emitter(ctx, closes) for ctx in runner.contexts))
    say(f"COUNT {sum(done)}")
    await asyncio.wait_for(engine.close(), 60)


async def _caller(starter: HostStarter, closes: float) -> int:
    done = 0
    while time.time() < closes:
        await starter.start()
        done += time.time() <= closes
    return done


async def _emitter(ctx: ChildContext, closes: float) -> int:
    done = 0
    while time.time() < closes:
        for n in range(100):
            ctx.emit(Event(kind="text", text=f"event {n}"))
        await ctx.flush()
        done += 100 if time.time() <= closes else 0
    return done


# --- the parent: host processes, rates, takeovers --------------------------------------


class Host:
    """One host process, spoken to through its stdin and stdout (stderr is ours)."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name, self.proc, self.instance = name, proc, ""

    @classmethod
    async def launch(cls, url: str, mode: str, name: str, count: int) -> Host:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tools.bench_hosts", mode, name, str(count),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=environment({**os.environ, URL_ENV: url}),
        )  # fmt: skip
        return cls(name, proc)

    async def expect(self, word: str, timeout: float) -> str:
        """The rest of the next line that starts with ``word``."""
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if not line:
                raise RuntimeError(f"host {self.name} ended (exit {await self.proc.wait()})")
            if line.decode().startswith(word + " "):
                return line.decode().split(" ", 1)[1].strip()

    async def ready(self) -> None:
        self.instance = await self.expect("READY", 120)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def launch_all(url: str, mode: str, counts: list[int]) -> list[Host]:
    hosts = [await Host.launch(url, mode, chr(ord("A") + i), n) for i, n in enumerate(counts)]
    try:
        await asyncio.gather(*(h.ready() for h in hosts))
    except BaseException:
        await asyncio.gather(*(h.stop(signal.SIGKILL) for h in hosts))
        raise
    return hosts


async def rate(
    bench: PostgresBench, mode: str, hosts: int, each: int, window: float
) -> list[float]:
    """Per host, what it did per second of one shared window (``mode``: starts or
    events), ``hosts`` processes on a new database."""
    started = await launch_all(bench.new(), mode, [each] * hosts)
    try:
        opens = time.time() + START_DELAY_S
        for h in started:
            h.send(f"GO {opens} {opens + window}")
        counts = [int(await h.expect("COUNT", window + 120)) for h in started]
        for h in started:
            await asyncio.wait_for(h.proc.wait(), 90)
    finally:
        await asyncio.gather(*(h.stop() for h in started))
        bench.cleanup()
    return [round(n / window, 1) for n in counts]


# Each child of the killed host: (running under another instance with a recovery event,
# an event after that recovery event).
_PROGRESS = """
SELECT count(*) FILTER (WHERE taken), count(*) FILTER (WHERE taken AND last > recovered)
FROM (SELECT c.state = 'running' AND c.engine_instance_id <> %(dead)s AND r.seq IS NOT NULL
             AS taken, r.seq AS recovered,
             (SELECT max(sequence) FROM events e WHERE e.child_id = c.id) AS last
      FROM children c LEFT JOIN LATERAL (
          SELECT max(sequence) AS seq FROM events e WHERE e.child_id = c.id
          AND convert_from(e.body, 'UTF8') LIKE '%%"kind":"recovery"%%') r ON TRUE
      WHERE c.id = ANY(%(ids)s)) AS progress
"""


async def takeover(bench: PostgresBench, sizes: HostSizes) -> tuple[float, float, float]:
    """Seconds from SIGKILL of one host until a live host's heartbeat noticed it, until
    every child it ran is taken over, and until each streams again under its taker."""
    url = bench.new()
    hosts = await launch_all(url, "stream", [sizes.streamers] * (1 + sizes.live))
    try:
        # Every host heartbeats and streams; the kill comes at any point of a period.
        await asyncio.sleep(1.0 + random.uniform(0.0, EngineConfig().host_heartbeat_s))
        with psycopg.connect(stores.libpq(url), autocommit=True) as conn:
            victim = hosts[0]
            owned = "SELECT id FROM children WHERE engine_instance_id = %s AND state = 'running'"
            ids = [row[0] for row in conn.execute(owned, (victim.instance,))]
            assert len(ids) == sizes.streamers, ids
            killed = time.time()
            await victim.stop(signal.SIGKILL)
            taken_s, streaming_s = await _until_resumed(conn, victim.instance, ids, killed)
            closed = "SELECT closed_at FROM engine_instances WHERE id = %s"
            row = conn.execute(closed, (victim.instance,)).fetchone()
            noticed_s = max(0.0, float(row[0]) - killed) if row and row[0] is not None else 0.0
    finally:
        await asyncio.gather(*(h.stop() for h in hosts))
        bench.cleanup()
    return round(noticed_s, 3), round(taken_s, 3), round(streaming_s, 3)


async def _until_resumed(
    conn: psycopg.Connection[Any], dead: str, ids: list[int], killed: float
) -> tuple[float, float]:
    """Poll (every 10 ms) until every child in ``ids`` is taken over, then streams."""
    taken_s = 0.0
    while True:
        row = conn.execute(_PROGRESS, {"dead": dead, "ids": ids}).fetchone()
        taken, streaming = row if row else (0, 0)
        if taken == len(ids) and not taken_s:
            taken_s = time.time() - killed
        if streaming == len(ids):
            return taken_s, time.time() - killed
        if time.time() - killed > 60:
            raise RuntimeError(f"{len(ids) - taken} children not taken over in 60 s")
        await asyncio.sleep(0.01)


async def admit_rate(bench: PostgresBench, hosts: int, queued: int) -> float:
    """Queued children admitted a second by ``hosts`` host processes (see the module)."""
    url = bench.new()
    started = await launch_all(url, "admit", [queued] + [0] * (hosts - 1))
    try:
        with psycopg.connect(stores.libpq(url), autocommit=True) as conn:
            done = "SELECT count(*) FROM children WHERE state = 'done'"
            elapsed = await _go_until(
                conn, started, done, lambda n: n >= queued, f"of {queued} children done"
            )
        await _stop_all(started)
    finally:
        await asyncio.gather(*(h.stop() for h in started))
        bench.cleanup()
    return round((queued - ADMIT_SLOTS) / elapsed, 1)


async def expire_hosts(bench: PostgresBench, total: int) -> float:
    """Seconds from ``GO`` until every child of ``total`` leases held by three hosts
    is cancelled, once their deadline passed (see the module)."""
    url = bench.new()
    each = [total // 3 + (1 if n < total % 3 else 0) for n in range(3)]
    started = await launch_all(url, "expire", each)
    try:
        with psycopg.connect(stores.libpq(url), autocommit=True) as conn:
            past = "UPDATE grants SET expires_at = EXTRACT(EPOCH FROM now()) - 1 WHERE kind = %s"
            conn.execute(past, ("lease",))
            left = "SELECT count(*) FROM children WHERE finished_at IS NULL"
            elapsed = await _go_until(
                conn, started, left, lambda n: n == 0, f"of {total} children unfinished"
            )
            cancelled = "SELECT count(*) FROM children WHERE state = 'cancelled'"
            row = conn.execute(cancelled).fetchone()
            if row is None or row[0] != total:
                raise RuntimeError(f"{row} of {total} children cancelled")
        await _stop_all(started)
    finally:
        await asyncio.gather(*(h.stop() for h in started))
        bench.cleanup()
    return round(elapsed, 3)


async def _go_until(
    conn: psycopg.Connection[Any],
    hosts: list[Host],
    count_sql: str,
    reached: Callable[[int], bool],
    what: str,
) -> float:
    """Send ``GO`` to every host, then poll ``count_sql`` (every 10 ms, 600 s at most)
    until its count is ``reached``: the seconds since ``GO``."""
    began = time.perf_counter()
    for h in hosts:
        h.send("GO")
    while (row := conn.execute(count_sql).fetchone()) is None or not reached(row[0]):
        if time.perf_counter() - began > 600:
            raise RuntimeError(f"{row} {what} after 600 s")
        await asyncio.sleep(0.01)
    return time.perf_counter() - began


async def _stop_all(hosts: list[Host]) -> None:
    """Tell every host to close, and wait until each has."""
    for h in hosts:
        h.send("STOP")
    for h in hosts:
        await asyncio.wait_for(h.proc.wait(), 90)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": median(values), "min": min(values), "max": max(values)}


async def run_all(url: str, sizes: HostSizes, *, quiet: bool = False) -> dict[str, Any]:
    """Rates with 1, 2 and 3 hosts, and the takeover time (see the module); unless
    ``quiet``, each figure goes to stderr as it is had, under a progress line on a
    terminal."""
    report: dict[str, Any] = {}
    bench = PostgresBench(Path(tempfile.gettempdir()), url)
    try:
        with Progress("bench --hosts", len(HOSTS) + sizes.takeovers, quiet=quiet) as progress:
            for n in HOSTS:
                progress.update(f"{n} hosts", done=n - 1)
                report[f"hosts_{n}"] = await rates(bench, n, sizes)
                progress.note(f"  {n} hosts: {report[f'hosts_{n}']}")
            runs = []
            for done in range(sizes.takeovers):
                progress.update("takeover after a kill", done=len(HOSTS) + done)
                runs.append(await takeover(bench, sizes))
            progress.note(f"  takeovers (noticed, taken, streaming): {runs}")
            report["admit_queued"] = {
                f"hosts_{n}": await admit_rate(bench, n, sizes.queued) for n in (1, 3)
            }
            progress.note(f"  admit_queued: {report['admit_queued']}")
            expiries = [await expire_hosts(bench, sizes.expiring) for _ in range(sizes.expiries)]
            report["expire_3_hosts"] = {"children": sizes.expiring, "s": _spread(expiries)}
            progress.note(f"  expire across 3 hosts: {expiries}")
        report["takeover"] = {
            "runs": len(runs), "live_hosts": sizes.live, "children": sizes.streamers,
            "heartbeat_s": EngineConfig().host_heartbeat_s,
            "noticed_s": _spread([run[0] for run in runs]),
            "taken_s": _spread([run[1] for run in runs]),
            "streaming_s": _spread([run[2] for run in runs]),
        }  # fmt: skip
        report["machine"] = machine() | bench.describe()
    finally:
        bench.close()
    return report


async def rates(bench: PostgresBench, hosts: int, sizes: HostSizes) -> dict[str, Any]:
    """Starts and events a second, summed over ``hosts`` host processes."""
    starts = await rate(bench, "starts", hosts, sizes.callers, sizes.window_s)
    events = await rate(bench, "events", hosts, sizes.emitters, sizes.window_s)
    return {
        "starts_per_s": round(sum(starts), 1), "events_per_s": round(sum(events), 1),
        "starts_by_host": starts, "events_by_host": events,
    }  # fmt: skip


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    settings = ", ".join(f"{k}={v}" for k, v in m["settings"].items())
    lines = [f"store: PostgreSQL {m['postgresql']} at {m['server']} ({settings})"]
    lines.append(f"{'hosts':<6} {'starts/s':>10} {'events/s':>10}   per host (starts; events)")
    for n in HOSTS:
        row = report[f"hosts_{n}"]
        lines.append(
            f"{n:<6} {row['starts_per_s']:>10} {row['events_per_s']:>10}"
            f"   {row['starts_by_host']}; {row['events_by_host']}"
        )
    t = report["takeover"]
    lines.append(
        f"takeover after SIGKILL, seconds ({t['runs']} runs, {t['live_hosts']} live hosts,"
        f" {t['children']} leased children on each, heartbeat {t['heartbeat_s']} s):"
    )
    for key, what in (("noticed_s", "noticed"), ("taken_s", "taken over"),
                      ("streaming_s", "streaming again")):  # fmt: skip
        spread = t[key]
        lines.append(f"  {what:<16} median {spread['median']} ({spread['min']} to {spread['max']})")
    admitted = report["admit_queued"]
    lines.append(
        f"admit_queued (one queue, {ADMIT_SLOTS} slots): 1 host {admitted['hosts_1']}/s,"
        f" 3 hosts {admitted['hosts_3']}/s"
    )
    expired = report["expire_3_hosts"]
    lines.append(
        f"expire across 3 hosts ({expired['children']} leased children):"
        f" median {expired['s']['median']} s ({expired['s']['min']} to {expired['s']['max']})"
    )
    lines.append(f"machine: {m['cores']} cores, Python {m['python']}")
    return "\n".join(lines)


if __name__ == "__main__":
    asyncio.run(host(sys.argv[1], sys.argv[2], int(sys.argv[3])))
