"""``delegation web`` under what one client or one row may do (design §18): event streams
bounded in bytes per client, lists that read columns and never a child's stored
request, query values that are never a 500, and the same safe headers on every answer.

The page is the real app served by uvicorn in this process (so the test sees its
stream count and its SQL) or the real command (``tests/harness/browser.py``); the engine writing
beside it is a real one, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import re
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import psycopg
import pytest
from sqlalchemy import Engine, event

from delegation import ChildContext, Event
from delegation.clock import SystemClock
from delegation.usecases.inspector import PAGE_BYTES, Inspector
from delegation.web import app as web
from delegation.web.stream import MAX_STREAMS, MAX_UNSENT_BYTES
from tests.harness import browser
from tests.harness.page import fill, get, rows, stream
from tests.harness.page import until as until_drawn
from tests.harness.support import Harness, finish_after_admit
from tests.harness.web_serving import serving

FIELD = "x" * 32 * 1024  # a text field at the engine's default cap
BIG = {"text": FIELD, "input": FIELD, "tool_output": FIELD, "error": FIELD}  # ~128 KiB
RECEIVE_BUFFER = 4096


@pytest.fixture
def clock() -> SystemClock:
    """Real time: the page shows ages and lease deadlines against the wall clock."""
    return SystemClock()


@contextlib.asynccontextmanager
async def served(url: str) -> AsyncIterator[tuple[web.Routes, str]]:
    """The page of ``url`` served by uvicorn on this test's loop: it and its address."""
    with Inspector(url) as inspector:
        page = web.Routes(inspector)
        listener = web.bind("127.0.0.1", 0)
        async with serving(page, page.app(web.allowed_hosts("127.0.0.1"), None), listener):
            yield page, web.address(listener)


async def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {timeout:.0f} s"
        await asyncio.sleep(0.05)


class Silent:
    """An event stream read only when asked: a client that may stop reading (its
    kernel takes ``RECEIVE_BUFFER`` bytes for it, no more)."""

    def __init__(self, url: str) -> None:
        where = urlsplit(url)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        sock.settimeout(60)
        sock.connect((where.hostname or "", where.port or 0))
        self.conn = http.client.HTTPConnection(where.netloc, timeout=60)
        self.conn.sock = sock
        self.conn.request("GET", f"{where.path}?{where.query}")
        self.answer = self.conn.getresponse()
        assert self.answer.status == 200

    def close(self) -> None:
        self.answer.close()
        self.conn.close()

    def frames(self) -> Iterator[tuple[str, str, str]]:
        """(event, id, data) of each frame, until the answer ends."""
        fields: dict[str, str] = {}
        while line := self.answer.readline().decode():
            if line == "\n":
                if "data" in fields:
                    yield fields.get("event", "message"), fields.get("id", ""), fields["data"]
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.rstrip("\n").partition(": ")
                fields[name] = value

    def until_event(self, sequence: int) -> None:
        for _, event_id, _ in self.frames():
            if event_id == str(sequence):
                return
        raise AssertionError(f"the stream ended before event {sequence}")


def sequences(frames: list[tuple[str, str, str]]) -> list[int]:
    return [int(event_id) for kind, event_id, _ in frames if kind == "message"]


# --- event streams, bounded in bytes per client -----------------------------------------


async def test_a_client_that_stops_reading_while_its_child_writes_is_dropped(
    harness: Harness, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Caught up, then reading nothing while its child writes 12 MiB: dropped before it
    holds ``MAX_UNSENT_BYTES``, its place given back; the stream it had ends early, and
    a browser coming back with ``Last-Event-ID`` gets the rest, every event once."""
    written, stop = asyncio.Event(), asyncio.Event()
    big = 96

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="first"))
        await ctx.flush()
        await written.wait()
        for _ in range(big):
            ctx.emit(Event(kind="tool", **BIG))
            await ctx.flush()
        while not stop.is_set():  # the database keeps moving, as a live host's does
            await asyncio.sleep(0.05)
            ctx.emit(Event(kind="text", text="still working"))
            await ctx.flush()

    harness.runner.script = run
    child = (await harness.start("q1")).conversation_id
    caplog.set_level(logging.WARNING, "delegation.web.stream")
    async with served(db_url) as (page, url):
        events = f"{url}api/children/{child}/events"
        with contextlib.closing(await asyncio.to_thread(Silent, events)) as silent:
            await asyncio.to_thread(silent.until_event, 1)  # caught up; now it reads nothing
            written.set()

            def dropped() -> bool:
                return any(getattr(r, "action", "") == "web_stream_dropped" for r in caplog.records)

            await until(dropped, "dropped")
            assert page.streams.open == 0  # its place is given back at once
            stop.set()
            await harness.wait_done(child, timeout=60)
            total = len(await asyncio.to_thread(lambda: list(page.inspector.all_events(child))))
            early = await asyncio.to_thread(lambda: list(silent.frames()))
        got = sequences(early)
        assert [kind for kind, _, _ in early if kind == "end"] == [], "it was cut short"
        assert got == list(range(2, 2 + len(got))) and 1 + len(got) < total
        last = 1 + len(got)
        again = {"Last-Event-ID": str(last)}
        rest = await asyncio.to_thread(lambda: list(stream(events, **again)))
    assert sequences(rest) == list(range(last + 1, total + 1))
    assert rest[-1][0] == "end"
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "web_stream_dropped"]
    assert record.exc_info is None


async def test_a_page_of_events_is_bounded_in_bytes_and_follow_still_gives_them_all(
    harness: Harness, db_url: str
) -> None:
    """A page stops before the event that would take it past its bytes (the first always
    comes) and says so; a follower reads on at once and gets every event once."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for _ in range(10):
            ctx.emit(Event(kind="tool", **BIG))
        ctx.emit(Event(kind="result", text="done"))

    harness.runner.script = run
    child = (await harness.start("q1")).conversation_id
    await harness.wait_done(child)
    with Inspector(db_url) as inspector:
        page = await asyncio.to_thread(inspector.page, child, None, 0, 128, PAGE_BYTES)
        assert [e.sequence for e in page.events] == [1] and page.more  # two are > 256 KiB
        one = await asyncio.to_thread(inspector.page, child, None, 3, 128, 1)
        assert [e.sequence for e in one.events] == [4] and one.more
        last = await asyncio.to_thread(inspector.page, child, None, 10, 128, PAGE_BYTES)
        assert [e.sequence for e in last.events] == [11] and not last.more and last.done
        followed = await asyncio.to_thread(lambda: list(inspector.follow(child)))
    assert [e.sequence for e in followed] == list(range(1, 12))
    assert MAX_UNSENT_BYTES >= 4 * PAGE_BYTES


# --- lists read columns, never blobs ----------------------------------------------------


def _recording(seen: list[str]) -> type[psycopg.Cursor[Any]]:
    class Recording(psycopg.Cursor[Any]):
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(str(query))
            return super().execute(query, *args, **kwargs)

    return Recording


@contextlib.contextmanager
def statements() -> Iterator[list[str]]:
    """Every SQL statement sent by a connection opened meanwhile, as the database got
    it (the stores send their hot statements past SQLAlchemy, straight to the driver)."""
    seen: list[str] = []

    def connected(dbapi_connection: Any, _record: Any) -> None:
        if isinstance(dbapi_connection, sqlite3.Connection):
            dbapi_connection.set_trace_callback(seen.append)
        else:
            dbapi_connection.cursor_factory = _recording(seen)

    event.listen(Engine, "connect", connected)
    try:
        yield seen
    finally:
        event.remove(Engine, "connect", connected)


def selected(sql: str) -> str:
    """What a SELECT statement reads from its tables: its text before the first FROM of
    the children or grants table (counts and filters after it read no blob)."""
    return re.split(r"\bFROM\s+(?:children|grants)\b", sql, flags=re.I)[0]


# What a child or a grant stores whole: its request, preset, options; presets, policy.
BLOBS = re.compile(r"\b(request|preset|presets|options|policy)\b", re.I)


async def test_lists_read_the_columns_they_show_never_a_stored_request(
    harness: Harness, db_url: str
) -> None:
    """Children whose stored requests are 512 KiB each: the list (and one child's page)
    select their shown columns only, cut error and output in SQL, and answer right."""
    message = "m" * (512 * 1024)
    error = "e" * 1000

    async def fail(ctx: ChildContext) -> None:
        await ctx.admit()
        raise RuntimeError(error)

    harness.runner.script = finish_after_admit
    done = [(await harness.start(f"q{n}", message=message)).conversation_id for n in range(5)]
    leased = await harness.start("ql", message=message, lease_id="lease-1")
    done.append(leased.conversation_id)
    harness.runner.script = fail
    failed = (await harness.start("qf", message=message)).conversation_id
    for child in (*done, failed):
        await harness.wait_done(child)

    with statements() as seen:
        async with served(db_url) as (_page, url):
            status, _, body = await asyncio.to_thread(get, f"{url}api/children?limit=500")
            assert status == 200
            listed = seen[:]
            _, _, leases = await asyncio.to_thread(get, f"{url}api/leases")
            events = f"{url}api/children/{failed}/events"
            frames = await asyncio.to_thread(lambda: list(stream(events)))
            _, _, steps = await asyncio.to_thread(get, f"{url}api/children/{failed}/steps")

    children = json.loads(body)["children"]
    assert [c["conversationId"] for c in children] == [failed, *reversed(done)]
    assert children[0]["error"] == error[:200]
    assert {c["state"] for c in children} == {"done"}
    assert len(body) < 16 * 1024, "a list answer is small ..."
    reads = [sql for sql in seen if re.match(r"\s*SELECT", sql, re.I)]
    assert any(re.search(r"FROM\s+children", sql) for sql in listed), "... read by a query"
    assert [sql for sql in reads if BLOBS.search(selected(sql))] == [], "... and so is each read"
    (listing,) = [sql for sql in listed if re.search(r"ORDER BY id DESC LIMIT", sql)]
    assert "substr(error, 1, 200)" in listing and "substr(output, 1, 200)" in listing
    end = json.loads(frames[-1][2])
    assert (end["state"], end["error"]) == ("done", error)  # one child: whole
    assert [lease["leaseId"] for lease in json.loads(leases)["leases"]] == ["lease-1"]
    assert json.loads(steps)["stepCount"] == 0


# --- bad query values, and the headers of every answer --------------------------------

BAD_NUMBERS = [
    "²",  # str.isdigit() is true of it, int() refuses it
    "１２",  # noqa: RUF001 (fullwidth digits: int() takes them; a number on the wire never has them)
    "5" * 5000,  # past Python's int-from-text limit
    "9" * 20,
    str(2**63),  # past the largest sequence
    "-1",
    "1.5",
    " 1",
    "0x10",
    "1e3",
]


def _safe(headers: dict[str, str]) -> None:
    lowered = {name.lower(): value for name, value in headers.items()}
    assert "script-src 'self'" in lowered["content-security-policy"]
    assert lowered["x-content-type-options"] == "nosniff"


async def test_a_bad_number_in_a_query_is_a_one_line_400_never_a_500(
    harness: Harness,
    db_path: Path,  # parsing is the same on every store: SQLite only
) -> None:
    harness.runner.script = finish_after_admit
    child = (await harness.start("q1")).conversation_id
    await harness.wait_done(child)
    with browser.web(str(db_path)) as page:
        events = page.link(f"api/children/{child}/events")
        for bad in BAD_NUMBERS:
            for url, named in [
                (page.link(f"api/children?limit={quote(bad)}"), "?limit="),
                (page.link(f"api/children/{child}/events?after={quote(bad)}"), "?after="),
            ]:
                status, headers, body = await asyncio.to_thread(get, url)
                assert status == 400, (named, bad, body[:200])
                assert json.loads(body)["error"].startswith(f"{named} must be a whole number")
                _safe(headers)
            if bad != bad.strip():
                continue  # HTTP drops the spaces around a header's value
            # A header reaches the server as bytes: the UTF-8 of the value, as sent.
            sent = bad.encode().decode("latin-1")
            status, headers, body = await asyncio.to_thread(get, events, **{"Last-Event-ID": sent})
            assert status == 400, ("Last-Event-ID", bad, body[:200])
            error = json.loads(body)["error"]
            assert error == "Last-Event-ID must be a whole number from 0 to 9223372036854775807"
            _safe(headers)
        for bound in ("1", "500"):
            assert (await asyncio.to_thread(get, page.link(f"api/children?limit={bound}")))[
                0
            ] == 200
        assert (await asyncio.to_thread(get, page.link("api/children?limit=501")))[0] == 400
        maximum = {"Last-Event-ID": str(2**63 - 1)}
        frames = await asyncio.to_thread(lambda: list(stream(events, **maximum)))
        assert [kind for kind, _, _ in frames] == ["child", "end"]
        assert page.stop() == 130
    assert "Traceback" not in page.stderr and "Exception" not in page.stderr, page.stderr


async def test_every_answer_carries_the_safe_headers_errors_too(
    harness: Harness,
    db_path: Path,  # a row only SQLite lets a test spoil: SQLite only
) -> None:
    """400 (a foreign Host, a bad number), 401, 404, 405, 503 (too many streams) and a
    500 (a fault: here a row whose creation time is bytes) all carry the policy."""
    harness.runner.script = finish_after_admit
    child = (await harness.start("q1")).conversation_id
    await harness.wait_done(child)
    await harness.engine.close()
    with browser.web(str(db_path)) as page:
        port = urlsplit(page.url).port
        answers = [
            get(page.link(), Host=f"attacker.example:{port}"),
            get(page.link("api/children?limit=%C2%B2")),
            get(page.url + "api/children"),
            get(page.link("no/such/route")),
            get(page.link(f"api/children/{child}/events"), "POST"),
        ]
        assert [status for status, _, _ in answers] == [400, 400, 401, 404, 405]
        for _, headers, _ in answers:
            _safe(headers)
        with contextlib.ExitStack() as held:  # every stream the server allows, open
            for _ in range(MAX_STREAMS):
                conn = held.enter_context(
                    contextlib.closing(
                        http.client.HTTPConnection(urlsplit(page.url).netloc, timeout=10)
                    )
                )
                conn.request("GET", "/" + page.link("api/changes").removeprefix(page.url))
                assert conn.getresponse().readline() == b"retry: 2000\n"
            status, headers, body = get(page.link("api/changes"))
            assert (status, json.loads(body)) == (503, {"error": "too many open streams"})
            _safe(headers)
        with sqlite3.connect(db_path) as spoil:
            spoil.execute("UPDATE children SET profile = X'00'")  # bytes: no JSON
        status, headers, body = get(page.link("api/children"))
        assert (status, json.loads(body)) == (500, {"error": "internal error"})
        _safe(headers)
        with sqlite3.connect(db_path) as spoil:  # a read the database refuses
            spoil.execute("ALTER TABLE steps RENAME TO steps_gone")
        status, headers, body = get(page.link(f"api/children/{child}/steps"))
        assert status == 503 and "steps" in json.loads(body)["error"], body
        _safe(headers)
        assert page.stop() == 130
    assert page.stderr.count("Traceback") == 1  # the fault's, and only it
    assert "action=web_read_failed" in page.stderr


# --- the page at 1280 px ------------------------------------------------------------------

# Cells that are never cut: every heading; a child's state and age; a lease's children,
# age and status (ids, names and messages are cut with an ellipsis, whole in tooltips).
NEVER_CUT = (
    "th, #children td:nth-child(3), #children td:nth-child(7),"
    " #leases td:nth-child(5), #leases td:nth-child(6), #leases td:nth-child(7)"
)


async def test_at_1280_px_no_heading_state_age_or_status_is_cut(
    harness: Harness,
    workspace: Path,
    db_path: Path,  # the layout is the same on every store: SQLite only
) -> None:
    browser.require_browser()
    children = await fill(harness, workspace)
    with browser.web(str(db_path)) as page, browser.chromium(1280, 800) as driver:
        await asyncio.to_thread(driver.get, page.link(f"?child={children['cancelled']}"))

        def drawn(_: Any) -> bool:
            return len(rows(driver, "children")) == 5 and len(rows(driver, "leases")) == 2

        await asyncio.to_thread(until_drawn, driver, drawn)
        script = (
            "return [...document.querySelectorAll(arguments[0])]"
            ".filter(cell => cell.scrollWidth > cell.clientWidth)"
            ".map(cell => cell.closest('table').id + ': ' + cell.textContent)"
        )
        assert driver.execute_script("return window.innerWidth") == 1280
        assert driver.execute_script(script, NEVER_CUT) == []
        states = {row[2] for row in rows(driver, "children")}
        assert "cancelled" in states
