"""A child's waits as its run sees them (design §21): ``ctx.ask``, ``ctx.sleep`` and
``ctx.wait_event``.

Each is a named step of the journal (design §15): once it ended (answered, slept,
given its event, or timed out) its outcome is recorded under its name, and a replay
gets it back at once. Until then its wait is a row (:mod:`delegation.usecases.waiting`):
opened once (an input request commits with its ``input-required`` event), read again
whenever the engine says something may have come. The run waits in memory at most
``hold_s`` in a row; past it the engine suspends the child (``waiting``, its task ended)
and wakes it as a resume when what it waits for comes, or its time does. A timeout
ends the wait with ``InputTimeout`` or ``EventTimeout``, raised where the run waits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from delegation import errors
from delegation._struct import utf8_len
from delegation.records import INPUT_REQUIRED_KIND
from delegation.run.journal import Journal
from delegation.store.waits import WaitRow
from delegation.usecases.waiting import APPROVAL_OPTIONS, MAX_KEY_BYTES, WaitSpec
from delegation.wire import MAX_MESSAGE_BYTES, Event

MAX_OPTIONS = 32
_json = msgspec.json.Encoder()
_outcome = msgspec.json.Decoder(dict[str, Any])


class WaitHooks(Protocol):
    """What the engine does for a run's waits: its committed writes and reads."""

    def now(self) -> float: ...

    async def wait_state(self, name: str) -> WaitRow | None: ...

    async def open_wait(
        self, name: str, spec: WaitSpec, event: tuple[int, bytes] | None
    ) -> WaitRow: ...

    async def take_event(self, name: str) -> WaitRow: ...

    async def suspend_waiting(self) -> bool: ...


class Waits:
    """One execution's waits (see the module)."""

    __slots__ = ("_hold_s", "_hooks", "_journal", "_news", "_numbered")

    def __init__(
        self,
        hooks: WaitHooks,
        journal: Journal,
        *,
        hold_s: float,
        numbered: Callable[[Event], tuple[int, bytes]],
    ) -> None:
        self._hooks = hooks
        self._journal = journal
        self._hold_s = hold_s
        self._numbered = numbered  # an event given its sequence and encoded, not emitted
        self._news: set[asyncio.Event] | None = None  # made by the first wait

    # --- the three waits --------------------------------------------------------------

    async def ask(
        self,
        name: str,
        prompt: str,
        *,
        kind: str,
        options: Sequence[str] | None,
        tool_name: str | None,
        tool_call_id: str | None,
        input: Any,  # noqa: A002 (design §21 names it)
        timeout: float | None,
    ) -> str:
        spec = _input_spec(prompt, kind, options, tool_name, tool_call_id, input)
        seconds = _seconds(timeout, "timeout")
        if await self._journal.has(name):
            return _answer(await self._recorded(name))
        row = await self._hooks.wait_state(name)
        if row is None:
            expires = None if seconds is None else self._hooks.now() + seconds
            event = Event(
                kind=INPUT_REQUIRED_KIND,  # A2A's state
                text=spec.prompt,
                tool_name=spec.tool_name,
                tool_call_id=spec.tool_call_id,
                input=spec.input,
            )
            spec = dataclasses.replace(spec, expires_at=expires)
            row = await self._hooks.open_wait(name, spec, self._numbered(event))
        row = await self._settle(name, row, take=False)
        outcome = {"answer": _decoded(row.answer)} if row.answered else {"timeout": True}
        return _answer(await self._record(name, outcome))

    async def sleep(self, name: str, seconds: float) -> None:
        delay = _seconds(seconds, "seconds", zero=True)
        if await self._journal.has(name):
            await self._recorded(name)
            return
        row = await self._hooks.wait_state(name)
        if row is None:
            wake = self._hooks.now() + (delay or 0.0)
            row = await self._hooks.open_wait(name, WaitSpec("sleep", expires_at=wake), None)
        row = await self._settle(name, row, take=False)
        await self._record(name, {"slept_until": row.expires_at})

    async def wait_event(self, name: str, key: str, timeout: float | None) -> Any:
        if not isinstance(key, str) or not key.strip() or utf8_len(key) > MAX_KEY_BYTES:
            raise ValueError("an event key must be nonempty text of at most 1 KiB")
        seconds = _seconds(timeout, "timeout")
        if await self._journal.has(name):
            return _payload(await self._recorded(name))
        row = await self._hooks.wait_state(name)
        if row is None:
            expires = None if seconds is None else self._hooks.now() + seconds
            spec = WaitSpec("event", event_key=key, expires_at=expires)
            row = await self._hooks.open_wait(name, spec, None)
        if row.event_key != key:
            raise ValueError(f"wait {name!r} waits for event {row.event_key!r}, not {key!r}")
        row = await self._settle(name, row, take=True)
        outcome = {"payload": _decoded(row.answer)} if row.answered else {"timeout": True}
        return _payload(await self._record(name, outcome))

    # --- the engine's side ------------------------------------------------------------

    def notify(self) -> None:
        """Something this run waits for may have come: every wait reads again."""
        for news in self._news or ():
            news.set()

    # --- waiting ----------------------------------------------------------------------

    async def _settle(self, name: str, row: WaitRow, *, take: bool) -> WaitRow:
        """The wait once it can end: answered (given its event) or past its time. In
        memory for ``hold_s`` at most in a row; then the child is suspended (this raises
        ``CancelledError``: the engine ends the run's task), unless something came."""
        loop = asyncio.get_running_loop()
        held_until = loop.time() + self._hold_s
        while not row.answered and not row.expired(self._hooks.now()):
            left = held_until - loop.time()
            if left <= 0:
                if await self._hooks.suspend_waiting():
                    raise asyncio.CancelledError()  # the run's task is being cancelled
                held_until = loop.time() + self._hold_s  # something can end: read again
            else:
                expiry = math.inf if row.expires_at is None else row.expires_at
                await self._quiet(min(left, expiry - self._hooks.now()))
            again = await (self._hooks.take_event(name) if take else self._hooks.wait_state(name))
            assert again is not None  # opened by this run; waits leave only with the child
            row = again
        return row

    async def _quiet(self, seconds: float) -> None:
        """Until :meth:`notify`, or ``seconds`` pass."""
        if seconds <= 0:
            return
        news = asyncio.Event()
        if self._news is None:
            self._news = set()
        self._news.add(news)
        try:
            async with asyncio.timeout(seconds):
                await news.wait()
        except TimeoutError:
            pass
        finally:
            self._news.discard(news)

    async def _record(self, name: str, outcome: dict[str, Any]) -> dict[str, Any]:
        """Record the wait's outcome as its step, closing the wait in the same commit."""
        recorded = await self._journal.step(name, lambda: outcome, (), None, closes_wait=True)
        return _as_outcome(name, recorded)

    async def _recorded(self, name: str) -> dict[str, Any]:
        return _as_outcome(name, await self._journal.step(name, _never, (), None))


def _never() -> None:
    raise AssertionError("a recorded step's function is never called")


def _as_outcome(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not value.keys() & {"answer", "payload", "timeout",
                                                          "slept_until"}:  # fmt: skip
        raise ValueError(f"step {name!r} was recorded by something other than a wait")
    return value


def _answer(outcome: dict[str, Any]) -> str:
    if outcome.get("timeout"):
        raise errors.InputTimeout()
    return str(outcome["answer"])


def _payload(outcome: dict[str, Any]) -> Any:
    if outcome.get("timeout"):
        raise errors.EventTimeout()
    return outcome["payload"]


def _decoded(value: bytes | None) -> Any:
    return None if value is None else msgspec.json.decode(value)


def _seconds(value: float | None, what: str, *, zero: bool = False) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a number of seconds")
    if value < 0 or (value == 0 and not zero) or value >= 10**9:
        raise ValueError(f"{what} must be a positive number of seconds")
    return float(value)


def _input_spec(
    prompt: str,
    kind: str,
    options: Sequence[str] | None,
    tool_name: str | None,
    tool_call_id: str | None,
    input: Any,  # noqa: A002
) -> WaitSpec:
    if kind not in ("input", "approval"):
        raise ValueError(f"an ask is an input or an approval, not {kind!r}")
    if not isinstance(prompt, str) or utf8_len(prompt) > MAX_MESSAGE_BYTES:
        raise ValueError("an ask's prompt must be text of at most 512 KiB")
    chosen = tuple(options) if options is not None else (APPROVAL_OPTIONS if kind == "approval"
                                                          else ())  # fmt: skip
    if isinstance(options, str) or not all(isinstance(o, str) and o.strip() for o in chosen):
        raise ValueError("an ask's options must be nonempty strings")
    if len(set(chosen)) != len(chosen) or len(chosen) > MAX_OPTIONS:
        raise ValueError(f"an ask's options must be distinct, at most {MAX_OPTIONS}")
    if input is None:
        shown = ""
    elif isinstance(input, str):
        shown = input
    else:
        try:
            shown = _json.encode(input).decode()
        except (TypeError, msgspec.EncodeError) as exc:
            raise ValueError(f"an ask's input must be text or JSON-encodable: {exc}") from None
    return WaitSpec(
        kind,
        prompt=prompt,
        options=chosen,
        tool_name=tool_name or "",
        tool_call_id=tool_call_id or "",
        input=shown,
    )
