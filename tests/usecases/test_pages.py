"""Pages are bounded by encoded bytes (design §18): a page stops before the event that
would take its encoded answer past ``max_page_bytes``, always holds one event, and one
event's encoding is bounded because its cut fields are measured after JSON escaping.
Paging on with ``after``, and ``Engine.follow``, still give every event exactly once."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from delegation import ChildContext, EngineConfig, Event, Result
from delegation.codec import encode
from delegation.run.context import NAME_LIMIT
from tests.harness.support import Harness, Script

FIELD_LIMIT = 32 * 1024
COUNT = 140  # more than one page of 128 events even were pages bounded by count only
# What each character takes once JSON-escaped: a control character six bytes, a quote
# two, a letter one.
CONTENTS = {"control": "\x01", "quote": '"', "plain": "a"}
# One event with every field at its cap: four cut fields, three names and the rest.
EVENT_BOUND = 4 * FIELD_LIMIT + 3 * NAME_LIMIT + 200


def escaped(value: str) -> int:
    """The bytes ``value`` takes inside a JSON string, quotes excluded."""
    return len(msgspec.json.encode(value)) - 2


def capped_events(char: str, count: int = COUNT) -> Script:
    """A run that emits ``count`` events whose every field is over its cap of ``char``."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for _ in range(count):
            ctx.emit(
                Event(
                    kind=char * 2 * NAME_LIMIT,
                    text=char * 2 * FIELD_LIMIT,
                    tool_name=char * 2 * NAME_LIMIT,
                    tool_call_id=char * 2 * NAME_LIMIT,
                    input=char * 2 * FIELD_LIMIT,
                    tool_output=char * 2 * FIELD_LIMIT,
                    success=True,
                    error=char * 2 * FIELD_LIMIT,
                )
            )
        await ctx.flush()

    return run


async def read_pages(harness: Harness, child_id: str) -> list[Result]:
    """Every page of a finished child, ``after`` the last event of the one before, until
    a page comes back empty."""
    pages: list[Result] = []
    after = 0
    while True:
        page = await harness.read(child_id, after=after)
        pages.append(page)
        if not page.events:
            return pages
        after = page.events[-1].sequence


@pytest.mark.parametrize("char", list(CONTENTS.values()), ids=list(CONTENTS))
async def test_a_page_of_capped_events_stays_within_max_page_bytes(
    harness: Harness, char: str
) -> None:
    max_bytes = harness.engine.config.max_page_bytes
    assert max_bytes == 4 * 1024 * 1024
    harness.runner.script = capped_events(char)
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    pages = await read_pages(harness, started.conversation_id)
    sizes = [len(encode(page)) for page in pages]
    assert max(sizes) <= max_bytes, sizes
    for page, following in itertools.pairwise(pages[:-1]):
        # Cut only where the next event would take the answer past the bound.
        longer = msgspec.structs.replace(page, events=[*page.events, following.events[0]])
        assert len(encode(longer)) > max_bytes
    seen = [event.sequence for page in pages for event in page.events]
    assert seen == list(range(1, COUNT + 1))
    event = pages[0].events[0]
    assert len(encode(event)) <= EVENT_BOUND
    for value, limit in ((event.text, FIELD_LIMIT), (event.error, FIELD_LIMIT),
                         (event.input, FIELD_LIMIT), (event.tool_output, FIELD_LIMIT),
                         (event.kind, NAME_LIMIT), (event.tool_name, NAME_LIMIT)):  # fmt: skip
        assert value == char * len(value)
        assert escaped(value) <= limit < escaped(value + char)  # cut after escaping, no less
    # Engine.follow reads again at once after a page cut by bytes (fewer than 128 events):
    # it does not take such a page of a finished child for its last.
    followed = [e.sequence async for e in harness.engine.follow(started.conversation_id)]
    assert followed == list(range(1, COUNT + 1))


@pytest.mark.parametrize("config", [EngineConfig(max_page_bytes=1000)], ids=["1000-bytes"])
async def test_a_page_holds_one_event_even_past_max_page_bytes(harness: Harness) -> None:
    harness.runner.script = capped_events("a", count=3)
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    pages = await read_pages(harness, started.conversation_id)
    assert [[e.sequence for e in page.events] for page in pages] == [[1], [2], [3], []]
    assert all(len(encode(page)) > 1000 for page in pages[:-1])


def test_max_page_bytes_must_be_positive() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            EngineConfig(max_page_bytes=bad)


@pytest.mark.parametrize("char", list(CONTENTS.values()), ids=list(CONTENTS))
async def test_a_runs_failure_is_cut_as_an_event_field_and_keeps_pages_bounded(
    harness: Harness, char: str
) -> None:
    # Every page carries the child's error: a runner's exception of 8 MB (48 MB once
    # escaped, for control characters) must not make each read of the child that big.
    failure = char * (8 * 1024 * 1024)

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        raise RuntimeError(failure)

    harness.runner.script = run
    started = await harness.start("q1")
    done = await harness.wait_done(started.conversation_id)
    assert done.error == char * len(done.error)
    assert escaped(done.error) <= FIELD_LIMIT < escaped(done.error + char)
    page = await harness.read(started.conversation_id)
    assert page.error == done.error
    assert len(encode(page)) <= harness.engine.config.max_page_bytes
