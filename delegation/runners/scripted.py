"""A deterministic demo agent: it thinks in steps, emits text and tool events over
time, obeys steers, and picks up where it left off after a host restart."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

from delegation.runs import ChildContext, Recovery, Run
from delegation.wire import Event, Identity, Preset, Request

EVENTS_PER_STEP = 2
DELAY_ENV = "DELEGATION_SCRIPTED_DELAY"


class ScriptedRunner:
    """``steps`` steps of ``delay`` seconds each; a number in the message overrides ``steps``."""

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
        number = re.search(r"\d+", request.message)
        steps = int(number.group()) if number else self.steps
        # Each step leaves two events, so the last committed sequence says how far it got.
        done = (
            0 if recovery is None else min(steps, (recovery.last_sequence - 1) // EVENTS_PER_STEP)
        )
        delay = self.delay

        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            if recovery is not None:
                ctx.emit(Event(kind="text", text=f"picking up after step {done} of {steps}"))
            heading = request.message
            if recovery is not None and recovery.delivered_steers:
                # The heading an earlier attempt was steered to survives the restart.
                heading = recovery.delivered_steers[-1]
            for step in range(done + 1, steps + 1):
                for steer in ctx.take_steers():
                    heading = steer
                    ctx.emit(Event(kind="text", text=f"steered: {steer}"))
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
                await ctx.flush()
                await asyncio.sleep(delay)
            ctx.emit(Event(kind="result", text=f"finished {steps} steps on {heading}"))

        return run
