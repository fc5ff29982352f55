"""``waiting_100k`` of :mod:`tools.bench` (design §21): many children that asked a person
and were suspended, what they cost the host, and how fast an answer resumes one.

Every child asks (``ctx.ask``) at once; past a short ``hold_s`` the engine suspends it:
state ``waiting``, its task ended. The host's RSS and its asyncio tasks are read once
``small`` children wait and again once ``large`` do (after a ``gc.collect()``), so the
growth is what the extra children cost. Then children are answered one at a time with
``engine.answer_input``: from the call to the run's code after its ``ask`` (a wake is a
resume: the state back to admitted, a ``recovery`` event, ``prepare`` again, the
journal's replay to the ask), beside a plain ``child.start`` (its call, answered once
the child is admitted) in the same engine.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from delegation import Engine, Preset, Request
from delegation.run.context import ChildContext, Recovery, Run
from delegation.wire import Identity
from tools.bench_base import Bench, Runner, median, rss_mb, starter_of

HOLD_S = 0.05  # suspended this soon after asking (the default is 30 s)


class Asker(Runner):
    """Each child admits and asks; the time its ask returned is kept by conversation."""

    def __init__(self) -> None:
        super().__init__()
        self.resumed: dict[str, float] = {}

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            await ctx.ask("go", "go on?")
            self.resumed[identity.conversation_id] = time.perf_counter()

        return run


async def _all_suspended(engine: Engine) -> None:
    """Until no run is left in this process: every child asked and was suspended."""
    while len(engine._supervisor.runs):
        await asyncio.sleep(0.05)


async def waiting(bench: Bench, small: int, large: int, answers: int) -> dict[str, Any]:
    runner = Asker()
    engine = await bench.engine(bench.new(), runner, hold_s=HOLD_S)
    starter = await starter_of(engine)
    started: list[str] = []

    async def start(stop: int) -> None:
        for base in range(len(started), stop, 500):
            batch = range(base, min(stop, base + 500))
            results = await asyncio.gather(*(starter.start(f"q{i}") for i in batch))
            started.extend(result.conversation_id for result in results)
        await _all_suspended(engine)

    await start(small)
    gc.collect()
    rss_small, tasks_small = rss_mb(), len(asyncio.all_tasks())
    began = time.perf_counter()
    await start(large)
    suspend_rate = (large - small) / (time.perf_counter() - began)
    gc.collect()
    rss_large, tasks_large = rss_mb(), len(asyncio.all_tasks())
    waiting_now = await engine.list_children(state="waiting", limit=large + 1)
    assert len(waiting_now) == large, f"{len(waiting_now)} of {large} children wait"

    resumes = []
    for conversation_id in started[:answers]:
        sent = time.perf_counter()
        await engine.answer_input(conversation_id, "go", text="yes")
        while conversation_id not in runner.resumed:
            await asyncio.sleep(0.0005)
        resumes.append((runner.resumed[conversation_id] - sent) * 1000)
    starts = []
    for i in range(answers):
        sent = time.perf_counter()
        await starter.start(f"plain-{i}")
        starts.append((time.perf_counter() - sent) * 1000)
    await engine.close()
    grown = rss_large - rss_small
    return {
        "children": large,
        "rss_growth_mb": round(grown, 1),
        "bytes_per_child": round(grown * 2**20 / (large - small)),
        "tasks_held": tasks_large - tasks_small,
        "suspended_per_s": round(suspend_rate),
        "resume_ms": _quantiles(resumes),
        "start_ms": _quantiles(starts),
    }


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {"median": round(median(ordered), 2), "p99": round(p99, 2)}
