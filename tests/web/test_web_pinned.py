"""The page shows a pinned child (SPEC §27, issue 48): ``pinnedVersion`` in
``/api/children`` and in the events stream's ``child`` frame for a child pinned to the
runner version that ran it, absent for any other; and a badge (``pinned v1``) under its
state in the list and beside its details, in a real headless Chromium (skipped without).
The page is the real ``delegation web`` process; the child is pinned by real hosts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from selenium import webdriver

from delegation import Engine, EngineConfig
from tests.harness import browser
from tests.harness.page import get, stream, until
from tests.harness.support import finish_after_admit, open_harness
from tests.harness.versioned import Versioned, answered_on, asks, waiting_on


async def pinned_and_done(db_url: str, workspace: Path) -> tuple[str, str]:
    """A child pinned to v1 (a v2 host with the policy ``pin`` was asked to resume it),
    and a child done, not pinned."""
    pinned = await waiting_on(db_url, workspace, "v1")
    v2 = Versioned("v2", script=asks)
    record = await answered_on(db_url, workspace, pinned, v2, on_version_change="pin")
    assert (record.state, record.pinned_version) == ("waiting", "v1")
    runner = Versioned("v2", script=finish_after_admit)
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        done = (await h.start("q-done")).conversation_id
        await h.wait_done(done)
    return pinned, done


def first_frame(url: str) -> tuple[str, dict[str, object]]:
    """The first frame of an event stream (a waiting child's never ends)."""
    for kind, _, data in stream(url):
        return kind, json.loads(data)  # the stream is closed as it is left
    raise AssertionError("the stream ended without a frame")


def badges(driver: webdriver.Chrome) -> dict[str, str]:
    script = (
        "return Object.fromEntries([...document.querySelectorAll('#children tbody tr')]"
        ".map(row => [row.dataset.conversation,"
        " [...row.cells[2].querySelectorAll('.badge.pinned')].map(b => b.textContent).join()]))"
    )
    return dict(driver.execute_script(script))


def detail(driver: webdriver.Chrome) -> str:
    return str(driver.execute_script("return document.getElementById('child-detail').innerText"))


async def test_a_pinned_child_has_its_version_in_the_api_and_a_badge_on_the_page(
    db_url: str, workspace: Path
) -> None:
    pinned, done = await pinned_and_done(db_url, workspace)
    with browser.web(db_url) as page:
        status, _, body = await asyncio.to_thread(get, page.link("api/children"))
        assert status == 200
        listed = {c["conversationId"]: c for c in json.loads(body)["children"]}
        assert (listed[pinned]["state"], listed[pinned]["pinnedVersion"]) == ("waiting", "v1")
        assert "pinnedVersion" not in listed[done]
        url = page.link(f"api/children/{pinned}/events")
        kind, child = await asyncio.to_thread(first_frame, url)
        assert (kind, child["conversationId"], child["pinnedVersion"]) == ("child", pinned, "v1")
        kind, child = await asyncio.to_thread(first_frame, page.link(f"api/children/{done}/events"))
        assert kind == "child" and "pinnedVersion" not in child

        browser.require_browser()
        with browser.chromium() as driver:
            await asyncio.to_thread(driver.get, page.link())
            await asyncio.to_thread(until, driver, lambda d: badges(d).get(pinned) == "pinned v1")
            assert badges(driver)[done] == ""
            state = driver.execute_script(
                "return document.querySelector(`tr[data-conversation='${arguments[0]}'] td.state`)"
                ".firstChild.textContent",
                pinned,
            )
            assert state == "waiting"
            await asyncio.to_thread(driver.get, page.link(f"?child={pinned}"))
            await asyncio.to_thread(until, driver, lambda d: "pinned v1" in detail(d))
            logged = driver.get_log("browser")  # type: ignore[no-untyped-call]
            assert [entry for entry in logged if entry["level"] == "SEVERE"] == []
