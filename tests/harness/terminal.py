"""The command line as the tests run it: ``delegation`` in this process (:func:`in_process`),
or any command on a real terminal (a pseudo-terminal of a given size), as a person runs
it, with what it printed there and rich's colours taken out (:func:`in_terminal`)."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from delegation.cli.commands import main

ROOT = Path(__file__).resolve().parents[2]
# Select Graphic Rendition and cursor codes, and OSC sequences (rich's live displays).
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


Cli = Callable[..., tuple[int, str, str]]


def in_process(capsys: pytest.CaptureFixture[str], db_url: str) -> Cli:
    """``delegation ARGS --db <db_url>`` in this process: (code, stdout, stderr); ``db=``
    names another database (a path or a URL)."""

    def run(*argv: str, db: Path | str = db_url) -> tuple[int, str, str]:
        code = main([*argv, "--db", str(db)])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@dataclass(frozen=True)
class Ran:
    code: int
    terminal: str  # what the terminal showed: ANSI codes out, \r\n as \n
    raw: bytes  # exactly what reached the terminal
    other: str  # the stream that was a pipe


def in_terminal(
    argv: list[str], *, stream: str = "stdout", columns: int = 80, timeout: float = 120
) -> Ran:
    """``python ARGV`` with ``stream`` (stdout or stderr) on a terminal ``columns`` wide
    and the other on a pipe; stdin empty, and no ``$COLUMNS`` to go by."""
    main, side = os.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    streams = {"stdout": side, "stderr": subprocess.PIPE}
    if stream == "stderr":
        streams = {"stdout": subprocess.PIPE, "stderr": side}
    proc = subprocess.Popen(
        [sys.executable, *argv], stdin=subprocess.DEVNULL, cwd=ROOT, env=env, **streams
    )
    os.close(side)
    chunks = []
    try:
        while data := _read(main):
            chunks.append(data)
        other = proc.communicate(timeout=timeout)[0 if stream == "stderr" else 1]
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    raw = b"".join(chunks)
    shown = ANSI.sub("", raw.decode("utf-8", "replace")).replace("\r\n", "\n")
    return Ran(proc.returncode, shown, raw, other.decode())


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: every end of the terminal the command had is closed
        return b""
