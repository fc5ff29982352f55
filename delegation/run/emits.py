"""A resumed run's emits, matched with the events its execution committed (design §26).

A run's emits between its steps are deterministic, as its step names are: a resumed run
that passes by them again emits them again, in the same order. The events its execution
committed before this attempt, of the run's own kinds (not the engine's
:data:`~delegation.records.ENGINE_KINDS`) and but for those a recorded step's function
emitted (the step's own, between its ``first_sequence`` and ``last_sequence``: a replayed
step does not run, so does not emit them again), are read once, when it resumes, and kept as a
sequence and an 8-byte digest each (16 bytes an event, never a body). The k-th emit of
the resumed run that is the k-th of them (the same event, cut and encoded as the engine
stores it, but for its sequence) is not written again: ``emit`` returns that event's
sequence. Past them, emits continue the sequence after the last committed event.

An emit that differs (another kind, another text) is where the run took another path,
as a step called by a name its execution never recorded runs anew: it is written, and
so is every later emit; the committed events left are matched no more. That is logged
once, ``emits_diverged``. Nothing committed is ever dropped or rewritten.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from array import array
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import msgspec

from delegation.codec import encode
from delegation.records import ENGINE_KINDS
from delegation.store import events, steps
from delegation.store.sql import Connection
from delegation.wire import Event

log = logging.getLogger("delegation.engine")

DIGEST_BYTES = 8
_stored = msgspec.json.Decoder(Event)

Pages = list[tuple[int, bytes]]
Read = Callable[[Callable[[Connection], Any]], Awaitable[Any]]


def is_engine_kind(kind: str) -> bool:
    """Whether ``kind`` is one of the engine's own (whatever its case or surrounding
    spaces): a run may not emit it (design §26)."""
    return kind.strip().lower() in ENGINE_KINDS


def digest(event: Event) -> bytes:
    """What an event is, but for its sequence: the digest of its encoding."""
    body = encode(msgspec.structs.replace(event, sequence=0))
    return hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


class Committed:
    """The run's own events its execution committed before this attempt, in order, and
    how many of them the resumed run's emits matched so far (see the module)."""

    __slots__ = ("_digests", "_next", "_run_id", "_sequences")

    def __init__(self, run_id: str) -> None:
        self._run_id = run_id
        self._sequences = array("q")
        self._digests = bytearray()
        self._next = 0  # the committed event the next emit is matched with

    def add(self, sequence: int, body: bytes) -> None:
        """Keep the committed event ``body`` (numbered ``sequence``), unless it is one
        the engine wrote (then it is no emit's)."""
        try:
            event = _stored.decode(body)
        except msgspec.MsgspecError:
            # Not an event of this version: kept as one no emit matches (written anew
            # rather than taken for something it may not be).
            found = hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()
        else:
            if is_engine_kind(event.kind):
                return
            found = digest(event)
        self._sequences.append(sequence)
        self._digests += found

    def __len__(self) -> int:
        return len(self._sequences)

    def match(self, event: Event) -> int | None:
        """The sequence of the committed event ``event`` (cut, as stored) is, or None
        when it is new: past them all, or different (and then every later emit too)."""
        k = self._next
        if k >= len(self._sequences):
            return None
        if digest(event) != self._digests[k * DIGEST_BYTES : (k + 1) * DIGEST_BYTES]:
            log.warning(
                "a resumed run's emit %d differs from the event its execution committed"
                " there (sequence %d): it and every later emit are written anew",
                k + 1,
                self._sequences[k],
                extra={"action": "emits_diverged", "run_id": self._run_id},
            )
            self._end()
            return None
        self._next = k + 1
        sequence = self._sequences[k]
        if self._next == len(self._sequences):
            self._end()
        return sequence

    def _end(self) -> None:
        """No emit is matched any more: what was kept is let go."""
        self._sequences, self._digests, self._next = array("q"), bytearray(), 0


async def committed(
    read: Read,
    child_id: int,
    run_id: str,
    last_sequence: int,
    per_read: int,
    max_bytes: int,
    *,
    recorded: int,
) -> Committed | None:
    """The run's own events its execution committed up to ``last_sequence`` (its
    resume's ``recovery`` event), read by ``read`` in pages of at most ``per_read``
    events and ``max_bytes``, but for those a step's function emitted (its own, which a
    replay of the step does not emit again: never matched; none when the execution
    ``recorded`` no step); None when there are none."""
    found = Committed(run_id)
    inside = None if recorded else _Ranges([])
    after = 0
    while after < last_sequence:
        paged = partial(
            events.numbered_within,
            child_id=child_id,
            after=after,
            last=last_sequence,
            limit=per_read,
            max_bytes=max_bytes,
        )
        if inside is None:  # the steps' own events, in the first page's read
            own, page = await read(partial(_with_own, child_id=child_id, paged=paged))
            inside = _Ranges(own)
        else:
            page = await read(paged)
        if not page:
            break
        for sequence, body in page:
            if not inside.holds(sequence):
                found.add(sequence, body)
        after = page[-1][0]
    return found if len(found) else None


def _with_own(
    conn: Connection, child_id: int, paged: Callable[[Connection], Pages]
) -> tuple[list[tuple[int, int]], Pages]:
    return steps.own_events(conn, child_id), paged(conn)


class _Ranges:
    """Sequences after the first of each pair, up to its second (overlaps merged)."""

    def __init__(self, pairs: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for first, last in sorted(pairs):
            if merged and first <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        self._firsts = [first for first, _ in merged]
        self._lasts = [last for _, last in merged]

    def holds(self, sequence: int) -> bool:
        i = bisect.bisect_left(self._firsts, sequence) - 1
        return i >= 0 and sequence <= self._lasts[i]
