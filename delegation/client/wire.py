"""The client's side of the host protocol's lines (:mod:`delegation.client.api`): the
shapes it decodes answers and notices into, how it spells child params, how it splits
what the host sends into lines, and a follow's pages waiting for their caller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec

from delegation import errors
from delegation.codec import checked
from delegation.wire import Event, Params, ParamsLike

# How much one read of the host's answers takes at most. An answer is one line of any
# length: a page is bounded by the host's max_page_bytes, but a child's output and error
# come whole. Requests are bounded by the host at 4 MiB.
READ_CHUNK = 1024 * 1024


class Failure(msgspec.Struct, frozen=True):
    code: int
    message: str
    data: dict[str, Any] | None = None


class AnswerId(msgspec.Struct, frozen=True):
    id: int | str | None = None


class Reply(AnswerId, frozen=True):
    result: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    error: Failure | msgspec.UnsetType = msgspec.UNSET


class Notice(msgspec.Struct, frozen=True):
    method: str = ""
    params: msgspec.Raw = msgspec.Raw(b"{}")


answers = msgspec.json.Decoder(Reply)
notices = msgspec.json.Decoder(Notice)
answer_ids = msgspec.json.Decoder(AnswerId)
json_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
encoder = msgspec.json.Encoder()


class FollowPages:
    """One follow's pages of events that came and whose events were not all given yet
    (the page in the caller's hands counts until its last event is), with their size on
    the wire, bounded: a page that would take them past ``limit`` (while any wait; one
    page is always taken) overflows the follow, and it and every later page are dropped.
    ``None`` after the last page: the follow's answer came."""

    __slots__ = ("bytes", "limit", "overflowed", "queue")

    def __init__(self, limit: int) -> None:
        self.queue: asyncio.Queue[tuple[list[Event], int] | None] = asyncio.Queue()
        self.bytes = 0
        self.limit = limit
        self.overflowed = False

    def put(self, events: list[Event], size: int) -> bool:
        """Keep a page unless the follow overflows; True: it overflowed with this one."""
        if self.overflowed:
            return False
        if self.bytes and self.bytes + size > self.limit:
            self.overflowed = True
            return True
        self.bytes += size
        self.queue.put_nowait((events, size))
        return False

    def end(self, _answer: object = None) -> None:
        self.queue.put_nowait(None)

    async def get(self) -> tuple[list[Event], int] | None:
        """The next page and its size (hand it back with :meth:`given`), or None."""
        return await self.queue.get()

    def given(self, size: int) -> None:
        """The last event of a page of ``size`` bytes was given to the caller."""
        self.bytes -= size


def params_after(wire: Params | Mapping[str, Any] | msgspec.Raw, after: int) -> Any:
    """``wire`` (child params as sent) with ``after`` in place of its own."""
    if isinstance(wire, Params):
        return msgspec.structs.replace(wire, after=after)
    if isinstance(wire, msgspec.Raw):
        wire = json_object.decode(bytes(wire))
    return {**wire, "after": after}


def wire_params(params: ParamsLike) -> Params | Mapping[str, Any] | msgspec.Raw:
    """What a child method sends; the host decodes it strictly (with its own providers).
    Typed Params are checked here as their JSON would be (msgspec checks no type, and
    bytes or a UUID would cross as text)."""
    if isinstance(params, Params):
        return checked(params, Params, providers=None)
    if isinstance(params, Mapping):
        return dict(params)
    if isinstance(params, bytes | bytearray | memoryview | str):
        try:
            data = params.encode() if isinstance(params, str) else bytes(params)
            json_object.decode(data)
        except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
            raise errors.MalformedInput(f"malformed child input: {exc}") from exc
        return msgspec.Raw(msgspec.json.format(data, indent=0))  # one line: one frame
    raise errors.MalformedInput("child params must be Params, JSON or a dict")


async def read_lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The lines of ``reader`` (a last one without its newline too), whatever their
    length: ``readline`` would end the whole stream at its buffer's limit, failing
    every call in flight for one long answer."""
    partial = bytearray()  # the start of a line the chunks so far did not end
    while chunk := await reader.read(READ_CHUNK):
        first, *lines = chunk.split(b"\n")
        if not lines:
            partial += first
            continue
        lines.insert(0, bytes(partial + first) if partial else first)  # it ends the partial
        partial = bytearray(lines.pop())
        for line in lines:
            if line.strip():
                yield line
    if partial.strip():
        yield bytes(partial)


def unreadable(line: bytes, exc: Exception) -> Reply:
    """An answer that is not the JSON-RPC shape fails its call (when its id is readable)."""
    try:
        request_id = answer_ids.decode(line).id
    except (msgspec.MsgspecError, ValueError):
        request_id = None
    failure = Failure(-32603, f"unreadable answer: {exc}", {"reason": "internal_error"})
    return Reply(request_id, error=failure)
