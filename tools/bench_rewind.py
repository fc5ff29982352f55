"""``rewind_copy`` of :mod:`tools.bench` (design §35): a rewind's copy of a long run.

One child under a lease records ``steps`` small steps, each followed by an emit, and
ends. Then ``engine.rewind_child`` rewinds it with no step, so every step is copied
(with the events committed with them), ``REPEATS`` times, each after the previous
rewound execution ended. A rewound run admits and ends without replaying anything, so
the time of the call is the reservation with its copy (a few ``INSERT … SELECT`` in
the one transaction), the new execution's spawn and its admission. The median is
returned as steps copied per second (:mod:`tools.bench` puts it beside raw single-row
commits in the same run).
"""

from __future__ import annotations

import asyncio
import time

from delegation import Engine, Event, Preset, Request
from delegation.run.context import ChildContext, Recovery, Run
from delegation.wire import Identity
from tools.bench_base import Bench, Runner, median, starter_of

REPEATS = 5
LEASE = "L-rewind"


class Recorder(Runner):
    """A first run records ``steps`` steps, emitting after each; a rewound run admits
    and ends. Each rewound run's ``Recovery`` is kept."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.recoveries: list[Recovery] = []

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        async def small(i: int) -> dict[str, int]:
            return {"turn": i}

        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            if recovery is not None:
                self.recoveries.append(recovery)
                return
            for i in range(self.steps):
                await ctx.step(f"s{i}", small, i)
                ctx.emit(Event(kind="text", text=f"s{i} done"))

        return run


async def _ended(engine: Engine, conversation_id: str, run_id: str) -> None:
    """Until the execution ``run_id`` of the conversation is terminal, and done."""
    while (record := await engine.get_child(conversation_id, run_id)) is None or not (
        record.terminal
    ):
        await asyncio.sleep(0.001)
    assert (record.state, record.error) == ("done", ""), (record.state, record.error)


async def rewind_copy(bench: Bench, steps: int) -> float:
    """Steps copied per second: ``steps`` over the median time of a rewind."""
    runner = Recorder(steps)
    engine = await bench.engine(bench.new(), runner)
    source = await (await starter_of(engine)).start("q-rewind", lease=LEASE)
    conversation_id = source.conversation_id
    await _ended(engine, conversation_id, source.run_id)
    timings = []
    for n in range(REPEATS):
        began = time.perf_counter()
        rewound = await engine.rewind_child(
            conversation_id, run_id=source.run_id, request_id=f"rw-{n}"
        )
        timings.append(time.perf_counter() - began)
        await _ended(engine, conversation_id, rewound.run_id)
    # A broken copy fails the bench rather than printing a fast figure: each rewound
    # execution's first run was told what its rows in the store hold, every step and the
    # events committed with them (the emits after the first steps-1 steps: the last one
    # came after the last step), then its ``rewind`` event.
    held = [(r.reason, r.steps, r.last_sequence) for r in runner.recoveries]
    assert held == [("rewind", steps, steps)] * REPEATS, held
    await engine.close()
    return steps / median(timings)
