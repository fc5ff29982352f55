"""The soak's runner: runs that follow the plan their request names, emit events whose
text names their sequence and the host instance that wrote them (``t7@h-…``), and
journal every range they flushed and every steer they took
(:mod:`tools.soak.journal`)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable

from delegation.runs import ChildContext, NotResumable, Recovery, Run
from delegation.wire import Event, Identity, Preset, Request
from tools.soak.journal import Journal

PLANNED_FAILURE = "planned failure"
PREPARE_FAILURE = "planned prepare failure"
PLANS = ("quick", "quick", "fail", "hold", "hold", "steer", "slow", "noadmit", "prefail")


def event_text(kind: str, sequence: int, who: str) -> str:
    """The text the soak's runs give an event: its kind's initial, its sequence and the
    host instance that wrote it (none in a database a test wrote)."""
    return f"{kind[:1]}{sequence}@{who}" if who else f"{kind[:1]}{sequence}"


class Emitter:
    """Emits events whose text names their sequence and writer, and journals each
    flushed range."""

    def __init__(
        self, ctx: ChildContext, journal: Journal, run_id: str, last: int, who: str
    ) -> None:
        self.ctx, self.journal, self.run_id, self.who = ctx, journal, run_id, who
        self.next = last + 1
        self.acked = last

    def emit(self, kind: str = "text") -> None:
        sequence = self.ctx.emit(Event(kind=kind, text=event_text(kind, self.next, self.who)))
        if sequence != self.next:
            self.journal.bad(f"emit: child {self.run_id} got sequence {sequence}, not {self.next}")
        self.next = sequence + 1

    async def flush(self) -> None:
        await self.ctx.flush()
        if self.next - 1 > self.acked:
            self.journal.write(
                "ev", run=self.run_id, a=self.acked + 1, b=self.next - 1, who=self.who
            )
            self.acked = self.next - 1


class SoakRunner:
    """Runs follow the plan named in the request message: ``<plan> <n>``. ``owner``
    names the host instance that runs them (the engine's, when the run is prepared)."""

    def __init__(self, journal: Journal, rng: random.Random, owner: Callable[[], str]) -> None:
        self.journal = journal
        self.rng = rng
        self.owner = owner
        self.live: Counter[str] = Counter()  # run id -> runs executing it in this process
        self.owners: dict[str, str] = {}  # run id -> the instance its last run is under

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        plan, _, count = request.message.partition(" ")
        if plan == "prefail":
            raise RuntimeError(PREPARE_FAILURE)
        if recovery is not None and self.rng.random() < 0.15:
            raise NotResumable()
        attempt = recovery.attempt if recovery is not None else 0
        last = recovery.last_sequence if recovery is not None else 0
        who = self.owner()

        async def run(ctx: ChildContext) -> None:
            out = Emitter(ctx, self.journal, identity.run_id, last, who)
            await self._run(ctx, plan, int(count.split()[0]), attempt, out)

        return run

    async def _run(self, ctx: ChildContext, plan: str, n: int, attempt: int, out: Emitter) -> None:
        run_id, who = out.run_id, out.who
        if self.live[run_id]:
            self.journal.bad(f"twice: child {run_id} started while its run still executes")
        self.live[run_id] += 1
        self.owners[run_id] = who
        self.journal.write("run", run=run_id, attempt=attempt, who=who)
        how = "returned"
        try:
            await self._plan(ctx, plan, n, out)
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except Exception:
            how = "raised"
            raise
        finally:
            self.live[run_id] -= 1
            if not self.live[run_id]:
                del self.live[run_id]
                self.owners.pop(run_id, None)
            self.journal.write("end", run=run_id, attempt=attempt, how=how, who=who)

    async def _plan(self, ctx: ChildContext, plan: str, n: int, out: Emitter) -> None:
        rng = self.rng
        if plan == "noadmit":
            return
        if plan == "slow":
            await asyncio.sleep(rng.uniform(0.0, 0.3))
        await ctx.admit()
        if plan in ("hold", "steer"):
            await self._hold(ctx, out, steers_wanted=n if plan == "steer" else None)
        else:
            for _ in range(n):
                out.emit()
                if rng.random() < 0.3:
                    await out.flush()
                    await asyncio.sleep(rng.uniform(0.0, 0.05))
            await out.flush()
            if plan == "fail":
                raise RuntimeError(PLANNED_FAILURE)
        out.emit("result")
        await out.flush()

    async def _hold(self, ctx: ChildContext, out: Emitter, steers_wanted: int | None) -> None:
        """Emit now and then, take steers; until cancelled, or ``steers_wanted`` arrived."""
        taken = 0
        while steers_wanted is None or taken < steers_wanted:
            if steers_wanted is None:
                await asyncio.sleep(self.rng.uniform(0.05, 0.3))
                messages = ctx.take_steers()
            else:
                message = await ctx.wait_steer(0.5)
                messages = [] if message is None else [message]
            for message in messages:
                self.journal.write(
                    "took", run=ctx.identity.run_id, req=message.split()[-1], who=out.who
                )
                taken += 1
            out.emit()
            await out.flush()
