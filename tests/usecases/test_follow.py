"""The one follow loop (delegation.usecases.follow) that the engine, the CLI and the web page share:
full pages are read again at once, a page that is not full ends the follow only when the
child was terminal then, a commit during a read is not slept past, and a wake that says
stop ends it without the end; a follower never woken still reads again and ends, and a
read the database could not answer is tried again."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import pytest

from delegation import errors
from delegation.usecases import follow
from delegation.wire import Event


@dataclass
class Page:
    events: list[Event]
    done: bool


@dataclass
class Child:
    """A child's committed events, its state, and the follower's wake."""

    committed: list[Event] = field(default_factory=list)
    terminal: bool = False
    count: int = 0
    waits: int = 0
    reads: list[int] = field(default_factory=list)
    on_read: list[str] = field(default_factory=list)  # what a read commits meanwhile

    def commit(self, n: int = 1, *, end: bool = False) -> None:
        for _ in range(n):
            self.committed.append(Event(kind="text", text="x", sequence=len(self.committed) + 1))
        self.terminal = end
        self.count += 1

    async def read(self, after: int, limit: int) -> Page:
        self.reads.append(after)
        page = Page([e for e in self.committed if e.sequence > after][:limit], self.terminal)
        if self.on_read:
            self.commit(end=self.on_read.pop(0) == "end")  # lands after the read
        return page

    def version(self) -> int:
        return self.count

    async def moved(self, since: int) -> bool:
        self.waits += 1
        while self.count == since:
            if self.waits > 5:
                return False  # the source stops (a server shutting down)
            await asyncio.sleep(0)
            if self.waits == 1:
                self.commit(3, end=True)
        return True


async def test_full_pages_are_read_at_once_and_the_terminal_one_ends_it() -> None:
    child = Child()
    child.commit(10, end=True)
    got = [e.sequence async for e in follow.events(child.read, child, 0, 4)]
    assert got == list(range(1, 11))
    assert child.reads == [0, 4, 8] and child.waits == 0


async def test_a_child_still_running_is_waited_for_then_followed_to_its_end() -> None:
    child = Child()
    child.commit(2)
    got = [e.sequence async for e in follow.events(child.read, child, 1, 128)]
    assert got == [2, 3, 4, 5]
    assert child.waits == 1


async def test_a_commit_during_a_read_is_not_slept_past() -> None:
    child = Child(on_read=["end"])
    child.commit(1)
    got = [e.sequence async for e in follow.events(child.read, child, 0, 128)]
    assert got == [1, 2]
    assert child.waits == 1  # moved at once: the version was taken before the read


async def test_a_wake_that_says_stop_ends_the_follow_on_the_last_page() -> None:
    child = Child(waits=5)
    child.commit(1)
    got = [page async for page in follow.pages(child.read, child, 0, 128)]
    assert [len(p.events) for p in got] == [1] and not got[-1].done


class Silent:
    """A wake that never moves: every notice is lost."""

    def version(self) -> int:
        return 0

    async def moved(self, since: int) -> bool:
        await asyncio.Event().wait()
        return True


async def test_a_follower_never_woken_reads_again_and_ends_with_the_child() -> None:
    """A lost notice (or an end that sent none) delays the end, never hangs it."""
    child = Child()
    child.commit(2)
    got: list[int] = []

    async def follower() -> None:
        async for event in follow.events(child.read, Silent(), 0, 128):
            got.append(event.sequence)

    task = asyncio.create_task(follower())
    while len(child.reads) < 2:  # it read again with no wake-up
        await asyncio.sleep(0.01)
    child.commit(1, end=True)
    await asyncio.wait_for(task, 60)
    assert got == [1, 2, 3]


async def test_a_read_the_database_could_not_answer_is_logged_once_and_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="delegation")
    child = Child()
    child.commit(3, end=True)
    failures = [errors.StoreUnavailable(), errors.DatabaseBusy(), errors.StoreUnavailable()]

    async def read(after: int, limit: int) -> Page:
        if failures:
            raise failures.pop(0)
        return await child.read(after, limit)

    got = [e.sequence async for e in follow.events(read, child, 0, 128)]
    assert got == [1, 2, 3] and not failures
    failed = [r for r in caplog.records if getattr(r, "action", "") == "follow_read_failed"]
    assert len(failed) == 1, "a run of failures is logged once"


async def test_a_read_that_fails_otherwise_ends_the_follow_with_its_error() -> None:
    child = Child()
    child.commit(1)

    async def read(after: int, limit: int) -> Page:
        if child.reads:
            raise errors.ChildPurged()
        return await child.read(after, limit)

    with pytest.raises(errors.ChildPurged):
        async for _ in follow.events(read, Silent(), 0, 128):
            pass


class _Waiting:
    """A child that never ends, and a wake the test sets."""

    def __init__(self) -> None:
        self.woken = asyncio.Event()

    async def read(self, after: int, limit: int) -> Page:
        return Page([], False)

    def version(self) -> int:
        return 0

    async def moved(self, since: int) -> bool:
        await self.woken.wait()
        self.woken.clear()
        return True


async def test_a_follow_cancelled_as_its_wake_up_comes_ends() -> None:
    # A follow stopped in the very turn its child commits (serve's child.follow.stop
    # meeting a notice) must end: Python 3.11's wait_for swallowed that cancellation,
    # and the follow read on forever while its caller waited for its answer.
    child = _Waiting()

    async def consume() -> None:
        async for _ in follow.pages(child.read, child, 0, 128):
            pass

    task = asyncio.create_task(consume())
    for _ in range(5):  # into the wait for a wake-up
        await asyncio.sleep(0)
    child.woken.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done == {task}, "the cancelled follow still runs"
    assert task.cancelled()
