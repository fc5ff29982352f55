"""A deterministic demo agent: it thinks in steps, emits text and tool events over
time, obeys steers, and picks up where it left off after a host restart: each step is
journaled (``ctx.step``), so a resumed run repeats none it had finished."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

from delegation.run.context import ChildContext, Recovery, Run
from delegation.wire import Event, Identity, Preset, Request

DELAY_ENV = "DELEGATION_SCRIPTED_DELAY"


class ScriptedRunner:
    """``steps`` steps of ``delay`` seconds each; a message asking for a number of steps
    ("in 8 steps") overrides ``steps`` (see :func:`steps_asked`)."""

    def __init__(self, steps: int = 6, delay: float | None = None) -> None:
        self.steps = steps
        # The demo sets the pace of the hosts it starts through the environment.
        self.delay = delay if delay is not None else float(os.environ.get(DELAY_ENV, "0.4"))

    @classmethod
    def from_file(cls, path: Path) -> ScriptedRunner:
        import tomllib

        settings: dict[str, Any] = tomllib.loads(path.read_text()).get("scripted", {})
        return cls(**settings)

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        steps = steps_asked(request.message, self.steps)
        delay = self.delay

        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            # Each step is journaled (design §15): a resumed run gets the finished ones
            # back without doing them again, and continues from the first unfinished.
            done = 0 if recovery is None else min(steps, recovery.steps)
            if recovery is not None:
                ctx.emit(Event(kind="text", text=f"picking up after step {done} of {steps}"))
            heading = request.message
            for step in range(1, steps + 1):
                if step == done + 1 and recovery is not None and recovery.delivered_steers:
                    # The heading an earlier attempt was last steered to survives.
                    heading = recovery.delivered_steers[-1]
                if step > done:
                    for steer in ctx.take_steers():
                        heading = steer
                        ctx.emit(Event(kind="text", text=f"steered: {steer}"))
                heading = await ctx.step(f"step {step}", _think, ctx, step, steps, heading, delay)
            ctx.emit(Event(kind="result", text=f"finished {steps} steps on {heading}"))

        return run


def steps_asked(message: str, default: int) -> int:
    """How many steps a message asks for: the number before "step(s)" ("task 0 in 30
    steps" is 30), else its only number, else ``default``; at least one, at most 1,000."""
    asked = re.search(r"(\d+)\s*steps?\b", message)
    numbers = re.findall(r"\d+", message)
    if asked is not None:
        wanted = int(asked.group(1))
    elif len(numbers) == 1:
        wanted = int(numbers[0])
    else:
        wanted = default
    return min(max(wanted, 1), 1000)


async def _think(ctx: ChildContext, step: int, steps: int, heading: str, delay: float) -> str:
    """One step: it takes ``delay`` seconds, then says what it did (two events, recorded
    with the step) and returns the heading it kept."""
    await asyncio.sleep(delay)
    ctx.emit(Event(kind="text", text=f"step {step}/{steps}: thinking about {heading}"))
    ctx.emit(
        Event(
            kind="tool",
            tool_name="notes",
            tool_call_id=f"step-{step}",
            input=f"step {step}",
            tool_output=f"noted step {step}",
            success=True,
        )
    )
    return heading
