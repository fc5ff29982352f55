"""``admit_queued`` of :mod:`tools.bench` (design §22): a queue admitted as slots free.

One preset has an admission policy of ``CONCURRENCY`` slots. ``n`` children are started
with ``start_wait_s`` 0: the first ``CONCURRENCY`` take the slots and hold them, the rest
are queued (each start answers ``queued: true`` at once). Then the held runs return, and
the figure is how fast the whole queue is admitted after them: each admission is the
pump's turn (``queued`` → ``admitted``, slots counted under the policy's lock), the run's
``prepare`` and ``admit`` (→ ``running``), and its end, which frees the slot for the
next. Beside raw single-row commits of the same count, in the same run.
"""

from __future__ import annotations

import asyncio
import time

from delegation import AdmissionPolicy, Preset, Request
from delegation.run.context import ChildContext, Recovery, Run
from delegation.wire import Identity
from tools.bench_base import PRESET, Bench, Runner, starter_of

CONCURRENCY = 64
SCOPE = f"preset:bench-runner/{PRESET.extension_id}/{PRESET.name}"


class Gated(Runner):
    """Each run admits, then waits for the gate (open: returns at once); the runs that
    got past ``admit`` are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.admitted = 0
        self.all_in = asyncio.Event()
        self.expected = 0

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            self.admitted += 1
            if self.admitted == self.expected:
                self.all_in.set()
            await self.gate.wait()

        return run


async def admit_queued(bench: Bench, n: int) -> dict[str, float]:
    runner = Gated()
    runner.expected = n
    engine = await bench.engine(bench.new(), runner, start_wait_s=0.0)
    await engine.set_admission(SCOPE, AdmissionPolicy(concurrency=CONCURRENCY, max_queued=n))
    starter = await starter_of(engine)
    for base in range(0, n, 500):
        await asyncio.gather(*(starter.start(f"q{i}") for i in range(base, min(n, base + 500))))
    queued = await engine.list_children(state="queued", limit=n + 1)
    assert len(queued) == n - CONCURRENCY, f"{len(queued)} queued of {n}"
    began = time.perf_counter()
    runner.gate.set()
    await runner.all_in.wait()
    while len(engine._supervisor.runs):  # the last runs end (their slots free)
        await asyncio.sleep(0.001)
    rate = (n - CONCURRENCY) / (time.perf_counter() - began)
    await engine.close()
    raw = bench.raw_commits(n)
    return {"engine": round(rate, 1), "raw": round(raw, 1), "ratio": round(rate / raw, 3)}
