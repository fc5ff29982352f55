"""``ChildContext.wait_steer`` and cancellation: a run cancelled in the very turn a steer
is delivered stops (the steer stays queued for whoever runs next); on Python 3.11,
``asyncio.wait_for`` returned the steer instead and the cancelled run went on."""

from __future__ import annotations

import asyncio

from delegation import Preset, Request
from delegation.run.context import ChildContext
from tests.harness.support import identity


class Hooks:
    """The engine's side, doing nothing but note which steers were taken."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    async def admit(self) -> None:
        return None

    def append(self, sequence: int, body: bytes, output: str | None) -> None:
        return None

    async def flush(self) -> None:
        return None

    def delivered(self, steer_ids: list[int]) -> None:
        self.taken.extend(steer_ids)

    async def record_process(self, pid: int) -> None:
        return None


def _context(hooks: Hooks) -> ChildContext:
    return ChildContext(
        identity=identity(),
        request=Request(request_id="q1", profile="worker", message="go"),
        preset=Preset(name="worker", extension_id="ext", generation=1),
        cwd="/",
        recovery=None,
        last_sequence=0,
        max_field_bytes=1024,
        hooks=hooks,
    )


async def test_a_run_cancelled_as_its_steer_arrives_stops_and_the_steer_waits() -> None:
    hooks = Hooks()
    ctx = _context(hooks)
    waiting = asyncio.create_task(ctx.wait_steer(timeout=30))
    for _ in range(3):  # into the wait
        await asyncio.sleep(0)
    ctx.deliver(1, "turn left")
    waiting.cancel()
    done, _ = await asyncio.wait({waiting}, timeout=5)
    assert done == {waiting} and waiting.cancelled()
    assert ctx.steers_waiting == 1 and hooks.taken == []
    assert await ctx.wait_steer(timeout=1) == "turn left"  # taken by the next wait
    assert hooks.taken == [1]


async def test_a_steer_wait_times_out_with_none_and_takes_a_steer_that_came() -> None:
    ctx = _context(Hooks())
    assert await ctx.wait_steer(timeout=0.01) is None
    ctx.deliver(2, "again")
    ctx.deliver(2, "again")  # each steer id at most once
    assert await ctx.wait_steer(timeout=0) == "again"
    assert ctx.steers_waiting == 0
