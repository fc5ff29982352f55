"""The host process of ``python -m delegation.soak``: a real :class:`Engine` on the soak's
database (its URL in ``$DELEGATION_SOAK_DB``, so that no password shows in ``ps``),
running the soak's runner (:mod:`tools.soak.runner`) and driven by the soak's
random workload (:mod:`tools.soak.workload`) until SIGTERM (a graceful close) or
SIGKILL (a crash); beside other hosts on a PostgreSQL database it may also be paused
(SIGSTOP) past the host timeout, then fenced. What the engine acknowledged goes to the
host's journal (:mod:`tools.soak.journal`), and so does whatever the host sees go
wrong itself: a refusal no correct engine gives, an exception escaping the API, an error
log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from delegation import errors
from delegation.config import EngineConfig
from delegation.engine import Engine
from tools.soak.journal import Journal
from tools.soak.runner import SoakRunner
from tools.soak.workload import Side, Woken, Workload

# Short lifetimes, so that leases expire and finished children are purged (with their
# events, steers and the tombstones nothing needs) while the soak runs.
LEASE_LIFETIME_S = 3.0
RETENTION_S = 10.0
# Several hosts on PostgreSQL: a host without a heartbeat for HOST_TIMEOUT_S is taken
# over. Shorter than the engine's own 5 s waits for a lock and for an idle transaction of
# a paused host, a timeout lets a live host blocked by a paused one be declared dead:
# ``--heartbeat 0.5 --host-timeout 3`` shows it (README, "Soak").
HEARTBEAT_S = 1.0
HOST_TIMEOUT_S = 6.0
CONFIG = EngineConfig(
    lease_lifetime_s=LEASE_LIFETIME_S,
    release_drain_s=2.0,
    retention_s=RETENTION_S,
    retention_sweep_s=1.0,
    host_heartbeat_s=HEARTBEAT_S,
    host_timeout_s=HOST_TIMEOUT_S,
)
DB_ENV = "DELEGATION_SOAK_DB"
RUNNERS = ("runner-0", "runner-1", "runner-2")
RUNNERS_PER_HOST = 2  # with several hosts: runner-<slot>-<n>, each host its own
WORKERS_PER_RUNNER = 3
# Several hosts writing the same rows wait for each other's locks, a paused one's until
# the server ends its idle transaction: a lock timeout or a deadlock is then an answer
# (database_busy), journaled as contention. Their SQLSTATEs:
# How long a host keeps trying to open while the server is away (the driver waits longer,
# READY_TIMEOUT_S): a server restarted every second or two leaves an open on a busy
# machine few whole windows, and 20 s once ran out on a 2-core machine under load.
BOOT_PATIENCE_S = 45.0
CONTENTION = frozenset({"55P03", "40P01", "40001"})


def runners_of(slot: int, hosts: int) -> tuple[str, ...]:
    """The runners of host ``slot``: each host its own, kept by the host started in its
    place, so no two live hosts connect the same runner (the soak's choice: a runner's
    leased children still move between hosts, by takeover)."""
    if hosts == 1:
        return RUNNERS
    return tuple(f"runner-{slot}-{n}" for n in range(RUNNERS_PER_HOST))


class _Problems(logging.Handler):
    """Error logs of the library are findings: the journal keeps them. A takeover this
    host made and the fence it met itself are facts the driver checks instead."""

    def __init__(self, journal: Journal, runner: SoakRunner, woken: Woken, shared: bool) -> None:
        super().__init__(logging.WARNING)
        self.journal, self.runner, self.woken, self.shared = journal, runner, woken, shared

    def emit(self, record: logging.LogRecord) -> None:
        action = getattr(record, "action", "")
        if action == "hosts_taken_over":
            taken = list(getattr(record, "instances", []))
            self.journal.write("takeover", instances=taken, at=record.created)
        elif action == "heartbeat_failed":  # a fact for whoever reads why a takeover was late
            self.journal.write("beat_failed", what=record.getMessage(), at=record.created)
        elif action == "host_fenced":
            old = str(getattr(record, "old_instance", ""))
            self.journal.write("fenced", old=old, new=str(getattr(record, "instance", "")))
            left = sorted(run for run, who in self.runner.owners.items() if who == old)
            if left:
                self.journal.bad(f"fence: runs of taken-over instance still execute: {left}")
        elif record.levelno >= logging.ERROR:
            exc = record.exc_info[1] if record.exc_info is not None else None
            what = f"log: {record.name}: {record.getMessage()}"
            if exc is not None:
                what += f" ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"
            if self.shared and _contention(exc):
                self.journal.write("contention", what=what)
            else:
                self.journal.bad(what, woken=self.woken.recently())
                if exc is not None:  # the whole story, in the host's stderr file
                    traceback.print_exception(exc, file=sys.stderr)


def _contention(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a lock timeout, deadlock or serialization failure, the server's
    or the driver's error wrapping one (its SQLSTATE, see ``CONTENTION``)."""
    for found in (exc, getattr(exc, "orig", None), getattr(exc, "__cause__", None)):
        if getattr(found, "sqlstate", None) in CONTENTION:
            return True
    return isinstance(exc, errors.DatabaseBusy)


@dataclass(frozen=True)
class HostOptions:
    url: str
    workspace: str
    journal: str
    seed: int
    epoch: int
    instances: dict[str, str]
    final: bool
    heartbeat_s: float = HEARTBEAT_S
    timeout_s: float = HOST_TIMEOUT_S
    shared: bool = False  # several hosts at once: lock contention is an answer


def _loop_problem(context: dict[str, Any]) -> str:
    """What the loop's exception handler saw, with the exception and the task it came from
    (the message alone, "Task exception was never retrieved", names neither)."""
    exc = context.get("exception")
    where = context.get("future") or context.get("task")
    what = str(context.get("message"))
    if where is not None and hasattr(where, "get_coro"):
        what += f" in {getattr(where.get_coro(), '__qualname__', where)}"
    if exc is not None:
        what += f": {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    return what


async def serve(opts: HostOptions) -> None:
    journal = Journal(opts.journal)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: journal.bad(f"loop: {_loop_problem(context)}"))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # The driver holds our stdin: end of file means it is gone, and so must we be.
    loop.add_reader(0, lambda: os.read(0, 512) or os._exit(3))
    rng = random.Random(f"{opts.seed}/{opts.epoch}")
    engine: Engine | None = None
    runner = SoakRunner(journal, random.Random(rng.random()), lambda: _instance(engine))
    woken = Woken()
    logging.getLogger("delegation").addHandler(_Problems(journal, runner, woken, opts.shared))
    config = dataclasses.replace(
        CONFIG, host_heartbeat_s=opts.heartbeat_s, host_timeout_s=opts.timeout_s
    )
    # A host started while the server restarts is told so (StoreUnavailable, nothing
    # taken) and, like a deployment's supervisor, tries again.
    deadline = time.monotonic() + BOOT_PATIENCE_S
    while True:
        engine = Engine(opts.url, runner=runner, config=config)
        try:
            await engine.open()
            break
        except errors.StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    offset = float(getattr(engine.clock, "offset", 0.0))
    journal.write("boot", instance=engine.instance_id, epoch=opts.epoch, off=offset)
    print("READY", flush=True)
    workload = Workload(engine, journal, rng, opts.epoch, opts.workspace, woken, opts.shared)
    sides = [Side(runner_id, hid) for runner_id, hid in opts.instances.items()]
    tasks = [asyncio.create_task(workload.report()), asyncio.create_task(woken.watch())]
    tasks.append(asyncio.create_task(_stalls(journal, lambda: _instance(engine))))
    for side in sides:
        await workload.connect(side)
    if opts.final:
        await _connect_refused(workload, sides, journal)
        await _drain(engine, journal)
    else:
        for side in sides:
            tasks += [asyncio.create_task(workload.worker(side)) for _ in range(WORKERS_PER_RUNNER)]
        await stop.wait()
    if rng.random() < 0.5:
        # A deploy does not wait for callers: close while the workers still call.
        workload.closing = True
        await _close(engine, journal, opts.shared)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await _close(engine, journal, opts.shared)
    if runner.live:
        journal.bad(f"close: runs still executing after engine.close(): {sorted(runner.live)}")
    workload.stats.flush_to(journal, workload.offset())
    journal.write("closed", instance=engine.instance_id)
    journal.close()


async def _close(engine: Engine, journal: Journal, shared: bool) -> None:
    """Close the engine; beside other hosts a lock timeout or deadlock of its last writes
    is an answer too (the engine is closed all the same, and its instance taken over)."""
    try:
        await engine.close()
    except errors.DelegationError as exc:
        if not (shared and _contention(exc)):
            raise
        journal.write("contention", what=f"close: {exc.reason}: {exc}")


async def _connect_refused(workload: Workload, sides: list[Side], journal: Journal) -> None:
    """The last host: a runner whose connect was refused (with --db-restarts, its session
    ended under it) connects again, or nothing would revoke its leases; one still refused
    after 30 s is a finding."""
    deadline = time.monotonic() + 30
    while refused := [side for side in sides if side.conn is None]:
        if time.monotonic() > deadline:
            names = [side.runner_id for side in refused]
            journal.bad(f"final connect: {names} still refused 30 s after the host opened")
            return
        await asyncio.sleep(0.05)
        for side in refused:
            await workload.connect(side)


async def _drain(engine: Engine, journal: Journal) -> None:
    """The last host: every runner came back with a new hostInstanceId, so every lease is
    revoked; wait until every child has ended."""
    deadline = time.monotonic() + 30
    while True:
        active = [
            c.run_id
            for s in ("prepared", "admitted", "running")
            for c in await engine.list_children(state=s, limit=10)
        ]
        if not active:
            return
        if time.monotonic() > deadline:
            journal.bad(f"drain: children still active 30 s after their leases ended: {active}")
            return
        await asyncio.sleep(0.05)


STALL_TICK_S = 0.1


async def _stalls(journal: Journal, instance: Any) -> None:
    """Journal, each second, the longest this host's event loop went unscheduled past a
    short sleep: what a starved machine (or a pause) cost it. The soak allows a takeover
    or an expiry this much later (README, "Liveness on a starved machine")."""
    worst, since = 0.0, time.monotonic()
    while True:
        before = time.monotonic()
        await asyncio.sleep(STALL_TICK_S)
        worst = max(worst, time.monotonic() - before - STALL_TICK_S)
        if time.monotonic() - since >= 1.0:
            journal.write("stall", instance=instance(), worst=round(worst, 3), at=time.time())
            worst, since = 0.0, time.monotonic()


def _instance(engine: Engine | None) -> str:
    return engine.instance_id if engine is not None else ""


def main(opts: HostOptions) -> int:
    asyncio.run(serve(opts))
    return 0


if __name__ == "__main__":  # pragma: no cover - run through ``python -m delegation.soak``
    sys.exit("run python -m delegation.soak")
