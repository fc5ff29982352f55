"""The soak's workload: random calls of every kind on one host's :class:`Engine`, from
several workers per runner (start, fresh or resumed, foreground or under a lease; read,
steer, cancel, release, replay, tool end, parent run success and failure, reconnect as
the same or a new host instance), each acknowledgement journaled
(:mod:`tools.soak.journal`) as soon as the engine gave it.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import time
import traceback
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from delegation import errors
from delegation.engine import Engine
from delegation.records import RunnerConnection, ToolHandle
from delegation.wire import (
    CANCEL_METHOD,
    READ_METHOD,
    RELEASE_METHOD,
    START_METHOD,
    STEER_INJECTED,
    STEER_METHOD,
    Params,
    Preset,
    Request,
    Result,
    SteerResult,
)
from tools.soak.journal import Journal
from tools.soak.runner import PLANS, event_text

T = TypeVar("T")

EXTENSION = "soak-ext"
PRESETS = (
    Preset(name="worker", extension_id=EXTENSION, generation=1),
    Preset(name="helper", extension_id=EXTENSION, generation=1),
)
# Refusals no correct engine gives to this workload: each one is a finding.
SUSPECT_REASONS = frozenset(
    {"illegal_transition", "internal_error", "store_error", "database_busy", "host_closing"}
)
STATS_EVERY_S = 0.25
# A host paused past the host timeout is fenced when continued: for a while its calls and
# runs are refused and its connections found dropped. Journaled, but as "woken" problems.
WOKEN_GAP_S = 1.0
WOKEN_FOR_S = 5.0


@dataclass(eq=False)
class ChildRef:
    """A child this host started or found, and how to address it."""

    conv: str
    run: str
    parent_run: str
    tool_call: str
    lease: str
    after: int = 0
    done: bool = False
    steers: dict[str, tuple[str, str]] = field(default_factory=dict)  # req -> (msg, outcome)


@dataclass(eq=False)
class Side:
    """One runner as the workload sees it."""

    runner_id: str
    hid: str
    conn: RunnerConnection | None = None
    stale: bool = False  # the connection was refused as stale: register again
    tools: list[ToolHandle] = field(default_factory=list)
    runs: dict[str, str] = field(default_factory=dict)  # open parent run -> its conversation
    leases: dict[str, str] = field(default_factory=dict)  # lease id -> its parent run
    children: deque[ChildRef] = field(default_factory=lambda: deque(maxlen=200))
    starts: deque[tuple[Params, ChildRef]] = field(default_factory=lambda: deque(maxlen=50))


class Woken:
    """Whether this process was just stopped (SIGSTOP) and continued: its loop's ticks
    stopped meanwhile. The driver excuses what a host journals as woken only if it did
    pause that host."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.woken = -1e9

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if now - self.last > WOKEN_GAP_S:
                self.woken = now
            self.last = now

    def recently(self) -> bool:
        now = time.monotonic()
        return now - self.last > WOKEN_GAP_S or now - self.woken < WOKEN_FOR_S


class Stats:
    """Calls since the last report: latencies, methods and refusals by reason."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.calls: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()

    def flush_to(self, journal: Journal, offset: float) -> None:
        """Journal the calls since the last, with the engine clock's offset from this
        host's own (its error is how far two hosts' or two moments' stamps may differ)."""
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        lat = [round(x, 2) for x in self.latencies]
        journal.write(
            "stats",
            ops=len(lat),
            lat=lat,
            calls=self.calls,
            err=self.refusals,
            rss=rss,
            off=offset,
        )
        self.latencies, self.calls, self.refusals = [], Counter(), Counter()


class Workload:
    """Random calls of every kind, from several workers per runner."""

    def __init__(
        self,
        engine: Engine,
        journal: Journal,
        rng: random.Random,
        epoch: int,
        workspace: str,
        woken: Woken,
        shared: bool,
    ) -> None:
        self.engine, self.journal, self.rng, self.woken = engine, journal, rng, woken
        self.shared = shared  # several hosts: database_busy is an answer, not a finding
        self.epoch, self.workspace = epoch, workspace
        self.stats = Stats()
        self.count = 0
        self.closing = False  # the engine is closing under the workers' feet
        self.ops: list[tuple[Callable[[Side], Awaitable[None]], float]] = [
            (self.start, 30),
            (self.read, 20),
            (self.steer, 10),
            (self.open_tool, 8),
            (self.cancel, 6),
            (self.close_tool, 5),
            (self.replay, 4),
            (self.release, 4),
            (self.finish_run, 2),
            (self.reconnect, 1.5),
            (self.disconnect, 0.5),
        ]

    def offset(self) -> float:
        return float(getattr(self.engine.clock, "offset", 0.0))

    def now(self) -> float:
        """The engine's clock (on PostgreSQL the server's, as each host measures it): the
        times journaled are compared with the times the engine stamped."""
        return self.engine.clock.now()

    def tag(self) -> str:
        self.count += 1
        return f"e{self.epoch}-{self.count}"

    async def call(
        self, name: str, fn: Callable[[], Awaitable[T]], side: Side | None = None
    ) -> T | None:
        """One timed engine call; a refusal is counted by reason and answers None. A
        runner whose connection is refused as stale (a host took this one over while
        it was paused) registers again, as a real runner would."""
        started = time.perf_counter()
        self.stats.calls[name] += 1
        conn = side.conn if side is not None else None
        try:
            return await fn()
        except errors.DelegationError as exc:
            self.stats.refusals[exc.reason] += 1
            if side is not None and exc.reason == "stale_connection" and side.conn is conn:
                side.stale = True
            busy = self.shared and exc.reason == "database_busy"
            if exc.reason in SUSPECT_REASONS and not self.closing and not busy:
                what = f"refusal: {name} refused with {exc.reason}: {exc}"
                self.journal.bad(what, woken=self.woken.recently())
            return None
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self.journal.bad(
                f"crash: {name} raised {type(exc).__name__} ({exc}) at"
                f" {os.path.basename(where.filename)}:{where.lineno}",
                woken=self.woken.recently(),
            )
            return None
        finally:
            self.stats.latencies.append((time.perf_counter() - started) * 1000)

    async def rpc(self, side: Side, method: str, params: Params) -> Result | SteerResult | None:
        conn = side.conn
        if conn is None:
            return None
        return await self.call(method, lambda: self.engine.call(conn, method, params), side)

    # --- setup ---------------------------------------------------------------------

    async def connect(self, side: Side) -> None:
        """Connect, and learn the leases and leased children earlier hosts left."""
        sent, hid = self.now(), side.hid
        conn = await self.call("connect", lambda: self.engine.connect(side.runner_id, hid))
        if conn is None:
            return
        side.conn = conn
        self.journal.write("instance", runner=side.runner_id, hid=hid, sent=sent)
        for lease in await self.call("leases", lambda: self.engine.leases(side.runner_id)) or []:
            if lease.revoked_at is None and lease.run_id is not None:
                side.leases[lease.lease_id] = lease.run_id
                side.runs.setdefault(lease.run_id, lease.conversation_id or "")
        for child in await self.call("list", lambda: self.engine.list_children(limit=300)) or []:
            if child.runner_id == side.runner_id and child.lease_id in side.leases:
                ref = ChildRef(
                    child.conversation_id,
                    child.run_id,
                    child.parent_run_id,
                    "",
                    child.lease_id or "",
                    done=child.terminal,
                )
                side.children.append(ref)

    async def worker(self, side: Side) -> None:
        ops, weights = zip(*self.ops, strict=True)
        while True:
            op = self.rng.choices(ops, weights)[0]
            if side.stale:
                side.stale, side.tools = False, []
                op = self.connect
            try:
                await op(side)
            except Exception as exc:  # a fault of the soak's own: still a finding
                self.journal.bad(f"worker: {op.__name__} raised {type(exc).__name__}: {exc}")
            await asyncio.sleep(self.rng.uniform(0.0, 0.01))

    async def report(self) -> None:
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            self.stats.flush_to(self.journal, self.offset())
            self.journal.sync()

    # --- helpers --------------------------------------------------------------------

    def generation(self) -> int:
        return 2 if self.rng.random() < 0.03 else 1  # a stale extension process, now and then

    def handle(self, ref: ChildRef, **extra: Any) -> Params:
        """Params addressing ``ref`` through its lease, or else its tool call."""
        run_id = "" if self.rng.random() < 0.08 else ref.run  # sometimes omit childRunId
        owner: dict[str, Any] = {"lease_id": ref.lease} if ref.lease else {}
        if not ref.lease:
            owner["tool_call_id"] = ref.tool_call
        return Params(
            run_id=ref.parent_run,
            extension_id=EXTENSION,
            generation=self.generation(),
            child_id=ref.conv,
            child_run_id=run_id,
            **owner,
            **extra,
        )

    def check_page(self, ref: ChildRef, result: Result, after: int) -> None:
        """Events after ``after``, gap-free, each with the text its run gave it."""
        expected = after + 1
        for event in result.events:
            if event.sequence != expected:
                self.journal.bad(f"page: child {ref.run} after {after} gave {event.sequence}")
                return
            written = event.text.partition("@")[0]
            if event.kind in ("text", "result") and written != event_text(event.kind, expected, ""):
                self.journal.bad(f"page: child {ref.run} event {expected} reads {event.text!r}")
            expected += 1
        ref.after = expected - 1
        ref.done = ref.done or result.done

    def forget(self, side: Side, gone: Callable[[ChildRef], bool]) -> None:
        """Stop addressing most children whose authority ended (a few stay, to be refused)."""
        keep = [ref for ref in side.children if not gone(ref) or self.rng.random() < 0.1]
        side.children = deque(keep, maxlen=side.children.maxlen)

    def pick(self, side: Side) -> ChildRef | None:
        return self.rng.choice(side.children) if side.children else None

    # --- operations -------------------------------------------------------------------

    async def open_tool(self, side: Side) -> None:
        conn = side.conn
        if conn is None:
            return None
        if len(side.tools) >= 3:
            return await self.start(side)
        if side.runs and self.rng.random() < 0.6:
            run_id = self.rng.choice(list(side.runs))
        else:
            run_id = f"pr-{self.tag()}"
            side.runs[run_id] = f"pc-{run_id}"
        tool = await self.call(
            "open_tool",
            lambda: self.engine.open_tool(
                conn,
                run_id=run_id,
                conversation_id=side.runs.get(run_id) or f"pc-{run_id}",
                tool_call_id=f"call-{self.tag()}",
                extension_id=EXTENSION,
                presets=PRESETS,
                workspace=self.workspace,
            ),
            side,
        )
        if tool is not None:
            side.tools.append(tool)

    async def start(self, side: Side) -> None:
        rng = self.rng
        plan = f"{rng.choice(PLANS)} {rng.randint(1, 8)}"
        request_id = f"q-{self.tag()}"
        lease = resume = tool_call = ""
        if side.tools and rng.random() < 0.85:
            tool = rng.choice(side.tools)
            run_id, tool_call = tool.run_id, tool.tool_call_id
            if rng.random() < 0.45:
                own = [name for name, run in side.leases.items() if run == run_id]
                lease = rng.choice(own) if own and rng.random() < 0.5 else f"L-{self.tag()}"
                side.leases.setdefault(lease, run_id)
            finished = [c for c in side.children if c.parent_run == run_id and c.done]
            if finished and rng.random() < 0.15:
                resume = rng.choice(finished).conv
        elif side.leases:
            lease, run_id = rng.choice(list(side.leases.items()))
        else:
            return await self.open_tool(side)
        profile = "worker" if rng.random() < 0.95 else "helper"
        request = Request(
            request_id=request_id, profile=profile, message=plan, lease_id=lease, resume=resume
        )
        params = Params(
            run_id=run_id,
            tool_call_id=tool_call,
            extension_id=EXTENSION,
            generation=self.generation(),
            lease_id=lease,
            request=request,
        )
        sent = self.now()
        if rng.random() < 0.1:  # the same start twice at once: one child, one answer
            first, result = await asyncio.gather(
                self.rpc(side, START_METHOD, params), self.rpc(side, START_METHOD, params)
            )
            if len({r.run_id for r in (first, result) if isinstance(r, Result)}) > 1:
                self.journal.bad(f"race: requestId {request_id} started two children")
            result = result if isinstance(result, Result) else first
        else:
            result = await self.rpc(side, START_METHOD, params)
        if not isinstance(result, Result):
            return
        self.journal.write(
            "start",
            runner=side.runner_id,
            run=result.run_id,
            lease=lease,
            sent=sent,
            at=self.now(),
        )
        ref = ChildRef(result.conversation_id, result.run_id, run_id, tool_call, lease)
        self.check_page(ref, result, 0)
        side.children.append(ref)
        side.starts.append((params, ref))

    async def replay(self, side: Side) -> None:
        """The same requestId again: the same child; with other input: a refusal."""
        if not side.starts:
            return
        params, ref = self.rng.choice(side.starts)
        request = params.request
        assert isinstance(request, Request)
        changed = self.rng.random() < 0.25
        if changed:
            request = msgspec.structs.replace(request, message=request.message + " again")
        again = msgspec.structs.replace(params, request=request)
        result = await self.rpc(side, START_METHOD, again)
        if not isinstance(result, Result):
            return
        if result.run_id == ref.run and not changed:
            return
        # Under a lease that expired meanwhile the grant is new, and so is the child.
        old = await self.call("get_child", lambda: self.engine.get_child(ref.conv, ref.run))
        if not params.lease_id or (old is not None and old.grant_id is not None):
            what = "with other input accepted" if changed else "started another child"
            self.journal.bad(f"replay: requestId {request.request_id} {what}")

    async def read(self, side: Side) -> None:
        ref = self.pick(side)
        if ref is None:
            return
        params = self.handle(ref, after=ref.after)
        result = await self.rpc(side, READ_METHOD, params)
        if isinstance(result, Result) and params.child_run_id:
            self.check_page(ref, result, params.after)

    async def steer(self, side: Side) -> None:
        ref = self.pick(side)
        if ref is None:
            return
        again = bool(ref.steers) and self.rng.random() < 0.2
        if again:
            request_id, (message, outcome) = self.rng.choice(list(ref.steers.items()))
            changed = self.rng.random() < 0.3
            message = message + " changed" if changed else message
        else:
            request_id = f"st-{self.tag()}"
            message, outcome, changed = f"m {request_id}", "", False
        params = msgspec.structs.replace(
            self.handle(ref), child_run_id=ref.run, request_id=request_id, message=message
        )
        result = await self.rpc(side, STEER_METHOD, params)
        if not isinstance(result, SteerResult):
            return
        if changed:
            self.journal.bad(f"steer: requestId {request_id} with another message accepted")
        elif again and result.outcome != outcome:
            self.journal.bad(f"steer: receipt {request_id} changed {outcome} -> {result.outcome}")
        elif not again:
            ref.steers[request_id] = (message, result.outcome)
            if result.outcome == STEER_INJECTED:
                self.journal.write("steer", run=ref.run, req=request_id)

    async def cancel(self, side: Side) -> None:
        ref = self.pick(side)
        if ref is None:
            return
        params = msgspec.structs.replace(self.handle(ref), child_run_id=ref.run)
        result = await self.rpc(side, CANCEL_METHOD, params)
        if isinstance(result, Result):
            self.journal.write("cancel", run=ref.run, done=result.done, at=self.now())

    async def release(self, side: Side) -> None:
        if side.leases and self.rng.random() < 0.9:
            lease, run_id = self.rng.choice(list(side.leases.items()))
        else:
            lease, run_id = f"L-ghost-{self.tag()}", ""  # an unknown lease: a tombstone
        params = Params(
            run_id=run_id, extension_id=EXTENSION, generation=self.generation(), lease_id=lease
        )
        sent = self.now()
        result = await self.rpc(side, RELEASE_METHOD, params)
        if isinstance(result, Result) and result.done:
            self.journal.write(
                "release", runner=side.runner_id, lease=lease, sent=sent, at=self.now()
            )
            side.leases.pop(lease, None)
            self.forget(side, lambda ref: ref.lease == lease)

    async def close_tool(self, side: Side) -> None:
        if side.tools:
            tool = side.tools.pop(self.rng.randrange(len(side.tools)))
            await self.call("close_tool", lambda: self.engine.close_tool(tool))
            self.forget(side, lambda ref: ref.tool_call == tool.tool_call_id and not ref.lease)

    async def finish_run(self, side: Side) -> None:
        if not side.runs:
            return
        run_id = self.rng.choice(list(side.runs))
        del side.runs[run_id]
        side.tools = [t for t in side.tools if t.run_id != run_id]
        succeeded = self.rng.random() < 0.6

        async def finish() -> bool:
            await self.engine.finish_run(run_id, succeeded)
            return True

        sent = self.now()
        if await self.call("finish_run", finish):
            self.journal.write("finish", run_id=run_id, ok=succeeded, sent=sent, at=self.now())
        if not succeeded:
            side.leases = {k: v for k, v in side.leases.items() if v != run_id}

    async def reconnect(self, side: Side) -> None:
        """Register again: the same hostInstanceId, or now and then a new one."""
        if self.rng.random() < 0.15:
            side.hid = f"hi-{self.tag()}"
        side.tools = []
        await self.connect(side)

    async def disconnect(self, side: Side) -> None:
        conn = side.conn
        if conn is None:
            return
        side.conn, side.tools = None, []
        await self.call("disconnect", lambda: self.engine.disconnect(conn))
        await asyncio.sleep(self.rng.uniform(0.0, 0.1))
        await self.connect(side)
