"""A command child cannot starve its host (design §23): at most ``max_processes``
processes and ``max_memory`` bytes, tried with real children as issue 35 found them
(a child could fork without bound: a PID namespace caps nothing).

A child that forks 400 times is ended with an error that says why, while the host keeps
answering; one that allocates past its memory is ended too. As root on cgroup v1 (CI's
machine) by control groups; the process count is also watched where no group can be had.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

import pytest

from delegation import Engine, EngineConfig, Preset
from delegation import os_processes as processes
from delegation.runners import limits, tmpdirs
from delegation.runners.command import CommandConfigError, CommandRunner
from delegation.runners.containment import Containment
from tests.harness.command_children import ended, first_text, hosted, script
from tests.harness.support import PRESET, Harness, open_harness
from tests.harness.trees import alive

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux containment")
needs_cgroups = pytest.mark.skipif(limits.group_roots() is None, reason="no cgroups here (root)")

FORKS = """
    import json, os, sys, time
    print(json.dumps({"kind": "text", "text": "forking"}), flush=True)
    made = 0
    for _ in range(400):
        try:
            if os.fork() == 0:
                time.sleep(600)
                os._exit(0)
            made += 1
        except OSError:
            time.sleep(0.01)  # at the limit: try again, as a fork bomb does
    print(json.dumps({"kind": "result", "text": f"made {made}"}), flush=True)
    time.sleep(600)
"""

QUICK = """
    import json
    print(json.dumps({"kind": "result", "text": "quick"}), flush=True)
"""

HELD = """
    import json, sys
    print(json.dumps({"kind": "text", "text": sys.stdin.readline().strip()}), flush=True)
    sys.stdin.readline()  # until a steer lets it go
"""


@pytest.mark.parametrize("groups", [True, False], ids=["cgroups", "watched"])
async def test_a_fork_bomb_ends_its_child_and_the_host_answers(
    tmp_path: Path, groups: bool
) -> None:
    """400 forks: the child is ended at 256 processes with its reason; meanwhile another
    child starts and ends, and nothing of the bomb is left."""
    if groups and limits.group_roots() is None:
        pytest.skip("no cgroups here (root on cgroup v1)")
    runner = CommandRunner({"bomb": script(FORKS), "quick": script(QUICK)}, grace_s=0.2)
    if not groups:
        runner.containment.cgroups = None  # the host watches the count alone
    (tmp_path / "ws").mkdir()
    presets = [Preset(name=name, extension_id="ext", generation=PRESET.generation)
               for name in ("bomb", "quick")]  # fmt: skip
    config = EngineConfig(release_drain_s=2.0)
    async with Engine(f"sqlite:///{tmp_path / 'x.db'}", runner=runner, config=config) as engine:
        h: Harness = await open_harness(engine, runner, tmp_path / "ws", presets)
        bomb = await h.start("q1", profile="bomb")
        await first_text(h, bomb.conversation_id)
        quick = await h.start("q2", profile="quick")
        assert await ended(h, quick.conversation_id) == "", "the host kept answering"
        error = await ended(h, bomb.conversation_id)
        record = await h.engine.get_child(bomb.conversation_id)
    assert error.startswith("child exceeded its process limit (max_processes 256)"), error
    assert record is not None and record.state == "done"
    assert not [pid for pid in _marked(bomb.conversation_id) if alive(pid)], "all of it died"


def _marked(conversation_id: str) -> list[int]:
    """Processes whose environment names the child (its program's, and their forks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if conversation_id.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


ALLOCATE = """
    import json
    print(json.dumps({"kind": "text", "text": "allocating"}), flush=True)
    held = [bytearray(16 * 1024 * 1024) for _ in range(40)]  # 640 MiB, touched
    print(json.dumps({"kind": "result", "text": f"held {len(held)}"}), flush=True)
"""


@needs_cgroups
async def test_a_child_past_its_memory_is_ended(tmp_path: Path) -> None:
    toml = tmp_path / "runner.toml"
    argv = script(ALLOCATE)
    toml.write_text(
        f'[command]\nmax_memory = "128 MiB"\n[command.profiles.worker]\nargv = {json.dumps(argv)}\n'
    )
    runner = CommandRunner.from_file(toml)
    assert runner.containment.max_memory == 128 * 1024**2
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        error = await ended(h, started.conversation_id)
    assert error.startswith(f"child exceeded its memory limit (max_memory {128 * 1024**2}"), error


@needs_cgroups
async def test_a_childs_groups_are_gone_when_it_ends(tmp_path: Path) -> None:
    runner = CommandRunner({"worker": script(HELD)})
    roots = limits.group_roots()
    assert roots is not None
    mine = tmpdirs.prefix(processes.identify(os.getpid()))  # this host's, not another test's

    def groups() -> list[str]:
        return [n for root in roots.values() for n in os.listdir(root) if n.startswith(mine)]

    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        await first_text(h, started.conversation_id)
        assert len(groups()) == 2, "one in pids, one in memory"
        steer = h.params(child_id=started.conversation_id, request_id="s1", message="go")
        await h.engine.call(h.conn, "child.steer", steer)
        assert await ended(h, started.conversation_id) == ""
        for _ in range(100):
            if not groups():
                break
            await asyncio.sleep(0.05)
    assert groups() == []


def test_limits_come_from_the_toml_and_are_checked(tmp_path: Path) -> None:
    toml = tmp_path / "runner.toml"
    toml.write_text(
        '[command]\nmax_processes = 32\nmax_memory = "1 GiB"\n'
        '[command.profiles.worker]\nargv = ["true"]\n'
    )
    contained = CommandRunner.from_file(toml).containment
    assert (contained.max_processes, contained.max_memory) == (32, 1024**3)
    defaults = CommandRunner({"worker": ["true"]}).containment
    assert (defaults.max_processes, defaults.max_memory) == (256, 2 * 1024**3)
    for bad in ({"max_processes": 1}, {"max_processes": True}, {"max_memory": "2 parsecs"},
                {"max_memory": 1024}, {"max_memory": -5}):  # fmt: skip
        with pytest.raises(CommandConfigError, match=next(iter(bad))):
            CommandRunner({"worker": ["true"]}, **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "size"),
    [("2 GiB", 2 * 1024**3), ("512M", 512 * 1024**2), ("1048576", 2**20), ("1 parsec", None)],
)
def test_sizes_read_as_bytes(text: object, size: int | None) -> None:
    if size is None:
        with pytest.raises(ValueError, match="max_memory"):
            limits.parse_size(text)  # text of digits alone: say the unit
        return
    assert limits.parse_size(text) == size


SHARED = """
    import ctypes, json, mmap, os
    libc = ctypes.CDLL(None, use_errno=True)
    size, seen = 256 * 1024 * 1024, {}

    def touch(view):
        for at in range(0, size, 4096):
            view[at] = 1

    def memfd():
        fd = libc.memfd_create(b"held", 0)
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, mmap.MAP_SHARED) as view:
            touch(view)

    def shared():
        with mmap.mmap(-1, size, mmap.MAP_SHARED) as view:
            touch(view)

    for name, fn in (("memfd", memfd), ("shared", shared)):
        try:
            fn()
            seen[name] = "held 256 MiB"
        except (OSError, MemoryError) as exc:
            seen[name] = type(exc).__name__
    held = bytearray(16 * 1024 * 1024)  # well within its 64 MiB: still allowed
    seen["private"] = len(held) // 2**20
    print(json.dumps({"kind": "result", "text": json.dumps(seen)}), flush=True)
"""


async def test_without_groups_max_memory_bounds_shared_and_memfd_mappings(
    tmp_path: Path,
) -> None:
    """The fifth attack on a host without control groups: with ``max_memory = "64MiB"``
    a child touched 256 MiB through ``memfd_create`` + ``MAP_SHARED``, and 256 MiB of
    ``MAP_SHARED|MAP_ANONYMOUS``: RLIMIT_DATA counts private memory only. RLIMIT_AS
    bounds what each process maps, shared memory included."""
    toml = tmp_path / "runner.toml"
    toml.write_text(
        '[command]\nmax_memory = "64 MiB"\n[command.profiles.worker]\n'
        f"argv = {json.dumps(script(SHARED))}\n"
    )
    runner = CommandRunner.from_file(toml)
    runner.containment.cgroups = None  # as on a host that is not root: rlimits alone
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        assert await ended(h, started.conversation_id) == ""
        record = await h.engine.get_child(started.conversation_id)
    assert record is not None
    seen = json.loads(record.output)
    assert seen == {"memfd": "OSError", "shared": "OSError", "private": 16}, seen


def test_without_groups_what_holds_memory_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where only rlimits hold memory, the host's log says so once, and where it stops."""
    contained = Containment(cgroups=None)
    caplog.set_level(logging.WARNING, logger="delegation.runners.command")
    contained.announce()
    contained.announce()
    said = [r for r in caplog.records if getattr(r, "action", "") == "cgroups_unavailable"]
    assert len(said) == 1
    assert "RLIMIT_AS" in said[0].getMessage()
    assert "memory-backed files" in said[0].getMessage()
