"""What other tests use of crash/test_step_crash.py, kept here so that no test module imports
another: HOST, Host, ROOT, hosts."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HOST = Path(__file__).resolve().with_name("step_host.py")
ROOT = HOST.parents[2]


class Host:
    """One tests/harness/step_host.py process (or ``script``'s) and the lines it printed."""

    script = HOST

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(self.script), *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, found: Callable[[list[str]], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not found(list(self.lines)):
            if self.proc.poll() is not None and not found(list(self.lines)):
                raise AssertionError(f"host ended before {what}: {self.lines[-20:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s: {self.lines[-20:]}")
            time.sleep(0.02)

    def saw(self, prefix: str) -> list[str]:
        return [line for line in list(self.lines) if line.startswith(prefix)]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # no cleanup, no flush: a crash
        self.proc.wait()
        self._reader.join(5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    started: list[Host] = []
    yield started
    for host in started:
        host.stop()
