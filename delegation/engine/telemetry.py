"""OpenTelemetry for the engine (design §13), and nothing at all without it.

Whether OpenTelemetry's API is installed (the extra ``durable-delegation[otel]``) is decided
once, when this module is imported: ``AVAILABLE``. Without it nothing of OpenTelemetry
is imported, :func:`for_engine` gives None, and every hook of the engine is one ``is
None`` test. With it, an engine records through the providers it was given, or the
global ones, which do nothing until the application installs an SDK.

Spans (names and attributes are a contract: dashboards are built on them):

* one per call of a child method, named after it (``child.start``, ``child.read``,
  ``child.cancel``, ``child.steer``, ``child.lease.release``): the caller's extension,
  parent run and lease, the child's conversation, run and profile once known, and
  ``delegation.outcome`` (the Result's ``done``, ``failed``, ``cancelled`` or
  ``running``; a steer's ``injected`` or ``promptRequired``). A refusal sets the status
  ERROR, ``error.type`` to its ``reason`` and ``rpc.jsonrpc.error_code`` to its code,
  and the outcome ``error``.
* ``child.execution``: one per attempt to execute a child in this process, from the
  moment the run is handed to the runner's ``prepare`` until the child is terminal
  (``delegation.outcome`` ``done``, ``failed`` or ``cancelled``), or until this
  process stops running it without an end (``suspended``: a graceful close, or a
  takeover by another host; the next attempt goes on). The runner's own spans, made
  inside ``prepare`` and the run, are its children. Its parent is the ``child.start``
  span that reserved the child, whose W3C ``traceparent`` is stored with the child
  (``children.trace_context``): an attempt resumed after a restart, in another
  process, is a span of the same trace with the same parent, linked to it with
  ``delegation.recovery.attempt``. When nothing traces (the API without an SDK, and no
  stored context) no span is kept for the attempt at all: a host holding thousands of
  children would pay for each in objects its garbage collector walks.

Metrics, each recorded after the commit it reports:

* ``delegation.children.started`` (counter): executions begun in this process, not
  counting resumed attempts.
* ``delegation.children.finished`` (counter, ``delegation.outcome``): terminal states
  this host committed, the children a boot or a takeover ended included.
* ``delegation.children.active`` (up-down counter): runs executing in this process.
* ``delegation.events.appended`` (counter): run events committed.
* ``delegation.store.commit.duration`` (histogram, seconds): one write transaction of
  the store, from its ``BEGIN`` to its ``COMMIT`` returning (a batch of jobs and
  events, or a lone statement).

Gauges, read when the metrics are collected:

* ``delegation.children.pinned`` (gauge): the children of the database pinned to a
  runner version (design §34: left waiting for a host of the version that ran them, or
  ``delegation unpin``). Every host of a shared database reports the same count. It is
  one indexed count (``ix_children_pinned``), read on the engine's loop as its other
  reads are: a collection from another thread (a periodic reader, an exporter's server)
  waits for it up to ``GAUGE_WAIT_S``; one on the loop's own thread, which cannot wait
  for the loop, reports the last count read and reads it again for the next. Nothing is
  reported while the engine is not open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from delegation import errors, machine
from delegation.about import DISTRIBUTION
from delegation.records import ChildRecord
from delegation.store.sql import Connection, run
from delegation.wire import Params, Request, Result, SteerResult

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the extra is not installed: nothing below is ever called
    AVAILABLE = False
else:
    AVAILABLE = True
    _NO_SDK = trace.ProxyTracerProvider  # the global provider until one is installed

if TYPE_CHECKING:  # re-exported for the engine's signature
    from contextvars import Token

    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.metrics import MeterProvider as MeterProvider
    from opentelemetry.trace import Span, SpanContext
    from opentelemetry.trace import TracerProvider as TracerProvider
    from opentelemetry.util.types import AttributeValue

    from delegation.store.interface import Store

    # An attempt's span and the token that made it the task's current one.
    Executing = tuple[Span, Token[Context]]

T = TypeVar("T")

SCOPE = "delegation"
EXECUTION = "child.execution"

CONVERSATION_ID = "delegation.conversation_id"
RUN_ID = "delegation.run_id"
PARENT_RUN_ID = "delegation.parent_run_id"
EXTENSION = "delegation.extension"
PROFILE = "delegation.profile"
LEASE_ID = "delegation.lease_id"
OUTCOME = "delegation.outcome"
ATTEMPT = "delegation.recovery.attempt"
ERROR_TYPE = "error.type"
RPC_METHOD = "rpc.method"
RPC_ERROR_CODE = "rpc.jsonrpc.error_code"

STARTED = "delegation.children.started"
FINISHED = "delegation.children.finished"
ACTIVE = "delegation.children.active"
EVENTS = "delegation.events.appended"
COMMIT_DURATION = "delegation.store.commit.duration"
PINNED = "delegation.children.pinned"

# How long a collection on another thread waits for the loop to count the pinned children.
GAUGE_WAIT_S = 2.0
# Pinned and still waiting (one that ended keeps the column as history).
_PINNED_SQL = "SELECT count(*) FROM children WHERE pinned_version IS NOT NULL AND state = 'waiting'"

RUNNING = "running"  # a method's outcome while the child is not terminal yet
SUSPENDED = "suspended"  # an attempt this process stopped without an end
REFUSED = "error"  # a method call that raised

# Commits take from a tenth of a millisecond (SQLite, no sync) to seconds (a busy lock).
_COMMIT_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]
_COMMIT_BUCKETS += [0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_STATUS_LIMIT = 1024  # characters of a failed run's error kept as the span's status


def for_engine(
    tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None
) -> Telemetry | None:
    """An engine's telemetry, on these providers or the global ones; None without
    OpenTelemetry's API (then the engine records nothing and imports nothing)."""
    return Telemetry(tracer_provider, meter_provider) if AVAILABLE else None


class Telemetry:
    """One engine's spans and instruments (see the module's docstring)."""

    def __init__(
        self, tracer_provider: TracerProvider | None, meter_provider: MeterProvider | None
    ) -> None:
        version = _version()
        self._own_tracer = tracer_provider is not None
        self._tracer = trace.get_tracer(SCOPE, version, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, version, meter_provider=meter_provider)
        self._started = meter.create_counter(
            STARTED, unit="{child}", description="Executions begun (resumed attempts not counted)"
        )
        self._finished = meter.create_counter(
            FINISHED, unit="{child}", description="Terminal states committed, by outcome"
        )
        self._active = meter.create_up_down_counter(
            ACTIVE, unit="{child}", description="Runs executing in this process"
        )
        self._events = meter.create_counter(
            EVENTS, unit="{event}", description="Run events committed"
        )
        self._commits = meter.create_histogram(
            COMMIT_DURATION,
            unit="s",
            description="Duration of one write transaction, BEGIN to COMMIT",
            explicit_bucket_boundaries_advisory=_COMMIT_BUCKETS,
        )
        pinned = Gauge()
        gauge = meter.create_observable_gauge(
            PINNED,
            callbacks=[pinned.observe],
            unit="{child}",
            description="Children pinned to a runner version, waiting for a host of it",
        )
        # A meter gives the instrument it made first to whoever asks for it again (the
        # global provider of a process that opens another engine): then its callback is
        # the first engine's, and this engine joins what it reads.
        self._pinned = _GAUGES.setdefault(gauge, pinned)

    # --- child methods ----------------------------------------------------------------

    async def method(
        self,
        name: str,
        decode: Callable[[], Params],
        handler: Callable[[Params], Awaitable[T]],
    ) -> T:
        """Serve a child method inside a span named ``name``: decode its params, then
        call ``handler`` with them; what they return or raise is the span's outcome.
        Until an SDK is installed as the global provider (and none was given), a span
        would record nothing: the method is served without one (a tenth of a read's
        time, otherwise)."""
        if not self._own_tracer and isinstance(trace.get_tracer_provider(), _NO_SDK):
            return await handler(decode())
        with self._tracer.start_as_current_span(
            name,
            attributes={RPC_METHOD: name},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                params = decode()
                if span.is_recording():
                    span.set_attributes(_of_params(params))
                answer = await handler(params)
            except errors.DelegationError as exc:
                span.set_attributes(
                    {OUTCOME: REFUSED, ERROR_TYPE: exc.reason, RPC_ERROR_CODE: exc.rpc_code}
                )
                span.set_status(Status(StatusCode.ERROR, exc.reason))
                raise
            except Exception as exc:
                span.record_exception(exc)
                span.set_attributes({OUTCOME: REFUSED, ERROR_TYPE: type(exc).__qualname__})
                span.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))
                raise
            if span.is_recording() and isinstance(answer, Result | SteerResult):
                span.set_attributes(_of_answer(answer))
            return answer

    @staticmethod
    def trace_context() -> str | None:
        """The W3C ``traceparent`` of the current span (a start's), to store with the
        child it reserves; None when nothing is traced."""
        return _traceparent(trace.get_current_span().get_span_context())

    # --- executions -------------------------------------------------------------------

    def begin(self, child: ChildRecord, attempt: int) -> Executing | None:
        """Attempt ``attempt`` of ``child`` (0 when fresh) begins in the current task:
        its ``child.execution`` span becomes the task's current span, until
        :meth:`end`. None when nothing traces it (no SDK): then no span is kept, which
        a host holding thousands of children would pay for in objects."""
        if not attempt:
            self._started.add(1)
        self._active.add(1)
        parent = _stored(child.trace_context)
        links = []
        if attempt:
            stored = trace.get_current_span(parent).get_span_context()
            if stored.is_valid:
                links.append(Link(stored, {ATTEMPT: attempt}))
        span = self._tracer.start_span(
            EXECUTION, context=parent, attributes=_of_child(child, attempt), links=links
        )
        if not span.get_span_context().is_valid:
            return None
        return span, otel_context.attach(trace.set_span_in_context(span))

    def end(self, executing: Executing | None, ended: ChildRecord | None) -> None:
        """The attempt :meth:`begin` began is over, in the same task: ``ended`` is the
        child's terminal record, or None when it stopped without an end."""
        self._active.add(-1)
        outcome = None if ended is None else machine.outcome(ended.state, ended.error)
        if outcome is not None:
            self._finished.add(1, {OUTCOME: outcome.value})
        if executing is None:
            return
        span, token = executing
        otel_context.detach(token)
        span.set_attribute(OUTCOME, SUSPENDED if outcome is None else outcome.value)
        if outcome is machine.Outcome.FAILED and ended is not None:
            span.set_status(Status(StatusCode.ERROR, ended.error[:_STATUS_LIMIT]))
        span.end()

    def finished(self, counts: Mapping[machine.Outcome, int]) -> None:
        """Children that ended without a run in this process (a boot, a takeover, or a
        cancel of a child nothing ran): how many, by outcome."""
        for outcome, count in counts.items():
            if count:
                self._finished.add(count, {OUTCOME: outcome.value})

    # --- gauges -----------------------------------------------------------------------

    def watch(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
        """The engine opened ``store`` on ``loop``: its gauges read it from now on."""
        self._pinned.read(self, Counted(lambda: store.read_now(pinned_count), loop))

    # --- the store --------------------------------------------------------------------

    def committed(self, seconds: float, events: int) -> None:
        """The store committed a transaction in ``seconds``, with ``events`` run events
        (``Store.on_commit``: on the thread that committed it)."""
        self._commits.record(seconds)
        if events:
            self._events.add(events)


def pinned_count(conn: Connection) -> int:
    """How many children are pinned to a runner version (an indexed count)."""
    return int(run(conn, _PINNED_SQL).fetchone()[0])


class Gauge:
    """What one gauge instrument reports: the count of the engine that opened last with
    it and still answers (an engine closed, or on a closed loop, answers nothing)."""

    def __init__(self) -> None:
        # Replaced whole, never changed in place: a collection on another thread reads it.
        self._counts: tuple[tuple[weakref.ref[Telemetry], Counted], ...] = ()

    def read(self, telemetry: Telemetry, counted: Counted) -> None:
        kept = tuple((ref, c) for ref, c in self._counts if ref() not in (None, telemetry))
        self._counts = (*kept, (weakref.ref(telemetry), counted))  # the newest last

    def observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        for ref, counted in reversed(self._counts):
            count = None if ref() is None else counted.count()
            if count is not None:
                return [metrics.Observation(count)]
        return []


# Each pinned gauge instrument's sources (see Telemetry.__init__).
_GAUGES: weakref.WeakKeyDictionary[object, Gauge] = weakref.WeakKeyDictionary()


class Counted:
    """A count the engine's loop reads (``read``), asked from any thread: see the
    module's docstring for what a collection on the loop's own thread gets."""

    def __init__(
        self, read: Callable[[], Coroutine[Any, Any, int]], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._read = read
        self._loop = loop
        self._last: int | None = None
        self._refreshing: asyncio.Task[None] | None = None

    def count(self) -> int | None:
        """The count, or None when it cannot be read (the engine is closed)."""
        loop = self._loop
        if loop.is_closed() or not loop.is_running():
            return None
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = loop.create_task(self._refresh())
            return self._last
        future = asyncio.run_coroutine_threadsafe(self._read(), loop)
        try:
            self._last = future.result(GAUGE_WAIT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()  # a loop too busy to answer: the last count read
        except Exception:
            return None  # closed, or the database away: nothing to report
        return self._last

    async def _refresh(self) -> None:
        try:
            self._last = await self._read()
        except Exception:
            self._last = None


def _version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _traceparent(span_context: SpanContext) -> str | None:
    if not span_context.is_valid:
        return None
    return (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}"
        f"-{int(span_context.trace_flags):02x}"
    )


def _stored(traceparent: str | None) -> Context:
    """The context a stored ``traceparent`` names; an empty one (a new trace) without
    one: never the context a task happened to inherit from whoever spawned it."""
    if traceparent is None:
        return Context()
    return TraceContextTextMapPropagator().extract({"traceparent": traceparent}, Context())


def _of_params(params: Params) -> dict[str, AttributeValue]:
    found: dict[str, AttributeValue] = {
        EXTENSION: params.extension_id,
        PARENT_RUN_ID: params.run_id,
    }
    if params.child_id:
        found[CONVERSATION_ID] = params.child_id
    if params.child_run_id:
        found[RUN_ID] = params.child_run_id
    if params.lease_id:
        found[LEASE_ID] = params.lease_id
    if isinstance(params.request, Request) and params.request.profile:
        found[PROFILE] = params.request.profile
    return found


def _of_answer(answer: Result | SteerResult) -> dict[str, AttributeValue]:
    if isinstance(answer, SteerResult):
        return {OUTCOME: answer.outcome}
    found: dict[str, AttributeValue] = {OUTCOME: _result_outcome(answer)}
    if answer.conversation_id:
        found[CONVERSATION_ID] = answer.conversation_id
        found[RUN_ID] = answer.run_id
        found[PROFILE] = answer.profile
        found[EXTENSION] = answer.extension_id
    return found


def _result_outcome(result: Result) -> str:
    if result.cancelled:
        return machine.Outcome.CANCELLED.value
    if not result.done:
        return RUNNING
    return (machine.Outcome.FAILED if result.error else machine.Outcome.DONE).value


def _of_child(child: ChildRecord, attempt: int) -> dict[str, AttributeValue]:
    found: dict[str, AttributeValue] = {
        CONVERSATION_ID: child.conversation_id,
        RUN_ID: child.run_id,
        PARENT_RUN_ID: child.parent_run_id,
        EXTENSION: child.extension_id,
        PROFILE: child.profile,
        ATTEMPT: attempt,
    }
    if child.lease_id:
        found[LEASE_ID] = child.lease_id
    return found
