"""``delegation web`` (design §13): the live, read-only page, as a user runs and sees it.

A real engine in this process fills a real database through the real migrations; the
page is the real command in its own process (``delegation web --port 0``), as beside a
live host; the browser is a real headless Chromium (``tests/harness/browser.py``), which these
tests skip without (and fail without under ``DELEGATION_REQUIRE_BROWSER=1``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select

from delegation import AdmissionPolicy, ChildContext, Event
from delegation.cli import commands as cli
from delegation.clock import SystemClock
from delegation.usecases.inspector import Inspector
from delegation.web.app import STEPS_SHOWN, Routes
from delegation.web.token import Token
from tests.harness import browser
from tests.harness.fingerprints import fingerprint
from tests.harness.page import HOSTILE, LEASE, fill, get, rows, stream, until
from tests.harness.support import PRESET, Harness, finish_after_admit, hold


@pytest.fixture
def clock() -> SystemClock:
    """Real time: the page shows ages and lease deadlines against the wall clock."""
    return SystemClock()


@pytest.fixture
def page(db_url: str) -> Iterator[browser.Web]:
    """``delegation web`` on the test's database (started before any child)."""
    with browser.web(db_url) as web:
        yield web


@pytest.fixture(scope="module")
def chromium() -> Iterator[webdriver.Chrome]:
    browser.require_browser()
    with browser.chromium() as driver:
        yield driver


@pytest.fixture
def driver(chromium: webdriver.Chrome) -> Iterator[webdriver.Chrome]:
    """The module's browser, on a blank page again after the test (its streams closed),
    with nothing the page logged as an error (a refused script or style, a failed read)."""
    chromium.get_log("browser")
    yield chromium
    errors = [entry for entry in chromium.get_log("browser") if entry["level"] == "SEVERE"]
    chromium.get("about:blank")
    assert errors == []


def pick(driver: webdriver.Chrome, select: str, value: str) -> None:
    """Choose ``value`` in a drop-down, as a user does."""
    until(driver, lambda d: Select(d.find_element(By.ID, select)).select_by_value(value) or True)


def events_text(driver: webdriver.Chrome) -> str:
    return str(driver.execute_script("return document.getElementById('events').innerText"))


# --- the command -----------------------------------------------------------------------


def test_without_the_web_extra_the_command_says_what_to_install(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As if starlette were not installed, as after a plain `pip install delegation`: the
    # modules imported already are forgotten (restored after the test), its import fails.
    loaded = [name for name in sys.modules if name.partition(".")[0] in cli.WEB_PACKAGES]
    for name in ["delegation.web.app", *loaded]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "starlette", None)
    # (An address nobody can bind: were the page served after all, it would fail at once.)
    assert cli.main(["web", "--db", str(db_path), "--host", "256.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "delegation: `delegation web` needs the web extra (starlette is missing):"
        " pip install -e '.[web]' from the checkout"
        " (once published: pip install 'durable-delegation[web]')\n"
    )


@pytest.mark.parametrize("where", ["before", "after", "environment"])
def test_db_is_found_as_by_every_command_and_never_created(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.db"
    monkeypatch.setenv("DELEGATION_DB", str(missing))
    argv = {
        "before": ["--db", str(missing), "web"],
        "after": ["web", "--db", str(missing)],
        "environment": ["web"],
    }[where]
    assert cli.main(argv) == 1
    assert f"no delegation database at {missing}" in capsys.readouterr().err
    assert not missing.exists()


def test_a_port_out_of_range_is_refused(db_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["web", "--db", str(db_path), "--port", "65536"]) == 2
    assert capsys.readouterr().err == "delegation: --port 65536: not a TCP port (0 to 65535)\n"


def test_without_chromium_browser_tests_skip_unless_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(browser, "CHROMIUM", tmp_path / "chromium")
    monkeypatch.delenv("DELEGATION_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        browser.require_browser()
    monkeypatch.setenv("DELEGATION_REQUIRE_BROWSER", "1")  # as .ci/run sets it
    with pytest.raises(pytest.fail.Exception, match="DELEGATION_REQUIRE_BROWSER=1 requires"):
        browser.require_browser()


def _listening(port: int) -> list[str]:
    """The local addresses of the sockets listening on ``port`` (IPv4 and IPv6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_it_binds_to_localhost_by_default(db_path: Path) -> None:
    arguments = cli.build_parser().parse_args(["web"])
    assert (arguments.host, arguments.port) == ("127.0.0.1", 8765)
    with browser.web(str(db_path)) as web:
        where = urlsplit(web.url)
        assert where.hostname == "127.0.0.1"
        assert _listening(where.port or 0) == ["0100007F"]  # 127.0.0.1, and nothing else
        status, _, _ = get(web.link())
        assert status == 200


# --- the server ------------------------------------------------------------------------


async def test_the_api_streams_events_and_resumes_after_the_last_event_id(
    harness: Harness, workspace: Path, page: browser.Web
) -> None:
    children = await fill(harness, workspace)
    url = page.link(f"api/children/{children['failed']}/events")
    frames = await asyncio.to_thread(lambda: list(stream(url)))
    assert [(kind, event_id) for kind, event_id, _ in frames] == [
        ("child", ""),
        ("message", "1"),
        ("message", "2"),
        ("end", ""),
    ]
    assert json.loads(frames[1][2]) == {"sequence": 1, "kind": "text", "text": HOSTILE}
    end = json.loads(frames[-1][2])
    assert (end["state"], end["error"]) == ("done", f"failed: {HOSTILE}")
    # A reconnecting EventSource sends the last id it saw: it gets the rest only.
    again = await asyncio.to_thread(lambda: list(stream(url, **{"Last-Event-ID": "1"})))
    assert [event_id for _, event_id, _ in again] == ["", "2", ""]

    _, _, body = await asyncio.to_thread(get, page.link("api/children"))
    listed = {child["conversationId"]: child["state"] for child in json.loads(body)["children"]}
    assert listed == {r.conversation_id: r.state for r in await harness.engine.list_children()}
    _, _, body = await asyncio.to_thread(get, page.link("api/children?state=cancelled"))
    cancelled = {child["conversationId"] for child in json.loads(body)["children"]}
    assert cancelled == {children["cancelled"], children["revoked"]}
    assert get(page.link("api/children?state=nonsense"))[0] == 400
    assert get(page.link("api/children/c-missing/events"))[0] == 404


async def test_the_api_lists_a_childs_last_steps_never_their_values(
    harness: Harness, page: browser.Web
) -> None:
    """Beside the events, the steps an execution recorded: the last ``STEPS_SHOWN``,
    oldest first, and how many there are; name, place, size and time, no value."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for n in range(1, STEPS_SHOWN + 6):

            async def secret(n: int = n) -> str:
                return f"secret {n}"

            await ctx.step(HOSTILE if n == 1 else f"s{n}", secret)

    harness.runner.script = run
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id, timeout=30)
    child = started.conversation_id
    status, _, body = await asyncio.to_thread(get, page.link(f"api/children/{child}/steps"))
    assert status == 200 and b"secret" not in body
    document = json.loads(body)
    assert (document["conversationId"], document["runId"]) == (child, started.run_id)
    assert document["stepCount"] == STEPS_SHOWN + 5
    steps = document["steps"]
    assert [s["name"] for s in steps] == [f"s{n}" for n in range(6, STEPS_SHOWN + 6)]
    assert [s["ordinal"] for s in steps] == list(range(6, STEPS_SHOWN + 6))
    assert all(set(s) == {"name", "ordinal", "size", "recordedAt"} for s in steps)
    assert steps[0]["size"] == len('"secret 6"')

    harness.runner.script = finish_after_admit
    quiet = await harness.start("q2")
    await harness.wait_done(quiet.conversation_id)
    path = f"api/children/{quiet.conversation_id}/steps?run={quiet.run_id}"
    _, _, body = await asyncio.to_thread(get, page.link(path))
    assert (json.loads(body)["stepCount"], json.loads(body)["steps"]) == (0, [])
    assert get(page.link("api/children/c-missing/steps"))[0] == 404
    assert get(page.link(f"api/children/{child}/steps?run=r-missing"))[0] == 404


ROUTES = ("", "page.js", "page.css", "favicon.ico", "api/children", "api/leases", "api/changes")


async def test_the_page_is_read_only(harness: Harness, workspace: Path, db_path: Path) -> None:
    children = await fill(harness, workspace)
    await harness.engine.close()
    before = fingerprint(db_path)
    events = f"api/children/{children['done']}/events"
    steps = f"api/children/{children['done']}/steps"
    with browser.web(str(db_path)) as web:
        for path in (*ROUTES[:-1], events, steps):  # every route but the endless one
            assert get(web.link(path))[0] in (200, 204), path
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            for path in (*ROUTES, events, steps):
                assert get(web.link(path), method)[0] == 405, (method, path)
    assert fingerprint(db_path) == before

    with Inspector(f"sqlite:///{db_path}") as inspector:
        app = Routes(inspector).app(["127.0.0.1"], Token.new(8765))
        methods = {method for route in app.routes for method in getattr(route, "methods", ())}
    assert methods == {"GET", "HEAD"}


def test_only_local_host_names_are_answered_with_safe_headers(page: browser.Web) -> None:
    port = urlsplit(page.url).port
    # A page elsewhere that rebinds its own name to 127.0.0.1 still sends its name.
    assert get(page.link(), Host=f"attacker.example:{port}")[0] == 400
    for path in ROUTES[:-1]:
        status, headers, _ = get(page.link(path), Host=f"localhost:{port}")
        assert status in (200, 204)
        assert "script-src 'self'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"


async def test_ctrl_c_stops_it_at_once_with_streams_open(harness: Harness, db_url: str) -> None:
    harness.runner.script = hold(asyncio.Event())  # running until the engine closes
    child = (await harness.start("q1")).conversation_id
    with browser.web(db_url) as web:
        where = urlsplit(web.url)
        streams = []
        for path in ("api/changes", f"api/children/{child}/events"):
            conn = http.client.HTTPConnection(where.netloc, timeout=10)
            conn.request("GET", "/" + web.link(path).removeprefix(web.url))
            answer = conn.getresponse()
            assert answer.readline() == b"retry: 2000\n"  # the stream is open
            streams.append((conn, answer))
        started = time.monotonic()
        code = await asyncio.to_thread(web.stop)
        took = time.monotonic() - started
        for conn, answer in streams:
            answer.read()  # ended by the server
            conn.close()
    assert code == 130  # as a Ctrl-C'd command
    # The streams ended as the shutdown began, not cut by uvicorn's graceful timeout.
    assert "timeout graceful shutdown exceeded" not in web.stderr
    assert "Traceback" not in web.stderr
    assert took < 30, f"took {took:.1f} s to stop"


# --- the token ---------------------------------------------------------------------------


def opened(url: str, **headers: str) -> int:
    """The status of an endless stream at ``url``; once 200, its first line is read."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.netloc, timeout=10)
    try:
        conn.request("GET", f"{where.path}?{where.query}", headers=headers)
        answer = conn.getresponse()
        if answer.status == 200:
            assert answer.readline() == b"retry: 2000\n"
        return answer.status
    finally:
        conn.close()


def test_without_the_token_every_route_and_stream_is_401(page: browser.Web) -> None:
    assert page.token is not None and len(page.token) >= 43  # 256 random bits
    port = urlsplit(page.url).port
    wrong = ["", "?token=", f"?token=x{page.token}", f"?token={page.token[:-1]}", "?token=%C3%A9"]
    cookies = [f"delegation-token-{port}=x{page.token}", f"delegation-token-1{port}={page.token}"]
    # Before any route: a child that does not exist, a route that does not, a stream.
    missing = ("api/children/c-missing/events", "api/children/c-missing/steps")
    for path in (*ROUTES[:-1], *missing, "no/such/route"):
        for url in [page.url + path + query for query in wrong]:
            status, headers, body = get(url)
            assert (status, body) == (401, b"delegation web: open the address it printed"
                                           b" (with ?token=\xe2\x80\xa6)\n"), url  # fmt: skip
            assert "script-src 'self'" in headers["content-security-policy"]
            assert "set-cookie" not in headers
        for cookie in cookies:
            assert get(page.url + path, Cookie=cookie)[0] == 401, (path, cookie)
        assert get(page.url + path, "HEAD")[0] == 401
    for query in wrong:
        assert opened(page.url + "api/changes" + query) == 401
    assert opened(page.url + "api/changes", Cookie=cookies[0]) == 401


async def test_the_token_sets_a_cookie_that_lets_the_next_requests_in(
    harness: Harness, page: browser.Web
) -> None:
    child = (await harness.start("q1")).conversation_id
    await harness.wait_done(child)
    status, headers, _ = await asyncio.to_thread(get, page.link())
    assert status == 200
    cookie, *attributes = [part.strip() for part in headers["set-cookie"].split(";")]
    assert cookie == f"delegation-token-{urlsplit(page.url).port}={page.token}"
    assert sorted(attributes) == ["HttpOnly", "Path=/", "SameSite=Strict"]
    for path in ROUTES[:-1]:
        status, headers, _ = await asyncio.to_thread(get, page.url + path, Cookie=cookie)
        assert status in (200, 204) and "set-cookie" not in headers, path
    assert opened(page.url + "api/changes", Cookie=cookie) == 200
    url = f"{page.url}api/children/{child}/events"
    frames = await asyncio.to_thread(lambda: list(stream(url, Cookie=cookie)))
    assert [kind for kind, _, _ in frames] == ["child", "message", "end"]


def test_no_token_serves_without_and_says_so(db_path: Path) -> None:
    with browser.web(str(db_path), "--no-token") as web:
        assert web.token is None
        assert web.said == (
            f"delegation web: {web.url} (read-only; no token: whoever reaches the port"
            " reads every child; Ctrl-C stops)"
        )
        for path in ROUTES[:-1]:
            status, headers, _ = get(web.url + path)
            assert status in (200, 204) and "set-cookie" not in headers, path
        assert opened(web.url + "api/changes") == 200


# --- in a real browser -----------------------------------------------------------------


async def test_in_the_browser_the_token_becomes_a_cookie_and_leaves_the_address(
    harness: Harness, page: browser.Web, driver: webdriver.Chrome
) -> None:
    child = (await harness.start("q1")).conversation_id
    await harness.wait_done(child)
    await asyncio.to_thread(driver.get, page.url)  # no cookie for this server yet
    assert "open the address it printed" in driver.find_element(By.TAG_NAME, "body").text
    driver.get_log("browser")  # the refused page is logged as an error: expected here

    await asyncio.to_thread(driver.get, page.link(f"?child={child}"))
    end = (By.ID, "events-end")  # the events' stream got in with the cookie ...
    await asyncio.to_thread(until, driver, lambda d: d.find_element(*end).text == "ended done")
    live = (By.ID, "status")  # ... and the stream of changes
    await asyncio.to_thread(until, driver, lambda d: d.find_element(*live).text == "live")
    assert urlsplit(driver.current_url).query == f"child={child}", "the token left the address"
    (cookie,) = [
        c for c in driver.get_cookies() if c["name"].endswith(f"-{urlsplit(page.url).port}")
    ]
    assert (cookie["value"], cookie["httpOnly"], cookie["sameSite"]) == (page.token, True, "Strict")
    assert driver.execute_script("return document.cookie") == "", "no script reads it"

    await asyncio.to_thread(driver.get, page.url)  # the address alone, as a bookmark
    await asyncio.to_thread(until, driver, lambda d: rows(d, "children")[0][0] == child)


async def test_a_new_event_appears_on_the_open_page_without_a_reload(
    harness: Harness, page: browser.Web, driver: webdriver.Chrome
) -> None:
    steps = [asyncio.Event(), asyncio.Event()]

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="first step"))
        await ctx.flush()
        await steps[0].wait()
        ctx.emit(Event(kind="text", text="second step, live"))
        await ctx.flush()
        await steps[1].wait()
        ctx.emit(Event(kind="result", text="all done"))

    harness.runner.script = run
    child = (await harness.start("q1")).conversation_id
    await asyncio.to_thread(driver.get, page.link(f"?child={child}"))
    await asyncio.to_thread(until, driver, lambda d: "first step" in events_text(d))
    await asyncio.to_thread(until, driver, lambda d: rows(d, "children")[0][2] == "running")
    driver.execute_script("window.sameDocument = true")  # gone if the page reloads

    steps[0].set()  # the engine appends an event while the page is open
    await asyncio.to_thread(until, driver, lambda d: "second step, live" in events_text(d))
    steps[1].set()
    end = (By.ID, "events-end")
    await asyncio.to_thread(until, driver, lambda d: d.find_element(*end).text == "ended done")
    await asyncio.to_thread(until, driver, lambda d: rows(d, "children")[0][2] == "done")
    assert driver.execute_script("return window.sameDocument") is True
    items = driver.find_elements(By.CSS_SELECTOR, "#events li")
    assert [item.get_attribute("data-sequence") for item in items] == ["1", "2", "3"]


async def test_the_steps_appear_beside_the_events_as_they_are_recorded(
    harness: Harness, page: browser.Web, driver: webdriver.Chrome
) -> None:
    gate = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()

        async def read(size: int) -> bytes:
            return b"v" * size

        await ctx.step(HOSTILE, read, 10)
        ctx.emit(Event(kind="text", text="one step done"))
        await ctx.flush()
        await gate.wait()
        await ctx.step("fetch the page", read, 2048)
        ctx.emit(Event(kind="result", text="all done"))

    harness.runner.script = run
    child = (await harness.start("q1")).conversation_id
    await asyncio.to_thread(driver.get, page.link(f"?child={child}"))
    await asyncio.to_thread(until, driver, lambda d: "one step done" in events_text(d))
    await asyncio.to_thread(until, driver, lambda d: len(rows(d, "steps")) == 1)
    first = rows(driver, "steps")[0]
    assert first[:3] == ["1", HOSTILE, "10 B"]  # the name as text: nothing ran
    assert first[3].endswith("Z"), "when, whole in its tooltip"
    driver.execute_script("window.sameDocument = true")

    gate.set()  # a step recorded while the page is open
    end = (By.ID, "events-end")
    await asyncio.to_thread(until, driver, lambda d: d.find_element(*end).text == "ended done")
    await asyncio.to_thread(until, driver, lambda d: len(rows(d, "steps")) == 2)
    assert rows(driver, "steps")[1][:3] == ["2", "fetch the page", "2.0 KiB"]
    count = driver.find_element(By.ID, "steps-count").text
    assert count == "(2)"
    assert driver.execute_script("return window.sameDocument") is True
    assert driver.execute_script("return window.pwned") is None


async def test_what_a_child_wrote_is_shown_as_text_and_never_runs(
    harness: Harness,
    workspace: Path,
    page: browser.Web,
    driver: webdriver.Chrome,
    db_path: Path,  # the page's escaping is the same on every store: SQLite only
) -> None:
    children = await fill(harness, workspace)
    await asyncio.to_thread(driver.get, page.link(f"?child={children['failed']}"))
    end = (By.ID, "events-end")
    await asyncio.to_thread(until, driver, lambda d: d.find_element(*end).text.startswith("ended"))
    shown = events_text(driver)
    assert shown.count(HOSTILE) == 2 and "tool <b>bold</b>" in shown
    error = driver.find_element(By.CSS_SELECTOR, "#child-detail dd.error").text
    assert error == f"failed: {HOSTILE}"
    failed = next(row for row in rows(driver, "children") if row[0] == children["failed"])
    assert failed[-1] == f"failed: {HOSTILE}"
    assert driver.execute_script("return window.pwned") is None
    assert driver.find_elements(By.CSS_SELECTOR, "main img, main script, main b") == []


async def test_filters_by_state_and_lease_kept_in_the_address(
    harness: Harness,
    workspace: Path,
    page: browser.Web,
    driver: webdriver.Chrome,
    db_path: Path,  # the filters are the store's, tested on both in test_cli: SQLite only
) -> None:
    children = await fill(harness, workspace)

    def shown(d: webdriver.Chrome) -> set[str]:
        return {row[0] for row in rows(d, "children")}

    def showing(*names: str) -> Callable[[webdriver.Chrome], bool]:
        return lambda d: shown(d) == {children[name] for name in names}

    await asyncio.to_thread(driver.get, page.link())
    await asyncio.to_thread(until, driver, showing(*children))
    await asyncio.to_thread(pick, driver, "state-filter", "cancelled")
    await asyncio.to_thread(until, driver, showing("cancelled", "revoked"))
    await asyncio.to_thread(pick, driver, "state-filter", "")
    await asyncio.to_thread(pick, driver, "lease-filter", LEASE)
    await asyncio.to_thread(until, driver, showing("leased"))
    assert urlsplit(driver.current_url).query == f"lease={LEASE}"

    await asyncio.to_thread(driver.refresh)
    await asyncio.to_thread(until, driver, showing("leased"))
    assert driver.execute_script("return document.getElementById('lease-filter').value") == LEASE
    await asyncio.to_thread(driver.get, f"{page.url}?state=done")  # the cookie lets it in
    await asyncio.to_thread(until, driver, showing("done", "failed"))


async def test_the_leases_live_and_revoked_and_a_click_filters_by_one(
    harness: Harness,
    workspace: Path,
    page: browser.Web,
    driver: webdriver.Chrome,
    db_path: Path,  # the leases are the store's, tested on both in test_cli: SQLite only
) -> None:
    children = await fill(harness, workspace)
    await asyncio.to_thread(driver.get, page.link())
    await asyncio.to_thread(until, driver, lambda d: len(rows(d, "leases")) == 2)
    leases = {row[0]: row for row in rows(driver, "leases")}
    assert leases[LEASE][1:5] == ["runner-1", "ext", "parent-run", "1"]
    assert leases[LEASE][6].startswith("expires in 59m")
    assert leases["lease-2"][3:5] == ["other-run", "1"]
    assert leases["lease-2"][6].startswith("revoked")

    link = (By.CSS_SELECTOR, f"#leases tr[data-lease='{LEASE}'] a")
    await asyncio.to_thread(until, driver, lambda d: d.find_element(*link).click() or True)
    await asyncio.to_thread(
        until, driver, lambda d: [row[0] for row in rows(d, "children")] == [children["leased"]]
    )


async def test_a_childs_open_input_requests_are_shown_as_text_until_answered(
    harness: Harness, page: browser.Web, driver: webdriver.Chrome
) -> None:
    """design §21: the page shows what a child asks (read-only: answering is the CLI's)."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        answer = await ctx.ask("deploy", HOSTILE, kind="approval", tool_name="<i>ship</i>")
        ctx.emit(Event(kind="result", text=answer))

    harness.runner.script = run
    child = (await harness.start("q1")).conversation_id
    status, _, body = await asyncio.to_thread(get, page.link(f"api/children/{child}/inputs"))
    for _ in range(200):
        document = json.loads(body)
        if document["inputRequests"]:
            break
        await asyncio.sleep(0.05)
        status, _, body = await asyncio.to_thread(get, page.link(f"api/children/{child}/inputs"))
    assert status == 200
    (ask,) = document["inputRequests"].values()
    assert document["inputRequests"]["deploy"] == ask
    assert (ask["kind"], ask["prompt"], ask["toolName"]) == ("approval", HOSTILE, "<i>ship</i>")
    assert ask["options"] == ["approve", "deny"]
    assert get(page.link("api/children/c-missing/inputs"))[0] == 404

    await asyncio.to_thread(driver.get, page.link(f"?child={child}"))
    # Read in one script: the pane is drawn again whenever the database moves (its
    # suspension, say), and an element found before that is stale after it.
    shown = "return [...document.querySelectorAll('#inputs li')].map(li => li.innerText)"
    (text, *_) = await asyncio.to_thread(until, driver, lambda d: d.execute_script(shown))
    assert text.startswith(f"approval deploy: {HOSTILE} (approve / deny)")
    assert "tool <i>ship</i>" in text  # as text: nothing ran
    await harness.engine.answer_input(child, "deploy", decision="approve")
    pane = (By.ID, "inputs-pane")
    await asyncio.to_thread(until, driver, lambda d: not d.find_element(*pane).is_displayed())
    assert driver.execute_script("return window.pwned") is None


async def test_queued_children_show_their_place_in_the_queue(
    harness: Harness, page: browser.Web, driver: webdriver.Chrome
) -> None:
    """design §22: the list shows a queued child's place (1: next), the API its number."""
    scope = f"preset:{harness.conn.runner_id}/{PRESET.extension_id}/{PRESET.name}"
    await harness.engine.set_admission(scope, AdmissionPolicy(concurrency=1))
    harness.runner.script = hold(asyncio.Event())
    running = (await harness.start("q1", lease_id=LEASE)).conversation_id
    first = (await harness.start("q2", lease_id=LEASE)).conversation_id
    second = (await harness.start("q3", lease_id=LEASE)).conversation_id
    status, _, body = await asyncio.to_thread(get, page.link("api/children"))
    assert status == 200
    listed = {c["conversationId"]: c for c in json.loads(body)["children"]}
    assert (listed[first]["state"], listed[first]["queuePosition"]) == ("queued", 1)
    assert (listed[second]["state"], listed[second]["queuePosition"]) == ("queued", 2)
    assert "queuePosition" not in listed[running]

    def states(d: webdriver.Chrome) -> dict[str, str]:
        script = (
            "return Object.fromEntries([...document.querySelectorAll('#children tbody tr')]"
            ".map(row => [row.dataset.conversation, row.cells[2].textContent]))"
        )
        return dict(d.execute_script(script))

    await asyncio.to_thread(driver.get, page.link())
    await asyncio.to_thread(until, driver, lambda d: states(d).get(second) == "queued #2")
    assert states(driver)[first] == "queued #1"
    await harness.engine.set_admission(scope, None)
