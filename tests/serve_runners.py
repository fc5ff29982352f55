"""Runners for serve tests, loaded by a host subprocess: ``--runner tests.serve_runners:X``."""

from __future__ import annotations

import asyncio
import re

from delegation import ChildContext, Event, Identity, Preset, Recovery, Request
from delegation.runs import Run


class SlowAdmit:
    """Each child waits the seconds its message names ("admit after 0.5") before its
    admission, so a ``child.start`` stays in flight that long."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        found = re.search(r"\d+(\.\d+)?", request.message)
        delay = float(found.group()) if found else 0.0

        async def run(ctx: ChildContext) -> None:
            await asyncio.sleep(delay)
            await ctx.admit()
            ctx.emit(Event(kind="result", text=f"admitted after {delay}"))

        return run


class Echo:
    """Each child says ``ready``, then ``heard: <steer>`` for each steer it is handed,
    and ends after the steer ``bye``: a child that emits exactly when its test steers it."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            ctx.emit(Event(kind="text", text="ready"))
            heard = ""
            while heard != "bye":
                heard = await ctx.wait_steer() or ""
                ctx.emit(Event(kind="text", text=f"heard: {heard}"))
            ctx.emit(Event(kind="result", text="bye"))

        return run


async def streaming(ctx: ChildContext) -> None:
    """A run that emits and flushes an event every 20 ms until it is stopped."""
    await ctx.admit()
    while True:
        ctx.emit(Event(kind="text", text="tick"))
        await ctx.flush()
        await asyncio.sleep(0.02)


class Streaming:
    """Each child is :func:`streaming`."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        return streaming
