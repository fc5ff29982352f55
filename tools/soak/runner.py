"""The soak's runner: runs that follow the plan their request names, emit events whose
text names their sequence and the host instance that wrote them (``t7@h-…``), and
journal every range they flushed and every steer they took
(:mod:`tools.soak.journal`).

Some runs make the other store calls a run can make: ``steps`` runs take named steps
(``ctx.step``), read one back (``ctx.recorded``) and sleep durably (``ctx.sleep``), and
``hold`` runs take a step now and then. A step's value names the attempt and the host
instance that ran it, and every value a step returned is journaled: a resumed run must
get back what an earlier attempt recorded, never run the step again. A run that raises
journals what it raised and where, in the runner and in the library (``end``'s ``error``
and ``where``), for the details of a child that ended with a store error.
"""

from __future__ import annotations

import asyncio
import os
import random
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

from delegation.run.context import ChildContext, NotResumable, Recovery, Run
from delegation.wire import Event, Identity, Preset, Request
from tools.soak.journal import Journal

PLANNED_FAILURE = "planned failure"
PREPARE_FAILURE = "planned prepare failure"
PLANS = (
    "quick", "quick", "fail", "hold", "hold", "steer", "slow", "noadmit", "prefail", "steps",
    "steps",
)  # fmt: skip


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
            await self._run(ctx, plan, int(count.split()[0]), Steps(ctx, out, attempt))

        return run

    async def _run(self, ctx: ChildContext, plan: str, n: int, steps: Steps) -> None:
        out, attempt = steps.out, steps.attempt
        run_id, who = out.run_id, out.who
        if self.live[run_id]:
            self.journal.bad(f"twice: child {run_id} started while its run still executes")
        self.live[run_id] += 1
        self.owners[run_id] = who
        self.journal.write("run", run=run_id, attempt=attempt, who=who)
        how, raised = "returned", {}
        try:
            await self._plan(ctx, plan, n, steps)
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except Exception as exc:
            how, raised = "raised", _raised(exc)
            raise
        finally:
            self.live[run_id] -= 1
            if not self.live[run_id]:
                del self.live[run_id]
                self.owners.pop(run_id, None)
            self.journal.write("end", run=run_id, attempt=attempt, how=how, who=who, **raised)

    async def _plan(self, ctx: ChildContext, plan: str, n: int, steps: Steps) -> None:
        rng, out = self.rng, steps.out
        if plan == "noadmit":
            return
        if plan == "slow":
            await asyncio.sleep(rng.uniform(0.0, 0.3))
        await ctx.admit()
        if plan in ("hold", "steer"):
            await self._hold(ctx, steps, steers_wanted=n if plan == "steer" else None)
        elif plan == "steps":
            await self._steps(ctx, steps, n)
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

    async def _steps(self, ctx: ChildContext, steps: Steps, n: int) -> None:
        """``n`` steps, each after an event and read back; a durable nap among them."""
        nap = n // 2  # where a resumed run naps too
        for i in range(n):
            steps.out.emit()
            if i == nap:
                await ctx.sleep("nap", self.rng.uniform(0.0, 0.2))
            await steps.take(f"s{i}", self.rng.uniform(0.0, 0.1))
            await steps.read_back(f"s{i // 2}")
        await steps.out.flush()

    async def _hold(self, ctx: ChildContext, steps: Steps, steers_wanted: int | None) -> None:
        """Emit now and then, take steers; now and then take a step, read one back or
        nap; until cancelled, or ``steers_wanted`` arrived."""
        out = steps.out
        taken = stepped = rounds = 0
        while steers_wanted is None or taken < steers_wanted:
            rounds += 1
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
            chance = self.rng.random()
            if chance < 0.25:
                await steps.take(f"h{stepped}", self.rng.uniform(0.0, 0.05))
                stepped += 1
            elif chance < 0.5 and stepped:
                await steps.read_back(f"h{self.rng.randrange(stepped)}")
            elif chance < 0.6:
                await ctx.sleep(f"n{rounds}", self.rng.uniform(0.0, 0.05))


class Steps:
    """A run's steps (``ctx.step``, ``ctx.recorded``), each value journaled as returned."""

    def __init__(self, ctx: ChildContext, out: Emitter, attempt: int) -> None:
        self.ctx, self.out, self.attempt = ctx, out, attempt
        self.values: dict[str, Any] = {}

    async def take(self, name: str, lasts_s: float) -> None:
        """Step ``name``: an effect that lasts ``lasts_s`` and names this attempt and
        its host instance; a resumed run gets an earlier attempt's value back."""

        async def effect() -> dict[str, Any]:
            await asyncio.sleep(lasts_s)
            return {"attempt": self.attempt, "who": self.out.who}

        value = await self.ctx.step(name, effect)
        self.values[name] = value
        self.out.journal.write(
            "step", run=self.out.run_id, name=name, attempt=self.attempt, value=value
        )

    async def read_back(self, name: str) -> None:
        """``ctx.recorded(name)`` is what the step returned."""
        found = await self.ctx.recorded(name)
        if found != self.values.get(name):
            self.out.journal.bad(
                f"recorded: child {self.out.run_id} step {name} reads {found!r},"
                f" returned {self.values.get(name)!r}"
            )


def _raised(exc: BaseException) -> dict[str, str]:
    """What a run raised, and where: the runner's last line on the way (the call it
    made), the library's first line after it (the API it called) and the line that
    raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    last_ours = max((i for i, f in enumerate(frames) if f.filename == __file__), default=-1)
    after = list(frames[last_ours + 1 :])
    chosen = list(frames[last_ours : last_ours + 1]) + after[:1]
    if len(after) > 1:
        chosen.append(after[-1])
    where = [
        f"{os.path.basename(f.filename)}:{f.lineno} {f.name}: {(f.line or '').strip()}"
        for f in chosen
    ]
    return {"error": f"{type(exc).__name__}: {exc}", "where": " -> ".join(where)}
