"""OpenTelemetry (design §13): spans per child method call and per execution, linked
across restarts through the stored trace context, and the engine's metrics.

Every engine here gets its own SDK providers (``Engine(tracer_provider=...,
meter_provider=...)``) with the SDK's in-memory span exporter and metric reader: the
global providers can be set only once per process, and none of these tests needs them.
The engine, the store and the migrations are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from delegation import ChildContext, Engine, EngineConfig, Event, errors
from delegation.clock import ManualClock
from delegation.engine import telemetry
from tests.harness.otel import Otel
from tests.harness.rows import scalar
from tests.harness.support import Harness, ScriptRunner, finish_after_admit, hold, open_harness

LEASE = "lease-1"
ROOT = Path(__file__).parents[2]


@pytest.fixture
def otel() -> Iterator[Otel]:
    made = Otel.make()
    yield made
    made.shutdown()


@pytest.fixture
async def traced(
    db_url: str,
    runner: ScriptRunner,
    config: EngineConfig,
    clock: ManualClock,
    workspace: Path,
    otel: Otel,
) -> AsyncIterator[Harness]:
    engine = Engine(db_url, runner=runner, config=config, clock=clock, **otel.providers())
    async with engine:
        yield await open_harness(engine, runner, workspace)


def traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def stored_trace_context(db_url: str, conversation_id: str) -> Any:
    sql = "SELECT trace_context FROM children WHERE conversation_id = :c"
    return scalar(db_url, sql, {"c": conversation_id})


# --- spans of the child methods --------------------------------------------------------


async def test_each_child_method_call_is_a_span_with_the_childs_attributes(
    traced: Harness, otel: Otel, db_url: str
) -> None:
    gate = asyncio.Event()
    traced.runner.script = hold(gate)
    host = otel.tracer_provider.get_tracer("host")
    with host.start_as_current_span("host.turn") as turn:
        started = await traced.start()
    child = started.conversation_id
    read = await traced.read(child)
    steer = traced.params(child_id=child, request_id="s1", message="left")
    assert (await traced.engine.steer(traced.conn, steer)).outcome == "injected"
    await traced.engine.cancel(traced.conn, traced.params(child_id=child))

    (start,) = otel.finished("child.start")
    assert start.parent is not None
    assert start.parent.span_id == turn.get_span_context().span_id  # the host's span
    assert start.attributes is not None
    assert dict(start.attributes) == {
        "rpc.method": "child.start",
        "delegation.extension": "ext",
        "delegation.parent_run_id": "parent-run",
        "delegation.profile": "worker",
        "delegation.conversation_id": child,
        "delegation.run_id": started.run_id,
        "delegation.outcome": "running",
    }
    assert start.status.status_code is StatusCode.UNSET
    (read_span,) = otel.finished("child.read")
    assert read_span.attributes is not None
    assert read_span.attributes["delegation.conversation_id"] == child
    assert read_span.attributes["delegation.run_id"] == read.run_id
    assert read_span.attributes["delegation.outcome"] == "running"
    (steer_span,) = otel.finished("child.steer")
    assert steer_span.attributes is not None
    assert steer_span.attributes["delegation.outcome"] == "injected"
    assert otel.finished("child.cancel")
    (execution,) = await otel.span("child.execution")
    assert execution.attributes is not None
    assert execution.attributes["delegation.outcome"] == "cancelled"
    # The stored trace context is the start's: every attempt's parent.
    assert stored_trace_context(db_url, child) == traceparent(start)


async def test_a_refused_call_is_an_error_span_with_its_reason(traced: Harness, otel: Otel) -> None:
    with pytest.raises(errors.ChildNotOwned):
        await traced.read("c-someone-elses")
    with pytest.raises(errors.MalformedInput):  # decoding is part of the call
        await traced.engine.start(traced.conn, {"runId": "r", "apiKey": "sk-1"})

    read, start = otel.finished("child.read") + otel.finished("child.start")
    for span, error in ((read, errors.ChildNotOwned), (start, errors.MalformedInput)):
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes is not None
        assert span.attributes["error.type"] == error.reason
        assert span.attributes["rpc.jsonrpc.error_code"] == -32602
        assert span.attributes["delegation.outcome"] == "error"
    assert read.attributes is not None
    assert read.attributes["delegation.conversation_id"] == "c-someone-elses"
    assert not otel.finished("child.execution")


# --- spans of executions -----------------------------------------------------------------


async def test_an_execution_is_a_span_under_its_start_until_it_is_terminal(
    traced: Harness, otel: Otel
) -> None:
    started = await traced.start()
    (execution,) = await otel.span("child.execution")
    (start,) = otel.finished("child.start")
    assert execution.parent is not None
    assert execution.parent.span_id == start.get_span_context().span_id
    assert execution.get_span_context().trace_id == start.get_span_context().trace_id
    assert not execution.links
    assert execution.attributes is not None
    assert dict(execution.attributes) == {
        "delegation.conversation_id": started.conversation_id,
        "delegation.run_id": started.run_id,
        "delegation.parent_run_id": "parent-run",
        "delegation.extension": "ext",
        "delegation.profile": "worker",
        "delegation.recovery.attempt": 0,
        "delegation.outcome": "done",
    }
    assert execution.start_time is not None and start.start_time is not None
    assert execution.end_time is not None and start.end_time is not None
    assert start.start_time < execution.start_time  # begun in the start, ended after it
    record = await traced.engine.get_child(started.conversation_id)
    assert record is not None and record.trace_context == traceparent(start)


async def test_the_runners_own_spans_are_children_of_the_execution(
    traced: Harness, otel: Otel
) -> None:
    runner_tracer = otel.tracer_provider.get_tracer("runner")

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        with runner_tracer.start_as_current_span("llm.call"):
            ctx.emit(Event(kind="result", text="answered"))

    traced.runner.script = run
    await traced.start()
    (execution,) = await otel.span("child.execution")
    (call,) = otel.finished("llm.call")
    assert call.parent is not None
    assert call.parent.span_id == execution.get_span_context().span_id


async def test_a_failed_run_ends_its_span_failed_with_its_error(
    traced: Harness, otel: Otel
) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        raise RuntimeError("the model went away")

    traced.runner.script = run
    await traced.start()
    (execution,) = await otel.span("child.execution")
    assert execution.attributes is not None
    assert execution.attributes["delegation.outcome"] == "failed"
    assert execution.status.status_code is StatusCode.ERROR
    assert execution.status.description == "the model went away"
    assert otel.total(telemetry.FINISHED, outcome="failed") == 1


# --- metrics ---------------------------------------------------------------------------


async def test_metrics_count_children_events_and_commits(traced: Harness, otel: Otel) -> None:
    gate = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for step in range(5):
            ctx.emit(Event(kind="text", text=f"step {step}"))
        await ctx.flush()
        await gate.wait()

    traced.runner.script = run
    first = await traced.start("q1")
    await traced.start("q2")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while otel.total(telemetry.EVENTS) < 10:  # counted once committed
        assert loop.time() < deadline, otel.metrics()
        await asyncio.sleep(0.01)
    assert otel.total(telemetry.STARTED) == 2
    assert otel.total(telemetry.ACTIVE) == 2
    await traced.engine.cancel(traced.conn, traced.params(child_id=first.conversation_id))
    gate.set()
    await otel.span("child.execution", count=2)
    assert otel.total(telemetry.ACTIVE) == 0
    assert otel.total(telemetry.FINISHED, outcome="cancelled") == 1
    assert otel.total(telemetry.FINISHED, outcome="done") == 1
    assert otel.total(telemetry.FINISHED) == 2
    assert otel.total(telemetry.EVENTS) == 10
    commits = otel.metrics()[telemetry.COMMIT_DURATION]
    assert commits.unit == "s"
    (point,) = commits.data.data_points
    assert point.count >= 4  # two reservations, two admissions, events, two ends ...
    assert 0 < point.sum < point.count  # seconds, not milliseconds


# --- across restarts ---------------------------------------------------------------------


async def test_a_resumed_execution_continues_the_trace_of_its_start(
    db_url: str, workspace: Path, config: EngineConfig, clock: ManualClock
) -> None:
    before, after = Otel.make(), Otel.make()
    runner = ScriptRunner(script=hold(asyncio.Event()))
    try:
        async with Engine(
            db_url, runner=runner, config=config, clock=clock, **before.providers()
        ) as engine:
            h = await open_harness(engine, runner, workspace)
            started = await h.start(lease_id=LEASE)
        # The close stopped the run without an end: that attempt's span says so.
        (start,) = before.finished("child.start")
        (suspended,) = before.finished("child.execution")
        assert suspended.attributes is not None
        assert suspended.attributes["delegation.outcome"] == "suspended"
        assert before.total(telemetry.FINISHED) == 0

        runner.script = finish_after_admit
        async with Engine(
            db_url, runner=runner, config=config, clock=clock, **after.providers()
        ) as engine:
            (resumed,) = await after.span("child.execution")
        assert_continues(resumed, start, attempt=1)
        assert resumed.attributes is not None
        assert resumed.attributes["delegation.run_id"] == started.run_id
        assert resumed.attributes["delegation.outcome"] == "done"
        assert after.total(telemetry.STARTED) == 0  # a resumed attempt starts nothing new
        assert after.total(telemetry.FINISHED, outcome="done") == 1
    finally:
        before.shutdown()
        after.shutdown()


def assert_continues(resumed: ReadableSpan, start: ReadableSpan, attempt: int) -> None:
    """``resumed`` is in ``start``'s trace, under it, and linked to it as an attempt."""
    origin = start.get_span_context()
    assert resumed.get_span_context().trace_id == origin.trace_id
    assert resumed.parent is not None
    assert resumed.parent.span_id == origin.span_id
    assert resumed.parent.is_remote  # read back from the database
    (link,) = resumed.links
    assert link.context.span_id == origin.span_id
    assert link.attributes is not None
    assert link.attributes["delegation.recovery.attempt"] == attempt
    assert resumed.attributes is not None
    assert resumed.attributes["delegation.recovery.attempt"] == attempt


async def test_a_host_killed_mid_run_leaves_a_trace_its_successor_continues(
    db_url: str, workspace: Path, otel: Otel
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.harness.telemetry_host", db_url, str(workspace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        said = await asyncio.wait_for(asyncio.to_thread(read_until_both, proc), 30)
    finally:
        proc.send_signal(signal.SIGKILL)  # a real kill: nothing is flushed or exported
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, stderr
    trace_id, start_span_id, conversation_id = said["START"]
    running_trace, _, running_parent = said["RUNNING"]
    assert (running_trace, running_parent) == (trace_id, start_span_id)
    stored = stored_trace_context(db_url, conversation_id)
    assert stored.startswith(f"00-{trace_id}-{start_span_id}-")

    runner = ScriptRunner()
    async with Engine(db_url, runner=runner, **otel.providers()):
        (resumed,) = await otel.span("child.execution")
    origin = resumed.links[0].context
    assert f"{origin.trace_id:032x}" == trace_id
    assert f"{origin.span_id:016x}" == start_span_id
    assert resumed.parent is not None and resumed.parent.span_id == origin.span_id
    assert resumed.get_span_context().trace_id == origin.trace_id
    assert resumed.attributes is not None
    assert resumed.attributes["delegation.conversation_id"] == conversation_id
    assert resumed.attributes["delegation.recovery.attempt"] == 1
    assert resumed.attributes["delegation.outcome"] == "done"


def read_until_both(proc: subprocess.Popen[str]) -> dict[str, list[str]]:
    assert proc.stdout is not None
    said: dict[str, list[str]] = {}
    while not {"START", "RUNNING"} <= set(said):
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("the host ended before it was running")
        word, *rest = line.split()
        said[word] = rest
    return said


async def test_children_a_boot_ends_are_counted_finished(
    db_url: str, workspace: Path, config: EngineConfig, clock: ManualClock, otel: Otel
) -> None:
    never = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        if ctx.request.message == "admit":
            await ctx.admit()
        await never.wait()

    runner = ScriptRunner(script=run)
    async with Engine(db_url, runner=runner, config=config, clock=clock) as engine:
        h = await open_harness(engine, runner, workspace)
        await h.start("q1", lease_id=LEASE, message="admit")
        pending = asyncio.create_task(h.start("q2", lease_id=LEASE, message="wait"))
        while len(runner.prepared) < 2:
            await asyncio.sleep(0.01)
    with pytest.raises(errors.HostClosing):
        await pending
    clock.advance(config.lease_lifetime_s + 1)  # the lease expires while no host runs
    async with Engine(db_url, runner=runner, config=config, clock=clock, **otel.providers()):
        pass
    assert otel.total(telemetry.FINISHED, outcome="failed") == 1  # never admitted
    assert otel.total(telemetry.FINISHED, outcome="cancelled") == 1  # its lease expired
    assert not otel.finished("child.execution")


# --- without OpenTelemetry -------------------------------------------------------------

_WITHOUT = textwrap.dedent(
    """
    import asyncio, json, os, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "opentelemetry":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocked())

    from delegation import Engine

    from delegation.engine import telemetry
    from tests.harness.support import ScriptRunner, open_harness

    async def main(db, workspace):
        runner = ScriptRunner()
        async with Engine(f"sqlite:///{db}", runner=runner) as engine:
            h = await open_harness(engine, runner, workspace)
            started = await h.start()
            record = await h.wait_done(started.conversation_id)
            report = {
                "available": telemetry.AVAILABLE,
                "telemetry": engine._telemetry is None,
                "on_commit": engine._db.on_commit is None,
                "state": record.state,
                "trace_context": record.trace_context,
                "loaded": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
            }
        print(json.dumps(report))

    asyncio.run(main(*sys.argv[1:3]))
    """
)


def test_without_opentelemetry_nothing_of_it_is_imported_and_children_run(
    tmp_path: Path, workspace: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT, str(tmp_path / "plain.db"), str(workspace)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "available": False,
        "telemetry": True,
        "on_commit": True,
        "state": "done",
        "trace_context": None,
        "loaded": [],
    }


# --- the global provider --------------------------------------------------------------

_GLOBAL = textwrap.dedent(
    """
    import asyncio, json, sys

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from delegation import Engine
    from tests.harness.support import ScriptRunner, open_harness

    async def main(db, workspace):
        runner = ScriptRunner()
        spans = InMemorySpanExporter()
        async with Engine(f"sqlite:///{db}", runner=runner) as engine:
            h = await open_harness(engine, runner, workspace)
            first = await h.start("q1")  # no SDK yet: nothing records
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(spans))
            trace.set_tracer_provider(provider)  # installed while the engine is open
            await h.read(first.conversation_id)
        print(json.dumps([s.name for s in spans.get_finished_spans()]))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_a_global_sdk_installed_after_the_engine_opened_records_its_calls(
    tmp_path: Path, workspace: Path
) -> None:
    """Without an SDK a method is served with no span (a span would record nothing);
    once the application installs one as the global provider, the next call has its."""
    done = subprocess.run(
        [sys.executable, "-c", _GLOBAL, str(tmp_path / "g.db"), str(workspace)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    names = json.loads(done.stdout)
    assert names.count("child.read") == 1 and "child.start" not in names
