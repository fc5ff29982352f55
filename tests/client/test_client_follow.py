"""``Client.follow`` and ``SyncClient.follow`` against a real ``delegation serve``: a
child's events pushed as they commit (``child.follow``), on either store, over a socket
and over the stdio of a spawned host.

The ``Echo`` child emits only when the test steers it, so an event that arrives before
the next steer was pushed: nothing else could have fetched it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from delegation import Event, Params, errors
from delegation.client.api import Client, SyncClient
from delegation.host.serve_follow import MAX_FOLLOWS
from tests.harness import client_hosts
from tests.harness.client_hosts import (
    ENV,
    LEASE,
    OWNER,
    PRESET,
    ROOT,
    Opener,
    SocketHost,
    read_until_done,
    settled_threads,
    setup,
    start_params,
)

ECHO = ("--runner", "tests.harness.serve_runners:Echo")
PAGE_BYTES = 8192
CHATTY = ("--runner", "tests.harness.serve_runners:Chatty", "--max-page-bytes", str(PAGE_BYTES))

# test_client's fixtures: serve --socket hosts on the test's database, and a Client
# opened over a socket or over the stdio of a host it spawns.
socket_host = client_hosts.socket_host
opener = client_hosts.opener


@pytest.fixture
async def echo(socket_host: SocketHost, workspace: Path) -> AsyncIterator[Client]:
    """A registered client with an open tool call, over a socket, children ``Echo``."""
    async with await Client.connect(socket_host.start(*ECHO)) as client:
        await setup(client, workspace)
        yield client


async def start_echo(client: Client, request_id: str = "q1", **extra: Any) -> dict[str, Any]:
    """Start an Echo child; its read/follow params (through the lease when given)."""
    started = await client.start(start_params(request_id, "echo", **extra))
    owner = LEASE if "leaseId" in extra else OWNER
    return {**owner, "childId": started.conversation_id}


async def steer(client: Client, child: dict[str, Any], message: str) -> None:
    outcome = await client.steer({**child, "requestId": f"s-{message}", "message": message})
    assert outcome.outcome == "injected"


async def within(awaitable: Any) -> Any:
    return await asyncio.wait_for(awaitable, 60)


async def sequences(events: AsyncIterator[Event]) -> list[int]:
    return [event.sequence async for event in events]


async def test_a_follow_gives_each_event_once_in_order_as_it_commits(
    opener: Opener, workspace: Path
) -> None:
    async with await opener(*ECHO) as client:
        await setup(client, workspace)
        child = await start_echo(client)
        # A second follow at once, from event 2 on: each follow's events reach it alone.
        later = asyncio.create_task(sequences(client.follow({**child, "after": 1})))
        texts: list[str] = []
        async with contextlib.aclosing(client.follow(child)) as events:
            async for event in events:
                assert event.sequence == len(texts) + 1, "each event once, in order"
                texts.append(event.text)
                # The child waits for these steers: each event came before the next one.
                if event.text == "ready":
                    assert not (await client.read(child)).done, "other calls are answered"
                    await steer(client, child, "one")
                elif event.text == "heard: one":
                    await steer(client, child, "bye")
        assert texts == ["ready", "heard: one", "heard: bye", "bye"]
        assert (await client.read(child)).done, "it ended with the child"
        assert await within(later) == [2, 3, 4]


async def test_a_follow_from_after_gives_only_the_later_events(
    socket_host: SocketHost, workspace: Path
) -> None:
    async with await Client.connect(socket_host.start("--runner", "scripted")) as client:
        await setup(client, workspace)
        started = await client.start(start_params("q1", "work in 70 steps"))
        child = {**OWNER, "childId": started.conversation_id}
        every = [e async for e in client.follow(child)]  # 141 events: more than a page
        assert [e.sequence for e in every] == list(range(1, 142))
        assert every[-1].text == "finished 70 steps on work in 70 steps"
        read = await client.read({**child, "after": 100})
        assert [e async for e in client.follow({**child, "after": 100})] == read.events
        assert [e async for e in client.follow({**child, "after": 141})] == []


async def refusal(call: Any) -> tuple[type[BaseException], str]:
    with pytest.raises(errors.DelegationError) as raised:
        await within(call)
    return type(raised.value), str(raised.value)


async def followed(client: Client, params: Any) -> list[Event]:
    return [event async for event in client.follow(params)]


async def test_a_follow_is_refused_as_a_read_is(socket_host: SocketHost, workspace: Path) -> None:
    async with await Client.connect(socket_host.start(*ECHO)) as client:
        unregistered = {**OWNER, "childId": "c1"}
        assert await refusal(followed(client, unregistered)) == await refusal(
            client.read(unregistered)
        )
        await setup(client, workspace)
        child = await start_echo(client)
        refused = [
            {**OWNER, "childId": "c-nobody"},
            {**child, "generation": 4},
            {**child, "extensionId": "other"},
            {**child, "childRunId": "r-nope"},
            {**child, "apiKey": "sk-123"},
            {**child, "after": -1},
        ]
        for params in refused:
            kind, message = await refusal(client.read(params))
            assert await refusal(followed(client, params)) == (kind, message), params

        # Every page is a read: a lease released meanwhile ends the follow as it refuses
        # the next read.
        leased = await start_echo(client, "q2", leaseId="L1")
        async with contextlib.aclosing(client.follow(leased)) as events:
            assert (await within(anext(events))).text == "ready"
            assert (await client.release(LEASE)).done
            kind, message = await refusal(anext(events))
        assert (kind, message) == await refusal(client.read(leased))
        assert kind is errors.NotOwned


async def test_stopping_a_follow_frees_it_and_the_follows_are_bounded(echo: Client) -> None:
    child = await start_echo(echo)
    for _ in range(MAX_FOLLOWS + 4):  # more than may run at once: each was freed
        async with contextlib.aclosing(echo.follow(child)) as events:
            assert (await within(anext(events))).sequence == 1

    follows = [echo.follow(child) for _ in range(MAX_FOLLOWS)]
    for follow in follows:
        assert (await within(anext(follow))).text == "ready"
    with pytest.raises(errors.FollowLimit, match="too many follows on this connection"):
        await within(anext(echo.follow(child)))
    assert not (await echo.read(child)).done, "a slot is left for other calls"
    await follows.pop().aclose()
    extra = echo.follow(child)
    assert (await within(anext(extra))).text == "ready"
    follows.append(extra)

    await steer(echo, child, "bye")
    for follow in follows:  # the rest end with the child
        assert [e.text async for e in follow] == ["heard: bye", "bye"]
    assert (await within(anext(echo.follow({**child, "after": 1})))).text == "heard: bye"


@pytest.mark.parametrize(("bound", "spelled"), [(1, "json"), (5_000, "struct"), (20_000, "dict")])
async def test_a_lagging_follow_waits_in_bounded_bytes_and_misses_no_event(
    socket_host: SocketHost,
    workspace: Path,
    caplog: pytest.LogCaptureFixture,
    bound: int,
    spelled: str,
) -> None:
    """300 events of about 1 kB, pushed at once in pages of 8 KiB to a caller that takes
    one and then lags: what waits in the client stays within ``max_buffered`` (or one
    page), and the caller still gets every event once, in order, however its params
    were spelled (the follow starts again after the last event given)."""
    caplog.set_level(logging.DEBUG, logger="delegation.client")
    async with await Client.connect(socket_host.start(*CHATTY)) as client:
        await setup(client, workspace)
        started = await client.start(start_params("q1", "emit 300"))
        child = {**OWNER, "childId": started.conversation_id}
        await within(read_until_done(client, child))
        params: Any = child
        if spelled != "dict":
            params = msgspec.json.encode(child).decode()
        if spelled == "struct":
            params = msgspec.json.decode(params, type=Params)
        events = client.follow(params, max_buffered=bound)
        first = await within(anext(events))
        waiting = await within(until_overflowed(client))  # the host pushes meanwhile
        rest = await within(sequences(events))
        assert not client._follows
        assert not client._stops
    assert [first.sequence, *rest] == list(range(1, 301))
    assert waiting <= max(bound, PAGE_BYTES + 1024)
    assert logged(caplog, "client_follow_again")


async def until_overflowed(client: Client) -> int:
    """Wait until a follow of ``client`` overflows; the most bytes that waited till then."""
    waiting = 0
    while True:
        waiting = max(waiting, sum(pages.bytes for pages in client._follows.values()))
        if any(pages.overflowed for pages in client._follows.values()):
            return waiting
        await asyncio.sleep(0.005)


def logged(caplog: pytest.LogCaptureFixture, action: str) -> bool:
    return any(getattr(record, "action", "") == action for record in caplog.records)


async def until_logged(caplog: pytest.LogCaptureFixture, action: str) -> None:
    while not logged(caplog, action):
        await asyncio.sleep(0.005)


async def slot_taken(client: Client, child: dict[str, Any]) -> AsyncIterator[Event]:
    """A new follow of ``child``, once the host has a follow free for it (given its first
    event)."""
    while True:
        follow = client.follow(child)
        try:
            assert (await anext(follow)).sequence == 1
        except errors.FollowLimit:
            await asyncio.sleep(0.005)
        else:
            return follow


async def test_a_follow_started_again_waits_for_a_free_follow_and_misses_no_event(
    socket_host: SocketHost, workspace: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lagging follow overflows and its slot is taken by another follow before it
    starts again: it waits until a follow ends, then gives every event once, in order."""
    caplog.set_level(logging.DEBUG, logger="delegation.client")
    async with await Client.connect(socket_host.start(*CHATTY)) as client:
        await setup(client, workspace)
        started = await client.start(start_params("q1", "emit 300 and wait"))
        child = {**OWNER, "childId": started.conversation_id}
        lagging = client.follow(child, max_buffered=1)
        first = await within(anext(lagging))
        others = [client.follow(child) for _ in range(MAX_FOLLOWS - 1)]
        for other in others:  # every follow of the connection is taken
            assert (await within(anext(other))).sequence == 1
        await within(until_overflowed(client))
        late = await within(slot_taken(client, child))  # the one the lagging follow gave back
        rest = asyncio.create_task(sequences(lagging))
        await within(until_logged(caplog, "client_follow_waits"))
        await others.pop().aclose()  # a follow ends: the lagging one starts again
        await steer(client, child, "bye")
        sequence = await within(rest)
        for follow in [*others, late]:
            await follow.aclose()
    assert [first.sequence, *sequence] == list(range(1, 301))  # ended after the steer


async def test_ids_that_spell_a_lifecycle_method_do_not_hold_the_stream_behind_a_follow(
    socket_host: SocketHost, workspace: Path
) -> None:
    """A runId ``run.finish`` puts that name in every line of the follow: the stream
    must not take the follow for a lifecycle call and order everything after it."""
    async with await Client.connect(socket_host.start(*ECHO)) as client:
        await client.register("r1", "h1")
        await client.begin_tool(
            run_id="run.finish", conversation_id="conv-1", tool_call_id="call-1",
            extension_id="ext", presets=[PRESET], workspace=str(workspace),
        )  # fmt: skip
        owner = {**OWNER, "runId": "run.finish"}
        started = await client.start({**start_params("q1", "echo"), **owner})
        child = {**owner, "childId": started.conversation_id}
        async with contextlib.aclosing(client.follow(child)) as events:
            assert (await within(anext(events))).text == "ready"
            assert not (await within(client.read(child))).done
            await steer(client, child, "bye")
            assert [e.text async for e in events] == ["heard: bye", "bye"]


def test_the_sync_client_follows(db_url: str, workspace: Path) -> None:
    before = set(threading.enumerate())
    with SyncClient.spawn(["--db", db_url, *ECHO], env=ENV, cwd=ROOT) as client:
        client.register("r1", "h1")
        client.begin_tool(
            run_id="run-1", conversation_id="conv-1", tool_call_id="call-1",
            extension_id="ext", presets=[PRESET], workspace=str(workspace),
        )  # fmt: skip
        started = client.start(start_params("q1", "echo"))
        child = {**OWNER, "childId": started.conversation_id}
        with contextlib.closing(client.follow(child)) as events:
            assert next(events).text == "ready"  # then stopped: the host answers it
        texts = []
        for event in client.follow(child):
            texts.append(event.text)
            if event.text == "ready":
                client.steer({**child, "requestId": "s1", "message": "bye"})
        assert texts == ["ready", "heard: bye", "bye"]
        with pytest.raises(errors.ChildNotOwned):
            next(client.follow({**OWNER, "childId": "c-nobody"}))
    assert settled_threads(before) == set()
