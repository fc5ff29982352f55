"""The runner protocol and the context a child run sees (design §6).

A host supplies a runner: ``async prepare(request, preset, identity, recovery) -> Run``
validates and freezes configuration without side effects; the returned
``Run`` is ``async (ctx) -> None`` and calls ``await ctx.admit()`` (or the
module-level :func:`admit`) before its first effect. Cancellation arrives as
``asyncio.CancelledError``; a run that raises ends ``done`` with the message as error.
A run may carry a ``max_run_s`` attribute (seconds, or None): the engine cancels its
child past it as past ``EngineConfig.max_run_s`` ("cancelled: child deadline exceeded"); the
smaller of the two applies.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload

import msgspec

from delegation import errors
from delegation.codec import encode
from delegation.run.emits import Committed, is_engine_kind
from delegation.run.journal import Journal, in_step
from delegation.run.protection import NOTHING, Protected
from delegation.run.waits import WaitHooks, Waits
from delegation.wire import Event, Identity, Preset, Request

T = TypeVar("T")

RESULT_KIND = "result"


@dataclass(frozen=True, slots=True)
class Recovery:
    """Given to ``prepare`` when a child is resumed after a host restart, or when a
    rewound execution first runs (``reason`` ``rewind``, design §35: it replays the
    steps it was seeded with)."""

    attempt: int  # 1 for the first resume; 0 for a rewound execution's first run
    last_sequence: int  # the last committed event: the engine's recovery event
    # Every steer message handed to earlier attempts, oldest first: the heading a
    # resumed run was steered to (those not yet handed over are delivered anew).
    delivered_steers: tuple[str, ...] = ()
    # How many steps the resumed execution had recorded (design §15): ``ctx.step`` with
    # one of their names returns the recorded value without running it again.
    steps: int = 0
    # Versions (design §34): the runner version this host runs (None: unversioned),
    # whether the execution last ran another one (``previous_version``), and why it
    # resumes: ``restart``, ``takeover``, ``input``, ``sleep``, ``event``, ``unpin``
    # or ``rewind``.
    runner_version: str | None = None
    version_changed: bool = False
    reason: str = "restart"
    previous_version: str | None = None


class NotResumable(Exception):
    """Raised by ``prepare`` to refuse resuming a child after a restart."""


Run = Callable[["ChildContext"], Awaitable[None]]


class Runner(Protocol):
    """What a host supplies. A runner that starts operating-system processes records
    each with ``ctx.track_process`` and keeps them off ``ctx.protected``: the engine's
    own set of what no process of a child may reach (the command runner refuses such a
    confinement). The engine also still calls ``protect_paths(paths)`` at open, with the
    directory of its database, on a runner that has it."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run: ...


_current: ContextVar[ChildContext | None] = ContextVar("delegation_child", default=None)


async def admit() -> None:
    """Admit the child whose run is executing in this task (see ``ChildContext.admit``)."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("delegation.admit() called outside a child run")
    await ctx.admit()


_json = msgspec.json.Encoder()
_string = msgspec.json.Decoder(str)


def truncate(text: str, limit: int) -> str:
    """The longest start of ``text`` whose JSON string encoding takes at most ``limit``
    bytes (measured after escaping), never cut inside a character."""
    if len(text) <= limit and len(text) * 6 <= limit:
        return text
    # Every character takes at least one byte: no more than ``limit`` of them fit.
    encoded = _json.encode(text[: limit + 1])
    if len(encoded) - 2 <= limit:
        return text
    # Cut the encoding instead, out of a UTF-8 sequence or an escape, and decode it.
    end = limit + 1  # just past the limit's last byte, after the opening quote
    while encoded[end] & 0xC0 == 0x80:  # a continuation byte: its character is cut
        end -= 1
    return _string.decode(encoded[: _escape_start(encoded, end)] + b'"')


def _escape_start(encoded: bytes, end: int) -> int:
    """``end``, or the start of the escape (``\\n``, ``\\u0001``) it falls inside."""
    # An escape is at most six bytes: one cut inside began at most five bytes back.
    start = encoded.rfind(b"\\", max(end - 5, 1), end)
    if start < 0:
        return end
    run = start - len(encoded[:start].rstrip(b"\\"))  # the backslashes just before it
    if run % 2:  # it is the second of an escaped backslash, which ends before ``end``
        return end
    size = 6 if encoded[start + 1 : start + 2] == b"u" else 2
    return start if start + size > end else end


_CUT_FIELDS = ("text", "input", "tool_output", "error")
# Names are short by nature: cut at 1 KiB. Every field is measured as the wire encodes it,
# so one event's encoding is bounded (about 132 KiB at the default limits), whatever it holds.
_NAME_FIELDS = ("kind", "tool_name", "tool_call_id")
NAME_LIMIT = 1024
_event_decoder = msgspec.json.Decoder(Event)  # types only: the engine sets the sequence


class Hooks(Protocol):
    """What a context needs from the engine, handed in so runs never import the store."""

    async def admit(self) -> None: ...

    def append(self, sequence: int, body: bytes, output: str | None) -> None: ...

    async def flush(self) -> None: ...

    def delivered(self, steer_ids: list[int]) -> None: ...

    async def record_process(self, pid: int) -> None: ...


def _bounded(
    name: str, fn: Callable[..., Awaitable[Any] | Any], timeout: float
) -> Callable[..., Awaitable[Any]]:
    """``fn``, whose awaitable is given ``timeout`` seconds at most (``StepTimeout``)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError("a step's timeout must be a positive number of seconds")

    async def bounded(*args: Any) -> Any:
        result = fn(*args)
        if not inspect.isawaitable(result):
            return result
        limit = asyncio.timeout(timeout)
        try:
            async with limit:
                return await result
        except TimeoutError:
            if limit.expired():
                raise errors.StepTimeout(
                    f"child step {name!r} timed out after {timeout:g} s"
                ) from None
            raise

    return bounded


class ChildContext:
    """The running child's view of the engine."""

    def __init__(
        self,
        *,
        identity: Identity,
        request: Request,
        preset: Preset,
        cwd: str,
        recovery: Recovery | None,
        last_sequence: int,
        max_field_bytes: int,
        hooks: Hooks,
        protected: Protected = NOTHING,
        journal: Journal | None = None,
        previous_run_id: str | None = None,
        wait_hooks: WaitHooks | None = None,
        hold_s: float = 30.0,
        committed: Committed | None = None,
    ) -> None:
        self.identity = identity
        self.request = request
        self.preset = preset
        self.cwd = cwd
        self.recovery = recovery
        self._sequence = last_sequence
        # A resumed run's own events already committed, matched with its emits (§26).
        self._committed = committed
        self._limit = max_field_bytes
        self._hooks = hooks
        self._protected = protected
        self._journal = journal
        # The execution a follow-up continues (its steps: ``recorded(name, run_id=…)``).
        self.previous_run_id = previous_run_id
        # Made at the first steer: a host holding thousands of children pays for each
        # object in every run of the garbage collector.
        self._steers: deque[tuple[int, str]] | None = None
        self._seen: set[int] | None = None
        self._steer_ready: asyncio.Event | None = None
        self._closed = False
        self.admitted = False
        self._wait_hooks = wait_hooks
        self._hold_s = hold_s
        self._waits: Waits | None = None  # made by the first wait (design §21)

    @property
    def max_step_bytes(self) -> int:
        """The largest step result this run may record (``EngineConfig.max_step_bytes``)."""
        if self._journal is None:
            raise RuntimeError("this run has no step journal")
        return self._journal.max_bytes

    @property
    def last_sequence(self) -> int:
        """The sequence of the last event this execution numbered: every event emitted
        before a step is committed with it or before (what a rewind copies, design §35)."""
        return self._sequence

    @property
    def protected(self) -> Protected:
        """What no process this run starts may reach, as the engine protects it: the
        directory of its database and the host's own code (design §17)."""
        return self._protected

    async def admit(self) -> None:
        """Commit admission: the last moment before any effect. A no-op once admitted.

        Raises ``asyncio.CancelledError`` when cancellation was requested first, and
        ``errors.CwdOutsideWorkspace`` (or ``errors.InvalidCwd``) when ``cwd`` no longer
        resolves to the directory confined at the start.
        """
        if self.admitted:
            return
        try:
            await self._hooks.admit()
        except errors.AdmissionFailed:
            raise asyncio.CancelledError() from None
        self.admitted = True

    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., Awaitable[Any] | Any],
        *args: Any,
        type: builtins.type[T],
        timeout: float | None = None,
    ) -> T: ...
    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        type: None = None,
        timeout: float | None = None,
    ) -> T: ...
    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        type: None = None,
        timeout: float | None = None,
    ) -> T: ...
    async def step(
        self,
        name: str,
        fn: Callable[..., Awaitable[Any] | Any],
        *args: Any,
        type: Any = None,  # noqa: A002 (design §15 names it)
        timeout: float | None = None,
    ) -> Any:
        """Run ``fn(*args)`` (awaited when it is a coroutine function, or returns an
        awaitable; a plain function's value as it is) at most once per execution and
        ``name`` (design §15).

        Its result (msgspec-encodable, or bytes) is committed, after every event emitted
        before it, before this returns. On a resumed execution a recorded name returns
        the recorded value (decoded as ``type`` if given, else as plain JSON values)
        without calling ``fn``. A raising ``fn`` records nothing. Names are non-empty and
        at most 1 KiB; raises ``errors.StepTooLarge`` past ``max_step_bytes`` and
        ``errors.StepLimit`` past ``max_steps``.

        ``timeout`` (seconds, design §22) bounds what ``fn`` awaits: past it, it is
        cancelled and ``errors.StepTimeout`` raised, nothing recorded (a replay runs it
        again). A plain function's call is not interrupted.
        """
        if self._journal is None:
            raise RuntimeError("this run has no step journal")
        if timeout is not None:
            fn = _bounded(name, fn, timeout)
        return await self._journal.step(name, fn, args, type)

    async def patched(self, name: str) -> bool:
        """Whether this execution runs the new code of the patch ``name`` (design §34):
        ``if await ctx.patched("x"): new else: old``.

        True when nothing this execution recorded lies ahead (a first run, or a resumed
        one that has replayed every step it had recorded when this attempt began: its
        live frontier); False for an execution that went past this point on older code.
        Recorded the first time, as a step of a reserved kind that no ``step`` name can
        take: every later attempt gets the same value back. Removing the call later is
        safe: a marker no code asks for replays nothing. Names as ``step``'s (non-empty,
        at most 1 KiB); ``delegation children --patch NAME`` lists the live executions'
        values.
        """
        if self._journal is None:
            raise RuntimeError("this run has no step journal")
        return await self._journal.patched(name)

    async def recorded(
        self,
        name: str,
        run_id: str | None = None,
        type: Any = None,  # noqa: A002
    ) -> Any:
        """A recorded step's value: of this execution, or (``run_id``) of an earlier
        execution of this conversation, e.g. ``ctx.previous_run_id``; None if none."""
        if self._journal is None:
            raise RuntimeError("this run has no step journal")
        return await self._journal.recorded(name, run_id, type)

    # --- waiting (design §21) ----------------------------------------------------------

    async def ask(
        self,
        name: str,
        prompt: str,
        *,
        kind: str = "input",
        options: Sequence[str] | None = None,
        tool_name: str | None = None,
        tool_call_id: str | None = None,
        input: Any = None,  # noqa: A002 (design §21 names it)
        timeout: float | None = None,
    ) -> str:
        """Ask a person (design §21): the answer, a text or one of ``options`` (an
        ``approval``'s are ``approve`` and ``deny``). Commits an input request (its
        inputId is ``name``) and an ``input-required`` event, with every event before
        it, then waits; in memory for ``hold_s``, then the child is suspended and woken
        when answered. A named step: a replay gets the answer back at once.

        Raises ``errors.InputTimeout`` past ``timeout`` seconds (at the resumed ask),
        ``errors.InputLimit`` past ``max_open_inputs`` open requests, and ``ValueError``
        for a bad name, kind, options or timeout.
        """
        return await self._waiting().ask(
            name, prompt, kind=kind, options=options, tool_name=tool_name,
            tool_call_id=tool_call_id, input=input, timeout=timeout,
        )  # fmt: skip

    async def sleep(self, name: str, seconds: float) -> None:
        """Sleep ``seconds``, durably (design §21): the wake time is recorded the first
        time, and after a restart or a suspension only what remains is slept."""
        await self._waiting().sleep(name, seconds)

    async def wait_event(self, name: str, key: str, *, timeout: float | None = None) -> Any:
        """The payload of the event ``key`` sent to this conversation (``send_event``,
        ``delegation send``), an event sent before the wait included (design §21).

        Raises ``errors.EventTimeout`` past ``timeout`` seconds (at the resumed wait)."""
        return await self._waiting().wait_event(name, key, timeout)

    def _waiting(self) -> Waits:
        if self._wait_hooks is None or self._journal is None:
            raise RuntimeError("this run cannot wait (no engine hooks for it)")
        if not self.admitted:
            raise RuntimeError("a run waits only once admitted: call admit() first")
        if self._waits is None:
            self._waits = Waits(
                self._wait_hooks, self._journal, hold_s=self._hold_s, numbered=self._numbered
            )
        return self._waits

    def wake_waits(self) -> None:
        """Engine side: something the run waits for may have come."""
        if self._waits is not None:
            self._waits.notify()

    def emit(self, event: Event) -> int:
        """Append an event without blocking; the engine assigns and returns its sequence.

        Oversized ``text``, ``input``, ``toolOutput`` and ``error`` are cut at a
        character boundary to ``max_event_field_bytes``, and ``kind``, ``toolName`` and
        ``toolCallId`` to 1 KiB, each measured as JSON encodes it (a control character
        takes six bytes, a quote two); the child's ``output`` keeps a ``result`` text whole.
        A resumed run's emits are matched, in order, with the events of its own kinds
        its execution committed before (design §26): one that is the next of them is not
        written again and its sequence is returned; the first that differs, and every
        later one, is written (logged ``emits_diverged``). Emits between steps are
        deterministic, as step names are; what a step's function emits is never matched
        (a step run again emits again, at least once, as its effects).

        Raises ``TypeError`` for anything but a well-formed Event and ``ValueError`` for
        one of the engine's kinds (``recovery``, ``input-required``, ``rewind``): nothing
        is appended and no sequence is used. Raises ``RuntimeError`` once the run has ended.
        """
        sequence, body, output = self._prepare(event, own=True)
        if body or output is not None:  # else committed before this resume; a result
            self._hooks.append(sequence, body, output)  # committed before: its output
        return sequence

    def _numbered(self, event: Event) -> tuple[int, bytes]:
        """``event`` given the next sequence and encoded as :meth:`emit` does, for the
        engine to write in a transaction of its own (an input request's)."""
        sequence, body, _ = self._prepare(event, own=False)
        return sequence, body

    def _prepare(self, event: Event, *, own: bool) -> tuple[int, bytes, str | None]:
        """The next sequence, the event's stored body (cut and checked) and a result's
        whole text: the sequence is used from now on. For the run's ``own`` emit, one
        of the engine's kinds is refused, and the sequence of the committed event it
        matches comes with an empty body instead (see :meth:`emit`)."""
        if self._closed:
            raise RuntimeError("the child run has ended; its context no longer accepts events")
        if not isinstance(event, Event):
            raise TypeError(f"emit() takes an Event, not {type(event).__name__}")
        sequence = self._sequence + 1
        whole = msgspec.structs.replace(event, sequence=sequence)
        try:
            # Cut first: a field is never encoded whole (a MiB of control characters
            # is six once escaped, and the loop waits while it is).
            event = self._cut(whole)
            # msgspec checks no types at construction, and a stored event that does not
            # decode would fail every later read of the child: refuse it here, unnumbered.
            body = encode(event)
            _event_decoder.decode(body)
            output = whole.text if event.kind == RESULT_KIND else None
            if output is not None and output is not event.text:
                output.encode()  # kept whole: no lone surrogate past the cut either
        except (msgspec.MsgspecError, TypeError, ValueError) as exc:
            raise TypeError(f"emit() takes a well-formed Event: {exc}") from None
        if own:
            if is_engine_kind(event.kind):
                raise ValueError(f"a run may not emit the engine's event kind {event.kind!r}")
            if self._committed is not None:
                # A step's function runs on a resume only if it was not recorded: what
                # it emits is at least once, as its effects are, and never matched.
                committed = None if in_step() else self._committed.match(event)
                if committed is not None:  # a result's output is the child's again
                    return committed, b"", output
                if in_step() or not len(self._committed):  # matched them all, or diverged
                    self._committed = None
        self._sequence = sequence
        return sequence, body, output

    def _cut(self, event: Event) -> Event:
        """``event`` with its oversized fields cut (a field that is not a string is
        left for the decoder to refuse)."""
        changes: dict[str, str] = {}
        for names, limit in ((_CUT_FIELDS, self._limit), (_NAME_FIELDS, NAME_LIMIT)):
            for name in names:
                value = getattr(event, name)
                if isinstance(value, str) and (cut := truncate(value, limit)) is not value:
                    changes[name] = cut
        return msgspec.structs.replace(event, **changes) if changes else event

    async def flush(self) -> None:
        """Return once every event emitted so far is committed."""
        await self._hooks.flush()

    async def track_process(self, pid: int) -> None:
        """Record durably that this run started the process ``pid``, which leads its own
        process group (design §10). Returns once committed. If the host dies, the next
        boot kills that process and its group, if still alive, before resuming the
        child: a resumed run never runs beside an orphan of itself. The record ends
        with the run. Start the process's real work only after this returns.
        """
        await self._hooks.record_process(pid)

    @property
    def steers_waiting(self) -> int:
        """How many steers were delivered to this run and not yet taken."""
        return len(self._steers) if self._steers is not None else 0

    def take_steers(self) -> list[str]:
        """Every steer delivered so far and not yet taken, oldest first."""
        if not self._steers:
            return []
        taken = list(self._steers)
        self._steers.clear()
        self._ready().clear()
        if taken:
            self._hooks.delivered([steer_id for steer_id, _ in taken])
        return [message for _, message in taken]

    async def wait_steer(self, timeout: float | None = None) -> str | None:
        """The next steer message, or None if none arrives within ``timeout`` seconds."""
        if not self._steers:
            try:
                async with asyncio.timeout(timeout):  # not wait_for: see follow._moved
                    await self._ready().wait()
            except TimeoutError:
                return None
        assert self._steers is not None  # made by deliver, which set the event
        steer_id, message = self._steers.popleft()
        if not self._steers:
            self._ready().clear()
        self._hooks.delivered([steer_id])
        return message

    # --- engine side --------------------------------------------------------------

    def deliver(self, steer_id: int, message: str) -> None:
        """Queue a committed steer for the run (each steer id at most once)."""
        if self._seen is None or self._steers is None:
            self._seen, self._steers = set(), deque()
        if steer_id in self._seen:
            return
        self._seen.add(steer_id)
        self._steers.append((steer_id, message))
        self._ready().set()

    def _ready(self) -> asyncio.Event:
        """Set while a delivered steer waits to be taken."""
        if self._steer_ready is None:
            self._steer_ready = asyncio.Event()
        return self._steer_ready

    def close(self) -> None:
        self._closed = True

    def asked_steps(self) -> list[str]:
        """The steps recorded before this attempt that the run asked for again since
        its last record, handed over once (design §34: marked when the attempt ends or
        waits)."""
        return [] if self._journal is None else self._journal.asked()

    def bind(self) -> object:
        """Make this the context of the current task for :func:`admit`."""
        return _current.set(self)
