"""The processes of command children, as the host sees them (Linux ``/proc``).

A command child runs as its launcher's *keeper* and, where namespaces are allowed, its
program in a PID namespace of its own: the pids a program prints are its namespace's
(it is 1 there), so the tests find its processes from the host's side instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

LAUNCHER_MARK = b"child_launcher.py"


def state(pid: int) -> str | None:
    """A process's state letter, None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie someone else must reap is not)."""
    return state(pid) not in (None, "Z", "X")


def children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, nearest first."""
    found, queue = [], children(pid)
    while queue:
        pid = queue.pop(0)
        if alive(pid):
            found.append(pid)
        queue += children(pid)
    return found


def launchers(parent: int | None = None) -> list[int]:
    """The live command-child launchers (keepers) started by ``parent`` (this process)."""
    parent = os.getpid() if parent is None else parent
    return [
        pid
        for pid in children(parent)
        if alive(pid) and LAUNCHER_MARK in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def child_tree(parent: int | None = None) -> list[int]:
    """Every live process of the command children ``parent`` started, keepers included."""
    return [p for keeper in launchers(parent) for p in [keeper, *descendants(keeper)]]


def program_of(recorded: int) -> int:
    """The program's host pid for a recorded launcher pid: the keeper's only child in a
    namespace, else the launcher itself (it became the program)."""
    below = children(recorded)
    return below[0] if len(below) == 1 and LAUNCHER_MARK in cmdline(recorded) else recorded


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_for(check: Callable[[], bool], tries: int = 500) -> None:
    for _ in range(tries):
        if check():
            return
        threading.Event().wait(0.01)
    raise AssertionError("timed out")
