"""Runners for serve tests, loaded by a host subprocess:
``--runner tests.harness.serve_runners:X``."""

from __future__ import annotations

import asyncio
import json
import re

from delegation import ChildContext, Event, Identity, Preset, Recovery, Request
from delegation.run.context import Run


def number_in(message: str) -> float:
    """The first number a child's message names (0 if none)."""
    found = re.search(r"\d+(\.\d+)?", message)
    return float(found.group()) if found else 0.0


class SlowAdmit:
    """Each child waits the seconds its message names ("admit after 0.5") before its
    admission, so a ``child.start`` stays in flight that long."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        delay = number_in(request.message)

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


class Chatty:
    """Each child emits the events its message counts, each 1,000 characters long
    ("emit 300"), and ends, or with "and wait" ends after the steer ``bye``."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        count = int(number_in(request.message))

        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            for n in range(count):
                ctx.emit(Event(kind="text", text=f"{n:<1000}"))
            if "and wait" in request.message:
                while await ctx.wait_steer() != "bye":
                    pass

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


class LargeAnswers:
    """Children whose answers are as large as a host may send: the message "events"
    emits 140 events with every field over its cap of control characters (each escaped
    to six bytes on the wire); "output" ends with a result of 6 MiB of them, which a
    child's ``output`` keeps whole (36 MiB once escaped)."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            if request.message == "output":
                ctx.emit(Event(kind="result", text="\x01" * OUTPUT_CHARS))
                return
            field, name = "\x01" * 64 * 1024, "\x01" * 2048
            for _ in range(140):
                ctx.emit(
                    Event(kind=name, text=field, tool_name=name, tool_call_id=name,
                          input=field, tool_output=field, error=field)
                )  # fmt: skip

        return run


OUTPUT_CHARS = 6 * 1024 * 1024


class Waiter:
    """Each child waits for the event ``go`` and ends with its payload as JSON."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            sent = await ctx.wait_event("go", "go")
            ctx.emit(Event(kind="result", text=json.dumps(sent)))

        return run
