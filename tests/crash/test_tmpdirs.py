"""Private temp dirs a killed host left are removed at the next boot (design §17).

A host killed with SIGKILL while its command child runs cannot remove the child's
private ``TMPDIR``. The next engine open removes it, and only what is certainly stale:
the directory of a host still running (several share a machine), of another user, a
symlink, or a name of an earlier version stay.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from delegation import Engine, NotResumable
from delegation import os_processes as processes
from delegation.runners import tmpdirs
from tests.harness.support import ScriptRunner

HERE = Path(__file__).resolve().parents[1] / "harness"
ROOT = HERE.parents[1]
HOST = HERE / "protect_host.py"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process identities: /proc")


def ended_host() -> processes.ProcessId:
    """The identity of a real process that has ended."""
    proc = subprocess.Popen(["/bin/sleep", "60"])
    identity = processes.identify(proc.pid)
    proc.kill()
    proc.wait()
    assert identity is not None
    return identity


def this_host() -> processes.ProcessId:
    identity = processes.identify(os.getpid())
    assert identity is not None
    return identity


def made_by(where: Path, host: processes.ProcessId) -> Path:
    """A private temp dir in ``where`` named as ``host`` names it, with a file inside."""
    path = Path(tempfile.mkdtemp(prefix=tmpdirs.prefix(host), dir=where))
    (path / "file").write_text("x")
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory a child's temp dir links to: what removal must never follow."""
    target = tmp_path / "outside"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    return target


def test_the_dir_of_a_host_that_ended_goes_without_following_its_links(
    tmp_path: Path, outside: Path
) -> None:
    where = tmp_path / "tmp"
    where.mkdir()
    stale = made_by(where, ended_host())
    (stale / "sub").mkdir()
    (stale / "sub" / "out").symlink_to(outside)
    (stale / "file-link").symlink_to(outside / "keep.txt")
    assert tmpdirs.remove_stale(str(where)) == [str(stale)]
    assert not stale.exists()
    assert (outside / "keep.txt").read_text() == "keep"


def test_a_dir_from_before_the_machine_restarted_goes(tmp_path: Path) -> None:
    me = this_host()  # alive, but under another boot id it cannot be
    earlier = processes.ProcessId(me.pid, me.start, "0" * 8 + me.boot[8:])
    stale = made_by(tmp_path, earlier)
    assert tmpdirs.remove_stale(str(tmp_path)) == [str(stale)]


def test_what_is_not_certainly_stale_stays(
    tmp_path: Path, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live = made_by(tmp_path, this_host())
    dead = ended_host()
    name = tmpdirs.prefix(dead) + "symlink1"
    (tmp_path / name).symlink_to(outside)  # a link, not a directory of ours
    old = Path(tempfile.mkdtemp(prefix=tmpdirs.PREFIX, dir=tmp_path))  # an earlier version's
    ours = tmpdirs.prefix(dead).removeprefix(tmpdirs.PREFIX).split("-", 1)[1]  # PID-START-BOOT-
    elsewhere = tmp_path / f"{tmpdirs.PREFIX}1-{ours}abcdefgh"
    elsewhere.mkdir()  # another pid namespace's
    kept = [live, tmp_path / name, old, elsewhere]
    if os.geteuid() == 0:
        other_user = made_by(tmp_path, dead)
        os.chown(other_user, 65534, 65534)
        kept.append(other_user)
    caplog.set_level(logging.INFO, logger="delegation.tmpdirs")
    assert tmpdirs.remove_stale(str(tmp_path)) == []
    assert all(os.path.lexists(path) for path in kept)
    assert caplog.records == [], "none was even tried"
    assert (outside / "keep.txt").exists()


def test_a_childs_dir_is_named_for_its_host() -> None:
    made = tmpdirs.make()
    try:
        assert os.path.basename(made).startswith(tmpdirs.prefix(this_host()))
        assert os.path.dirname(made) == tempfile.gettempdir()
        assert made not in tmpdirs.remove_stale()
        assert os.path.isdir(made)
    finally:
        shutil.rmtree(made)


# --- with real hosts --------------------------------------------------------------------


@pytest.fixture
def place(tmp_path: Path) -> Path:
    for name in ("db-a", "db-b", "ws", "outside"):
        (tmp_path / name).mkdir()
    (tmp_path / "outside" / "keep.txt").write_text("keep")
    return tmp_path


def start_host(place: Path, db: str) -> tuple[subprocess.Popen[str], str]:
    """A host whose command child runs, and the child's private temp dir."""
    host = subprocess.Popen(
        [sys.executable, str(HOST), "hold", str(place / db / "x.db"), str(place / "ws"),
         str(place / "outside")],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert host.stdout is not None
    line = host.stdout.readline()
    assert line.startswith("STARTED "), line
    return host, line.split()[2]


def test_a_killed_hosts_dir_is_removed_at_the_next_boot_a_live_ones_is_not(place: Path) -> None:
    killed, killed_dir = start_host(place, "db-a")
    live, live_dir = start_host(place, "db-b")
    try:
        assert Path(killed_dir, "file").exists() and Path(killed_dir, "out").is_symlink()
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert os.path.isdir(killed_dir), "nothing removes it when the host is killed"
        asyncio.run(_boot(place / "db-a" / "x.db"))
        assert not os.path.lexists(killed_dir)
        assert os.path.isdir(live_dir) and Path(live_dir, "file").exists()
        assert (place / "outside" / "keep.txt").read_text() == "keep"
    finally:
        for host in (killed, live):
            if host.poll() is None:
                host.kill()
            host.wait(10)
            assert host.stdout is not None
            host.stdout.close()
        for left in (killed_dir, live_dir):
            shutil.rmtree(left, ignore_errors=True)


async def _boot(db: Path) -> None:
    """The next boot on the killed host's database; its child is not resumed."""
    runner = ScriptRunner(prepare_error=NotResumable())
    async with Engine(f"sqlite:///{db}", runner=runner):
        pass
