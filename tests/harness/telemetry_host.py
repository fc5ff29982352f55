"""A traced host process for the telemetry crash test: it starts one leased child under
OpenTelemetry's SDK (spans kept in memory), says which spans it saw, and waits to be
killed (the test sends SIGKILL: nothing is flushed or exported after that).

    python -m tests.harness.telemetry_host DB_URL WORKSPACE

It prints ``START <trace id> <span id> <conversation id>`` (the ``child.start`` span, ended
and exported once start answered) and ``RUNNING <trace id> <span id> <parent span id>``
(the ``child.execution`` span the run executes in, which no exporter ever sees).
"""

from __future__ import annotations

import asyncio
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from delegation import ChildContext, Engine, EngineConfig, Event, Params, Preset, Request
from tests.harness.crash_host import LEASE, OWNER, begin

REQUEST = Request(request_id="q-traced", profile="worker", message="work", lease_id=LEASE)


def say(line: str) -> None:
    print(line, flush=True)


class HoldingRunner:
    async def prepare(self, request: Request, preset: Preset, identity: object, recovery: object):  # type: ignore[no-untyped-def]
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="working"))
        await ctx.flush()
        span = trace.get_current_span()
        assert isinstance(span, ReadableSpan) and span.parent is not None
        context = span.get_span_context()
        say(f"RUNNING {context.trace_id:032x} {context.span_id:016x} {span.parent.span_id:016x}")
        await asyncio.sleep(3600)


async def main(url: str, workspace: str) -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(spans))
    engine = Engine(url, runner=HoldingRunner(), config=EngineConfig(), tracer_provider=provider)
    conn = await begin(engine, workspace)
    result = await engine.start(
        conn, Params(**OWNER, generation=7, lease_id=LEASE, request=REQUEST)
    )
    (start,) = [s for s in spans.get_finished_spans() if s.name == "child.start"]
    context = start.get_span_context()
    say(f"START {context.trace_id:032x} {context.span_id:016x} {result.conversation_id}")
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
