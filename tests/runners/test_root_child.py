"""A root host's children cannot read what only root may read (design §23), tried with real
children as issue 35 found it: a child keeps uid 0 without capabilities, and uid 0 still
owns ``/etc/shadow`` (0640 root:shadow) beneath the default read-only ``/etc``.

Now such a child runs as a user of its own (``child_uid``, default 65534), with its
workspace and temp dir mounted idmapped for it: a root-owned workspace stays its to
write, what it writes is root's on disk, and a file only root may read is closed to it by
its mode. ``child_uid = 0`` keeps the old way, said once in the log.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from pathlib import Path

import pytest

from delegation import Engine
from delegation.runners.command import CommandRunner
from delegation.runners.containment import idmap_available, namespace_mode
from tests.harness.command_children import ended, first_text, hosted, script
from tests.harness.support import PRESET, open_harness

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="Linux containment"),
    pytest.mark.skipif(os.geteuid() != 0, reason="a root host needs a root test run (CI is one)"),
]
needs_mounts = pytest.mark.skipif(
    namespace_mode() != "root" or not idmap_available(), reason="no idmapped mounts here"
)

LOOK = """
    import json, os, sys
    def read(path):
        try:
            with open(path, "rb") as f:
                return "read " + str(len(f.read(64)))
        except OSError as exc:
            return f"denied ({exc.errno})"
    def listed(path):
        try:
            return "listed " + str(len(os.listdir(path)))
        except OSError as exc:
            return f"denied ({exc.errno})"
    def write(path, text):
        try:
            with open(path, "a") as f:
                f.write(text)
            return "written"
        except OSError as exc:
            return f"denied ({exc.errno})"
    root_only, shared, disk = sys.argv[1:4]
    report = {
        "uid": os.getuid(),
        "shadow": read("/etc/shadow"),
        "root_only": read(root_only),
        "shared": read(shared),
        "root_home": listed("/root"),
        "disk": read(disk) if disk else "no disk device",
        "write_new": write("new.txt", "x"),
        "write_roots_file": write("roots.txt", "y"),
        "write_tmp": write(os.path.join(os.environ["TMPDIR"], "t"), "z"),
    }
    print(json.dumps({"kind": "result", "text": json.dumps(report)}), flush=True)
"""


def _disk() -> str:
    """The block device the root file system is on, if /dev has it."""
    device = os.stat("/").st_dev
    path = f"/dev/block/{os.major(device)}:{os.minor(device)}"
    return os.path.realpath(path) if os.path.exists(path) else ""


def _place(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A directory of files beside the workspace: one only root may read (0600), one
    anyone may (0644); and a root-owned workspace holding a root-owned file."""
    private = tmp_path / "private"
    private.mkdir()
    root_only, shared = private / "key", private / "public"
    root_only.write_text("root's alone")
    root_only.chmod(0o600)
    shared.write_text("anyone's")
    shared.chmod(0o644)
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "roots.txt").write_text("root wrote this\n")
    return private, root_only, shared


@needs_mounts
async def test_a_root_hosts_child_reads_nothing_only_root_may(tmp_path: Path) -> None:
    private, root_only, shared = _place(tmp_path)
    argv = script(LOOK, str(root_only), str(shared), _disk())
    runner = CommandRunner({"worker": argv}, read_only=[str(private)])
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        assert await ended(h, started.conversation_id) == ""
        record = await h.engine.get_child(started.conversation_id)
    assert record is not None
    report = json.loads(record.output)
    assert report["uid"] == 65534
    closed = ["shadow", "root_only", "root_home"] + (["disk"] if _disk() else [])
    assert {name: report[name] for name in closed} == dict.fromkeys(closed, "denied (13)")
    assert report["shared"] == "read 8", "what others may read stays readable"
    written = ("write_new", "write_roots_file", "write_tmp")
    assert [report[name] for name in written] == ["written"] * 3, report
    new = (tmp_path / "ws" / "new.txt").stat()
    assert (new.st_uid, new.st_gid) == (0, 0), "what it writes is root's on disk"
    assert (tmp_path / "ws" / "roots.txt").read_text() == "root wrote this\ny"


USER = """
    import json, os
    print(json.dumps({"kind": "text", "text": json.dumps([os.getuid(), os.getgid()])}))
"""


@needs_mounts
async def test_the_childs_user_comes_from_the_toml(tmp_path: Path) -> None:
    toml = tmp_path / "runner.toml"
    argv = script(USER)
    toml.write_text(
        f"[command]\nchild_uid = 4242\nchild_gid = 4343\n"
        f"[command.profiles.worker]\nargv = {json.dumps(argv)}\n"
    )
    runner = CommandRunner.from_file(toml)
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        assert json.loads(await first_text(h, started.conversation_id)) == [4242, 4343]
        assert await ended(h, started.conversation_id) == ""


async def test_child_uid_0_keeps_root_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = CommandRunner({"worker": script(USER)}, child_uid=0)
    caplog.set_level(logging.WARNING, logger="delegation.runners.command")
    async with hosted(tmp_path, runner) as h:
        for i in range(2):
            started = await h.start(f"q{i}")
            assert json.loads(await first_text(h, started.conversation_id))[0] == 0
    said = [r for r in caplog.records if getattr(r, "action", "") == "root_files_readable"]
    assert len(said) == 1 and "child_uid = 0" in said[0].getMessage()


@needs_mounts
async def test_a_workspace_beneath_a_directory_only_root_may_enter(tmp_path: Path) -> None:
    """pytest's own ``tmp_path`` lies in a 0700 directory of root's, as a workspace in
    ``/root`` would: the child's user may enter the way to it, and Landlock refuses it
    everything beside."""
    closed = tmp_path / "closed"
    (closed / "ws").mkdir(parents=True)
    closed.chmod(0o700)
    (closed / "beside.txt").write_text("not the child's")
    assert not stat.S_IMODE(closed.stat().st_mode) & 0o077
    pwd = script("""
        import json, os
        try:
            open("../beside.txt").read()
            beside = "read"
        except OSError as exc:
            beside = f"denied ({exc.errno})"
        print(json.dumps({"kind": "result", "text": json.dumps([os.getcwd(), beside])}))
    """)
    runner = CommandRunner({"worker": pwd})
    async with Engine(f"sqlite:///{tmp_path / 'x.db'}", runner=runner) as engine:
        h = await open_harness(engine, runner, closed / "ws", [PRESET])
        started = await h.start("q1")
        assert await ended(h, started.conversation_id) == ""
        record = await h.engine.get_child(started.conversation_id)
    assert record is not None
    assert json.loads(record.output) == [str(closed / "ws"), "denied (13)"]


@needs_mounts
async def test_a_read_only_root_holding_a_closed_directory_reads_nothing_of_roots_in_it(
    tmp_path: Path,
) -> None:
    """The review of issue 35: with ``read_only`` naming a directory and a root inside a
    0700 directory of root's in it, the way in was mounted idmapped and every 0600 file
    of root's there became the child's to read. The closed directory is carved out of
    the outer root now; the inner root stays readable."""
    outer = tmp_path / "srv"
    private = outer / "private"
    (private / "tool").mkdir(parents=True)
    private.chmod(0o700)
    (private / "secret.key").write_text("root's alone")
    (private / "secret.key").chmod(0o600)
    (private / "tool" / "readme").write_text("for the child")
    (outer / "beside").write_text("for the child too")
    for directory in (tmp_path, outer):
        directory.chmod(0o755)  # the way to the outer root is open; only private is closed
    argv = script(READS, str(private / "secret.key"), str(private / "tool" / "readme"),
                  str(outer / "beside"))  # fmt: skip
    runner = CommandRunner({"worker": argv}, read_only=[str(outer), str(private / "tool")])
    async with hosted(tmp_path, runner) as h:
        started = await h.start("q1")
        assert await ended(h, started.conversation_id) == ""
        record = await h.engine.get_child(started.conversation_id)
    assert record is not None
    assert json.loads(record.output) == ["denied (13)", "for the child", "for the child too"]


READS = """
    import json, sys
    found = []
    for path in sys.argv[1:]:
        try:
            found.append(open(path).read())
        except OSError as exc:
            found.append(f"denied ({exc.errno})")
    print(json.dumps({"kind": "result", "text": json.dumps(found)}), flush=True)
"""
