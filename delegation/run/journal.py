"""The step journal as a run sees it (design §15): ``ctx.step`` and ``ctx.recorded``.

A step runs its function at most once per execution and name: its result is committed
(after every event the run emitted before it) before ``step`` returns, and a resumed
execution gets the recorded value back without the function being called. The first run
gets the recorded value too, decoded as a replay decodes it (design §20): a run and its
replay see equal values. What the
function did outside the database is at-least-once: a host that dies inside a step runs
it again when the child resumes.

A patch (``ctx.patched``, design §34) is a step of a reserved kind (a marker, see
:mod:`delegation.store.steps`): True when the attempt has replayed every step its
execution recorded before it began (nothing recorded lies ahead: the live frontier),
else False, recorded the first time and replayed after. Markers take no part in the
frontier: a marker no code asks for any more (its call removed) keeps no later patch
from its frontier, and nothing in a replay reads a step's ordinal.

The journal also keeps which recorded steps this attempt asked for (replayed): written
with the next step it records, or by :meth:`Journal.asked` when the attempt ends or
waits, never one write a replayed step. A host that dies loses the marks since its last
record: the next attempt asks again, and ``show`` lists drift only for an attempt
that ended or waits.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar, overload

import msgspec

from delegation import errors
from delegation.records import RecordedStep
from delegation.store.steps import PATCH_PREFIX
from delegation.wire import MAX_STEP_NAME_BYTES

T = TypeVar("T")

MAX_NAME_BYTES = MAX_STEP_NAME_BYTES
# Set while a step's function runs (and in the tasks it starts): what it emits is part of
# a step that runs, at least once, not an emit between steps (design §26).
_in_step: ContextVar[bool] = ContextVar("delegation_in_step", default=False)


def in_step() -> bool:
    """Whether the caller runs inside a step's function."""
    return _in_step.get()


class JournalHooks(Protocol):
    """What the engine does for the journal: committed writes and reads of steps."""

    async def record_step(
        self,
        name: str,
        ordinal: int,
        step: RecordedStep,
        closes_wait: bool,
        asked: list[str],
        began: int | None,
    ) -> RecordedStep:
        """Commit the step, and in the same transaction the marks of the recorded steps
        this attempt replayed since its last record (``asked``); ``began``: the run's
        last numbered event when the step's function began (what :meth:`numbered` said)."""
        ...

    def numbered(self) -> int | None:
        """The sequence of the run's last numbered event (None: no run's context)."""
        ...

    async def read_step(self, name: str, run_id: str | None) -> RecordedStep | None: ...

    async def step_names(self) -> list[str]: ...


class Journal:
    """One execution's steps: the names recorded (loaded once, on a resumed execution)
    and the steps in flight, so that one name runs once even when called concurrently."""

    __slots__ = (
        "_ahead",
        "_asked",
        "_hooks",
        "_markers",
        "_max_bytes",
        "_max_steps",
        "_names",
        "_recorded",
        "_running",
    )

    def __init__(self, hooks: JournalHooks, *, recorded: int, max_bytes: int, max_steps: int):
        self._hooks = hooks
        self._max_bytes = max_bytes
        self._max_steps = max_steps
        self._recorded = recorded  # steps of this execution recorded before this attempt
        # Made when first needed: a run that takes no step costs the collector nothing.
        self._names: set[str] | None = None
        self._running: dict[str, asyncio.Future[RecordedStep]] | None = None
        # The steps recorded before this attempt not replayed yet, markers left out
        # (none: at the live frontier), the markers recorded before it not asked yet,
        # and the recorded steps replayed since the last record (all made when needed).
        self._ahead: set[str] | None = None
        self._markers: set[str] | None = None
        self._asked: list[str] | None = None

    async def step(
        self,
        name: str,
        fn: Callable[..., Awaitable[Any] | Any],
        args: tuple[Any, ...],
        as_type: Any,
        *,
        closes_wait: bool = False,
    ) -> Any:
        """See ``ChildContext.step``; ``closes_wait``: the step is a wait's outcome, and
        the wait of that name closes in the same commit (design §21)."""
        _check_name(name)
        return await self._step(name, fn, args, as_type, closes_wait)

    async def patched(self, name: str) -> bool:
        """See ``ChildContext.patched``."""
        _check_name(name)
        await self._known()
        at_frontier = not self._ahead
        marker = PATCH_PREFIX + name
        return bool(await self._step(marker, lambda: at_frontier, (), bool, False))

    def asked(self) -> list[str]:
        """The recorded steps this attempt replayed since its last record, handed over
        (to be marked when the attempt ends or waits)."""
        asked, self._asked = self._asked or [], None
        return asked

    async def _step(
        self,
        name: str,
        fn: Callable[..., Awaitable[Any] | Any],
        args: tuple[Any, ...],
        as_type: Any,
        closes_wait: bool,
    ) -> Any:
        names = await self._known()
        if name in names:
            stored = await self._stored(name)
            self._replayed(name)
            return _decode(stored, as_type)
        if self._running is None:
            self._running = {}
        running = self._running.get(name)
        if running is not None:  # the same name, called again while it runs: once
            return _decode(await asyncio.shield(running), as_type)
        if len(names) + len(self._running) >= self._max_steps:
            raise errors.StepLimit()
        done: asyncio.Future[RecordedStep] = asyncio.get_running_loop().create_future()
        self._running[name] = done
        try:
            # What the function emits follows this sequence: the step's own events, which
            # a resume never matches (design §26) and a rewind copies with it (§35).
            began = self._hooks.numbered()
            inside = _in_step.set(True)
            try:
                result = fn(*args)
                if inspect.isawaitable(
                    result
                ):  # a coroutine function's; a plain one's is its value
                    result = await result
            finally:
                _in_step.reset(inside)
            step = _encode(result, self._max_bytes)
            # What a replay will see, seen now (design §20): a value that does not come
            # back as ``type`` is refused here, before anything is recorded.
            seen = _decoded_first(step, as_type)
            asked = self.asked()
            try:
                stored = await self._hooks.record_step(
                    name, len(names) + 1, step, closes_wait, asked, began
                )
            except BaseException:
                self._asked = asked + (self._asked or [])  # marked with a later commit
                raise
            names.add(name)
        except BaseException as exc:
            done.set_exception(exc)
            done.exception()  # retrieved: a failed step is the caller's exception only
            raise
        finally:
            del self._running[name]
        done.set_result(stored)
        # Another process recorded the name first: its value is the step's.
        return seen if stored == step else _decode(stored, as_type)

    async def has(self, name: str) -> bool:
        """Whether this execution recorded a step by that name."""
        _check_name(name)
        return name in await self._known()

    async def recorded(self, name: str, run_id: str | None, as_type: Any) -> Any:
        _check_name(name)
        stored = await self._hooks.read_step(name, run_id)
        return None if stored is None else _decode(stored, as_type)

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def count(self) -> int:
        return self._recorded if self._names is None else len(self._names)

    async def _known(self) -> set[str]:
        if self._names is None:
            self._names = set(await self._hooks.step_names()) if self._recorded else set()
            if self._names:
                self._ahead = {n for n in self._names if not n.startswith(PATCH_PREFIX)}
                self._markers = self._names - self._ahead
        return self._names

    def _replayed(self, name: str) -> None:
        """A step was asked for again: one recorded before this attempt is marked once."""
        for before in (self._ahead, self._markers):
            if before is not None and name in before:
                before.discard(name)
                if self._asked is None:
                    self._asked = []
                self._asked.append(name)
                return

    async def _stored(self, name: str) -> RecordedStep:
        stored = await self._hooks.read_step(name, None)
        if stored is None:  # recorded names leave only with their child
            raise errors.ChildPurged()
        return stored


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError("a step name must be a non-empty string")
    if name.startswith(PATCH_PREFIX[0]):  # a patch marker's kind (see the module)
        raise ValueError("a step name may not begin with U+001F (reserved for patches)")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: no database stores it as text
        raise ValueError("a step name must be valid UTF-8 text") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"a step name must be at most {MAX_NAME_BYTES} bytes")


_encoder = msgspec.json.Encoder()


def _encode(result: object, limit: int) -> RecordedStep:
    if isinstance(result, bytes | bytearray | memoryview):
        step = RecordedStep(True, bytes(result))
    else:
        try:
            step = RecordedStep(False, _encoder.encode(result))
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(
                f"a step's result must be bytes or encodable by msgspec: {exc}"
            ) from None
    if len(step.value) > limit:
        raise errors.StepTooLarge()
    return step


def _decoded_first(step: RecordedStep, as_type: Any) -> Any:
    """The value a first run's step returns: decoded from what is recorded, as a
    replay decodes it, so both see equal values (a tuple comes back a list, NaN None,
    an int key a string, unless ``type`` says otherwise)."""
    try:
        return _decode(step, as_type)
    except msgspec.MsgspecError as exc:  # encodable, but not as ``type``
        raise TypeError(f"a step's result does not decode as {as_type!r}: {exc}") from None


@overload
def _decode(stored: RecordedStep, as_type: type[T]) -> T: ...
@overload
def _decode(stored: RecordedStep, as_type: None) -> Any: ...
def _decode(stored: RecordedStep, as_type: Any) -> Any:
    if stored.raw:
        return stored.value
    if as_type is None:
        return msgspec.json.decode(stored.value)
    return msgspec.json.decode(stored.value, type=as_type)
