"""What other tests use of web/test_web.py, kept here so that no test module imports another:
HOSTILE, LEASE, fill, get, rows, stream, until."""

from __future__ import annotations

import asyncio
import http.client
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.support.wait import WebDriverWait

from delegation import ChildContext, Event
from tests.harness.support import PRESET, Harness, Script, finish_after_admit, hold

LEASE = "lease-1"
HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'


def get(url: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as refused:
        return refused.code, dict(refused.headers), refused.read()


def stream(url: str, **headers: str) -> Iterator[tuple[str, str, str]]:
    """The Server-Sent Events at ``url``: (event, id, data) each."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.netloc, timeout=10)
    try:
        conn.request("GET", f"{where.path}?{where.query}", headers=headers)
        answer = conn.getresponse()
        assert answer.status == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        while line := answer.readline().decode():
            if line == "\n":
                if "data" in fields:
                    yield fields.get("event", "message"), fields.get("id", ""), fields["data"]
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.rstrip("\n").partition(": ")
                fields[name] = value
    finally:
        conn.close()


def until(driver: webdriver.Chrome, condition: Callable[[webdriver.Chrome], Any]) -> Any:
    """Wait until ``condition`` holds (a table not drawn yet, or drawn again meanwhile,
    counts as not yet)."""
    ignored = [IndexError, StaleElementReferenceException]
    waiting = WebDriverWait(driver, 15, poll_frequency=0.05, ignored_exceptions=ignored)
    return waiting.until(condition)


def rows(driver: webdriver.Chrome, table: str) -> list[list[str]]:
    """The cells' text of a table's rows, whole (as their tooltips have it), read at
    once: the page redraws its tables whenever the database moves."""
    script = (
        "return [...document.querySelectorAll(arguments[0])]"
        ".map(row => [...row.cells].map(cell => cell.title))"
    )
    found: list[list[str]] = driver.execute_script(script, f"#{table} tbody tr")
    return found


async def fill(h: Harness, workspace: Path) -> dict[str, str]:
    """Children of every kind: done, failed (a hostile error), cancelled, leased and
    running (until the engine closes), and cancelled by a revoked lease."""

    async def hostile(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text=HOSTILE))
        ctx.emit(Event(kind="tool", tool_name="<b>bold</b>", input=HOSTILE, success=False))
        await ctx.flush()
        raise RuntimeError(f"failed: {HOSTILE}")

    def route(**scripts: Script) -> Script:
        async def run(ctx: ChildContext) -> None:
            await scripts[ctx.request.message](ctx)

        return run

    h.runner.script = route(quick=finish_after_admit, hostile=hostile, hold=hold(asyncio.Event()))
    children = {
        "done": (await h.start("q1", message="quick")).conversation_id,
        "failed": (await h.start("q2", message="hostile")).conversation_id,
        "cancelled": (await h.start("q3", message="hold")).conversation_id,
        "leased": (await h.start("q4", message="hold", lease_id=LEASE)).conversation_id,
    }
    await h.engine.cancel_child(children["cancelled"])
    await h.engine.open_tool(
        h.conn,
        run_id="other-run",
        conversation_id="other-conv",
        tool_call_id="call-x",
        extension_id="ext",
        presets=[PRESET],
        workspace=str(workspace),
    )
    other = await h.start(
        "q5", message="hold", lease_id="lease-2", run_id="other-run", tool_call_id="call-x"
    )
    children["revoked"] = other.conversation_id
    await h.engine.finish_run("other-run", succeeded=False)
    for name in ("done", "failed", "revoked"):
        await h.wait_done(children[name])
    return children
