"""A real headless Chromium (Debian's ``chromium`` and ``chromium-driver``) for the web
tests, driven by Selenium, and the ``delegation web`` process it looks at.

The tests skip without the browser, unless ``DELEGATION_REQUIRE_BROWSER=1`` (CI's
``.ci/run`` sets it after installing the packages): then its absence is a failure.

``python -m tests.harness.browser docs/web.png`` takes the README's screenshot: the page of a
database that ``delegation demo`` filled, one child chosen.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from delegation import Preset
from delegation.client.api import SyncClient

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The network is closed and CI runs as root: no sandbox, nothing fetched in the background.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def require_browser() -> None:
    """Skip the test (fail it under ``DELEGATION_REQUIRE_BROWSER=1``) without Chromium."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if not missing:
        return
    why = f"no headless Chromium here ({', '.join(missing)} missing)"
    if os.environ.get("DELEGATION_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{why}, and DELEGATION_REQUIRE_BROWSER=1 requires it")
    pytest.skip(f"{why}: apt-get install chromium chromium-driver")


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 900) -> Iterator[webdriver.Chrome]:
    """A headless Chromium with a fresh profile, quit (and its profile removed) after."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
        try:
            yield driver
        finally:
            driver.quit()


@dataclass
class Web:
    """A ``delegation web`` process: the line it printed first, the page's address in it
    (``url``, without a query) and its token (None under ``--no-token``)."""

    said: str
    process: subprocess.Popen[str]
    stderr: str = ""

    @property
    def url(self) -> str:
        return self.said.split()[2].partition("?")[0]

    @property
    def token(self) -> str | None:
        _, _, query = self.said.split()[2].partition("?token=")
        return query or None

    def link(self, path: str = "") -> str:
        """``url`` and ``path`` with the token in the query, as the printed address."""
        if self.token is None:
            return self.url + path
        return f"{self.url}{path}{'&' if '?' in path else '?'}token={self.token}"

    def stop(self, timeout: float = 10.0) -> int:
        """Ctrl-C, and its exit code once it has exited (its stderr in ``stderr``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        _, self.stderr = self.process.communicate(timeout=timeout)
        return self.process.returncode


@contextlib.contextmanager
def web(db: str | None, *flags: str, env: Mapping[str, str] | None = None) -> Iterator[Web]:
    """``delegation web --db DB --port 0 FLAGS`` running, until the block ends (``db``
    None: no ``--db``, the database is the environment's ``DELEGATION_DB``)."""
    command = [sys.executable, "-m", "delegation.cli", "web", "--port", "0"]
    process = subprocess.Popen(
        [*command, *([] if db is None else ["--db", db]), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        if not first.startswith("delegation web: http"):
            process.kill()
            raise AssertionError(f"delegation web did not start: {first}{process.communicate()}")
        yield Web(first.rstrip("\n"), process)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def screenshot(target: Path) -> None:
    """The README's picture: a database the demo filled, and a live host beside it
    running two more children (one leased), the newest chosen."""
    with tempfile.TemporaryDirectory() as where:
        db = str(Path(where) / "delegation.db")
        demo = [sys.executable, "-m", "delegation.cli", "demo", "--fast", "--db", db]
        subprocess.run(demo, check=True, capture_output=True, cwd=where)
        os.environ["DELEGATION_SCRIPTED_DELAY"] = "0.4"
        with SyncClient.spawn(["--db", db, "--runner", "scripted"]) as host:
            chosen = _start_two(host, where)
            time.sleep(3)  # a few steps each
            with web(db) as page, chromium(1280, 800) as driver:  # a laptop's screen
                driver.get(page.link(f"?child={chosen}"))
                time.sleep(2)  # the lists and the events arrive
                driver.save_screenshot(str(target))


def _start_two(host: SyncClient, workspace: str) -> str:
    """A leased child and a foreground one, running; the second one's id."""
    host.register("runner-1", "host-1")
    host.begin_tool(
        run_id="run-7",
        conversation_id="conv-7",
        tool_call_id="call-1",
        extension_id="ext",
        presets=[Preset(name="reviewer", extension_id="ext", generation=1)],
        workspace=workspace,
    )
    owner: dict[str, Any] = {"runId": "run-7", "toolCallId": "call-1", "extensionId": "ext"}
    owner["generation"] = 1
    leased = {"requestId": "q1", "profile": "reviewer", "message": "review the diff in 40 steps"}
    host.start({**owner, "leaseId": "L-7", "request": {**leased, "leaseId": "L-7"}})
    foreground = {"requestId": "q2", "profile": "reviewer", "message": "check tests in 30 steps"}
    return host.start({**owner, "request": foreground}).conversation_id


if __name__ == "__main__":
    screenshot(Path(sys.argv[1]))
