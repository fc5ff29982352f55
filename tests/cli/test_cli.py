"""The inspection commands and ``delegation db``, run as users run them.

A real Engine fills a real file (done, failed, cancelled, leased and revoked
children); the CLI then reads it, in-process through ``main`` and as a separate
process, while that engine is still open, and must never write to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from delegation import ChildContext, Event
from delegation.cli import show
from delegation.cli.commands import main
from delegation.codec import encode
from delegation.records import ChildRecord, LeaseRecord
from delegation.store import migrate
from tests.harness.fingerprints import fingerprint
from tests.harness.support import PRESET, Harness, Script, finish_after_admit, hold
from tests.harness.terminal import Cli, in_process

ROOT = Path(__file__).resolve().parents[2]
LEASE = "lease-1"
# --json names every field as the wire does (Identity's and Result's camelCase names),
# and the fields only the database has the same way.
WIRE_KEYS = {
    "runnerId", "hostInstanceId", "conversationId", "runId", "parentConversationId",
    "parentRunId", "extensionId", "profile", "requestId", "leaseId", "generation",
    "request", "preset", "cwd", "state", "error", "output",
}  # fmt: skip
CHILD_KEYS = WIRE_KEYS | {
    "id", "grantId", "depth", "followup", "engineInstanceId", "cancelRequestedAt",
    "cancelReason", "recoveryAttempts", "createdAt", "updatedAt", "admittedAt", "finishedAt",
    "originGrantId",
}  # fmt: skip
CAMEL = re.compile("[a-z]+(?:[A-Z][a-z]*)*")


def wire_keys(
    document: dict[str, Any],
    record: type[Any],
    known: set[str],
    extra: frozenset[str] = frozenset(),
) -> bool:
    """Every field of ``record`` once (besides the document's ``extra``), each camelCase:
    those named in ``known``, and any field added since under its camelCase name."""
    keys = set(document) - extra
    # A child's versions (design §34) and where a rewind came from (§35) are shown only
    # when set: unversioned and not rewound, none is.
    unset = (VERSION_KEYS | REWIND_KEYS) - keys if record is ChildRecord else set()
    fields = len(dataclasses.fields(record)) - len(unset)
    right = extra <= set(document) and known <= keys and len(keys) == fields
    return right and all(CAMEL.fullmatch(key) for key in document)


VERSION_KEYS = {"version", "attemptVersion", "pinnedVersion", "unpinnedAt"}
REWIND_KEYS = {"rewoundFrom", "rewoundStep"}
LEASE_KEYS = {
    "leaseId", "runnerId", "extensionId", "runId", "conversationId", "createdAt", "expiresAt",
    "activatedAt", "revokedAt", "revokeReason", "children",
}  # fmt: skip


async def boom(ctx: ChildContext) -> None:
    await ctx.admit()
    raise RuntimeError("[red]tool failed[/red] badly")


def chatty(count: int) -> Script:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for n in range(count):
            ctx.emit(Event(kind="text", text=f"line {n + 1}"))

    return run


def route(**scripts: Script) -> Script:
    """One runner script per child, chosen by the request's message."""

    async def run(ctx: ChildContext) -> None:
        await scripts[ctx.request.message](ctx)

    return run


@dataclasses.dataclass
class Fleet:
    quick: str
    failed: str
    cancelled: str
    leased: str
    revoked: str


@pytest.fixture
async def gate() -> AsyncIterator[asyncio.Event]:
    released = asyncio.Event()
    yield released
    released.set()


@pytest.fixture
async def fleet(harness: Harness, gate: asyncio.Event, workspace: Path) -> Fleet:
    """Five children of every kind; the leased one is still running."""
    h = harness
    h.runner.script = route(quick=finish_after_admit, boom=boom, hold=hold(gate))
    quick = (await h.start("q1", message="quick")).conversation_id
    failed = (await h.start("q2", message="boom")).conversation_id
    cancelled = (await h.start("q3", message="hold")).conversation_id
    await h.engine.call(h.conn, "child.cancel", h.params(child_id=cancelled))
    leased = (await h.start("q4", message="hold", lease_id=LEASE)).conversation_id
    await h.engine.open_tool(
        h.conn,
        run_id="other-run",
        conversation_id="other-conv",
        tool_call_id="call-x",
        extension_id=PRESET.extension_id,
        presets=[PRESET],
        workspace=str(workspace),
    )
    other = await h.start(
        "q5", message="hold", lease_id="lease-2", run_id="other-run", tool_call_id="call-x"
    )
    await h.engine.finish_run("other-run", succeeded=False)
    for child in (quick, failed, cancelled, other.conversation_id):
        await h.wait_done(child)
    return Fleet(quick, failed, cancelled, leased, other.conversation_id)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], db_url: str) -> Cli:
    """``delegation ARGS --db <the test's database URL>`` in this process."""
    return in_process(capsys, db_url)


def spawn(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "delegation.cli", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )


def ids(document: list[dict[str, Any]]) -> list[str]:
    return [item["conversationId"] for item in document]


# --- children ------------------------------------------------------------------------


@pytest.mark.parametrize("wide", [False, True])
async def test_children_table_lists_newest_first(cli: Cli, fleet: Fleet, wide: bool) -> None:
    code, out, err = cli("children", *(["--wide"] if wide else []))
    assert (code, err) == (0, "")
    order = [fleet.revoked, fleet.leased, fleet.cancelled, fleet.failed, fleet.quick]
    shown = order if wide else [f"{child[:10]}" for child in order]  # shortened, else whole
    assert sorted(shown, key=out.index) == shown
    assert "[red]tool failed[/red] badly" in out  # printed, not read as markup
    assert "done: quick" in out
    assert "cancelled: cancel requested" in out


async def test_children_json_is_one_document_of_records(cli: Cli, fleet: Fleet) -> None:
    code, out, _ = cli("children", "--json")
    document = json.loads(out)
    assert code == 0
    assert ids(document) == [
        fleet.revoked,
        fleet.leased,
        fleet.cancelled,
        fleet.failed,
        fleet.quick,
    ]
    assert all(wire_keys(item, ChildRecord, CHILD_KEYS) for item in document)
    failed = document[3]
    assert failed["request"] == {"requestId": "q2", "profile": "worker", "message": "boom"}
    assert failed["preset"] == {"name": "worker", "extensionId": "ext", "generation": 7}
    assert (failed["state"], failed["error"]) == ("done", "[red]tool failed[/red] badly")
    assert isinstance(failed["createdAt"], float)
    assert failed["followup"] is False


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (["--state", "done"], ["failed", "quick"]),
        (["--state", "cancelled"], ["revoked", "cancelled"]),
        (["--lease", LEASE], ["leased"]),
        (["--lease", "lease-2", "--state", "cancelled"], ["revoked"]),
        (["--parent", "other-run"], ["revoked"]),
        (["--parent", "parent-run", "--limit", "2"], ["leased", "cancelled"]),
        (["--parent", "no-such-run"], []),
    ],
)
async def test_children_filters(
    cli: Cli, fleet: Fleet, filters: list[str], expected: list[str]
) -> None:
    code, out, _ = cli("children", "--json", *filters)
    assert code == 0
    assert ids(json.loads(out)) == [getattr(fleet, name) for name in expected]


async def test_children_filter_by_live_state(cli: Cli, fleet: Fleet, harness: Harness) -> None:
    record = await harness.engine.get_child(fleet.leased)
    assert record is not None and not record.terminal
    _, out, _ = cli("children", "--json", "--state", record.state)
    assert ids(json.loads(out)) == [fleet.leased]


async def test_children_refuses_an_unknown_state(cli: Cli, fleet: Fleet) -> None:
    code, out, err = cli("children", "--state", "finished")
    assert (code, out) == (2, "")  # a usage error (docs/cli.md, "Exit codes")
    assert "unknown state 'finished'" in err


# --- show ----------------------------------------------------------------------------


async def test_show_json_has_every_field_and_recent_events(
    cli: Cli, fleet: Fleet, harness: Harness
) -> None:
    code, out, _ = cli("show", fleet.leased, "--json")
    document = json.loads(out)
    assert code == 0
    extra = frozenset({"eventCount", "recentEvents", "stepCount", "recentSteps"})
    assert wire_keys(document, ChildRecord, CHILD_KEYS, extra)
    assert document["leaseId"] == LEASE
    assert document["request"]["leaseId"] == LEASE
    assert document["eventCount"] == 1
    assert document["recentEvents"] == [{"sequence": 1, "kind": "text", "text": "working"}]
    assert (document["stepCount"], document["recentSteps"]) == (0, [])
    record = await harness.engine.get_child(fleet.leased)
    assert record is not None and document["runId"] == record.run_id
    # The names and values of the wire's own Result, for the fields both have.
    result = json.loads(encode(await harness.read(fleet.leased, lease_id=LEASE)))
    identity = {k: v for k, v in result.items() if k not in ("done", "events")}
    assert {k: document[k] for k in identity} == identity


async def test_show_table_and_run_selection(cli: Cli, fleet: Fleet, harness: Harness) -> None:
    record = await harness.engine.get_child(fleet.failed)
    assert record is not None
    code, out, _ = cli("show", fleet.failed, "--run", record.run_id)
    assert code == 0
    for text in (record.run_id, "parent-run", '"message": "boom"', "[red]tool failed"):
        assert text in out
    code, out, err = cli("show", fleet.failed, "--run", "r-nope")
    assert (code, out) == (1, "")
    assert f"no child {fleet.failed} run r-nope" in err


async def test_show_of_a_missing_child_fails_on_stderr(cli: Cli, fleet: Fleet) -> None:
    code, out, err = cli("show", "c-missing")
    assert (code, out) == (1, "")
    assert err.strip() == "delegation: no child c-missing"


# --- events --------------------------------------------------------------------------


async def test_events_page_through_more_than_one_read(cli: Cli, harness: Harness) -> None:
    harness.runner.script = chatty(300)
    child = (await harness.start("q1")).conversation_id
    await harness.wait_done(child)

    code, out, _ = cli("events", child, "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [e["sequence"] for e in lines] == list(range(1, 301))
    assert lines[-1] == {"sequence": 300, "kind": "text", "text": "line 300"}

    _, out, _ = cli("events", child, "--json", "--after", "170")
    assert [json.loads(line)["sequence"] for line in out.splitlines()] == list(range(171, 301))

    _, out, _ = cli("events", child)
    assert len(out.splitlines()) == 300
    assert out.splitlines()[-1].split() == ["300", "text", "line", "300"]

    _, out, _ = cli("show", child, "--json")
    assert json.loads(out)["eventCount"] == 300


async def test_events_of_a_missing_child_fail(cli: Cli, fleet: Fleet) -> None:
    code, out, err = cli("events", "c-missing", "--follow")
    assert (code, out) == (1, "")
    assert "no child c-missing" in err


async def following(db_path: Path, *args: str) -> asyncio.subprocess.Process:
    """``delegation ARGS --db DB_PATH`` running, its output piped, while the test goes on."""
    return await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "delegation.cli", *args),
        *("--db", str(db_path)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )


async def test_events_follow_streams_json_lines_until_the_child_ends(
    harness: Harness, db_path: Path, gate: asyncio.Event
) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="started"))
        await gate.wait()
        for n in range(5):
            await asyncio.sleep(0.2)
            ctx.emit(Event(kind="text", text=f"step {n + 1}"))
        ctx.emit(Event(kind="result", text="finished"))

    harness.runner.script = run
    child = (await harness.start("q1")).conversation_id
    follower = await following(db_path, "events", child, "--follow", "--json")
    assert follower.stdout is not None
    first = json.loads(await asyncio.wait_for(follower.stdout.readline(), 15))
    # Streamed while the child was still running: it cannot end before the gate opens.
    assert first == {"sequence": 1, "kind": "text", "text": "started"}
    gate.set()
    rest, err = await asyncio.wait_for(follower.communicate(), 15)
    assert follower.returncode == 0, err
    *lines, last = [first, *(json.loads(line) for line in rest.decode().splitlines())]
    assert [e["sequence"] for e in lines] == list(range(1, 8))
    assert lines[-1] == {"sequence": 7, "kind": "result", "text": "finished"}
    # It ends by saying how the child ended.
    assert last == {"end": {"state": "done", "error": "", "output": "finished"}}
    record = await harness.engine.get_child(child)
    assert record is not None and record.state == "done"


async def test_events_follow_for_people_ends_with_the_state_and_error(
    harness: Harness, db_path: Path, gate: asyncio.Event
) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="started"))
        await gate.wait()
        raise RuntimeError("disk \x1b[2J full")

    harness.runner.script = run
    child = (await harness.start("q1")).conversation_id
    follower = await following(db_path, "events", child[:8], "--follow")
    assert follower.stdout is not None
    first = await asyncio.wait_for(follower.stdout.readline(), 15)
    assert first.decode().split() == ["1", "text", "started"]
    gate.set()
    rest, err = await asyncio.wait_for(follower.communicate(), 15)
    assert (follower.returncode, err) == (0, b"")
    assert rest.decode() == "-- done: disk \\x1b[2J full\n", "the state and its error, escaped"
    # A child that has already ended: its events, then at once how it ended.
    done = await asyncio.to_thread(spawn, "events", child, "--follow", "--db", str(db_path))
    assert done.stdout.splitlines()[-1] == "-- done: disk \\x1b[2J full"


def test_a_follow_whose_child_is_gone_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert show.ended(None, as_json=True) == 1
    assert json.loads(capsys.readouterr().out) == {
        "end": {"state": None, "error": show.GONE, "output": ""}
    }
    assert show.ended(None, as_json=False) == 1
    assert capsys.readouterr().out == f"-- gone: {show.GONE}\n"


# --- leases --------------------------------------------------------------------------


async def test_leases_show_live_and_revoked(cli: Cli, fleet: Fleet) -> None:
    for wide in (False, True):
        code, out, _ = cli("leases", *(["--wide"] if wide else []))
        assert code == 0
        live = next(line for line in out.splitlines() if LEASE in line)
        revoked = next(line for line in out.splitlines() if "lease-2" in line)
        assert "expires in" in live and "revoked" not in live
        assert "revoked (parent run failed)" in revoked
        assert ("other-run" in revoked) is wide, "the parent run: a column of --wide"

    code, out, _ = cli("leases", "--json")
    document = {item["leaseId"]: item for item in json.loads(out)}
    assert set(document) == {LEASE, "lease-2"}
    leases = document.values()
    assert all(wire_keys(item, LeaseRecord, LEASE_KEYS, frozenset({"status"})) for item in leases)
    assert document[LEASE]["children"] == 1
    assert document[LEASE]["status"].startswith("expires in ")
    assert document["lease-2"]["status"].startswith("revoked")
    assert document["lease-2"]["revokedAt"] is not None

    assert json.loads(cli("leases", "--json", "--runner", "runner-1")[1]) != []
    assert json.loads(cli("leases", "--json", "--runner", "nobody")[1]) == []


# --- read-only, beside a running host ------------------------------------------------


async def test_cli_reads_beside_a_running_engine_and_writes_nothing(
    fleet: Fleet, harness: Harness, db_path: Path, cli: Cli
) -> None:
    await asyncio.sleep(0.1)  # let the last background writes settle
    before = fingerprint(db_path)
    assert harness.engine.is_open
    commands = [
        ("children", "--json"),
        ("show", fleet.leased, "--json"),
        ("events", fleet.leased, "--json"),
        ("leases", "--json"),
    ]
    results = [await asyncio.to_thread(spawn, *c, "--db", str(db_path)) for c in commands]
    assert [r.returncode for r in results] == [0, 0, 0, 0], [r.stderr for r in results]
    listed = {item["conversationId"]: item["state"] for item in json.loads(results[0].stdout)}
    engine_view = await harness.engine.list_children()
    assert listed == {r.conversation_id: r.state for r in engine_view}
    assert fingerprint(db_path) == before

    await harness.engine.close()
    before = fingerprint(db_path)
    for command in commands:
        assert cli(*command)[0] == 0
    assert fingerprint(db_path) == before


# --- the database --------------------------------------------------------------------


async def test_db_current_prints_the_head_revision(cli: Cli) -> None:
    assert cli("db", "current") == (0, migrate.head() + "\n", "")


async def test_db_upgrade_creates_migrates_and_then_does_nothing(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "new" / "delegation.db"
    code, out, err = cli("db", "upgrade", db=missing)
    assert (code, out) == (1, "") and "does not exist" in err
    assert not missing.parent.exists(), "a missing directory is never created"
    fresh = tmp_path / "fresh.db"
    head = migrate.head()
    assert cli("db", "upgrade", db=fresh) == (0, f"upgraded empty -> {head}\n", "")
    assert fresh.stat().st_mode & 0o777 == 0o600
    assert fresh.is_file()
    assert cli("db", "current", db=fresh) == (0, head + "\n", "")
    assert cli("db", "upgrade", db=fresh) == (0, f"upgraded {head} -> {head}\n", "")
    assert cli("children", "--json", db=fresh) == (0, "[]\n", "")


def test_missing_database_is_a_clear_error_and_is_not_created(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "elsewhere" / "absent.db"
    proc = spawn("children", "--db", str(missing))
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == f"delegation: no delegation database at {missing} (store_error)\n"
    for command in (("show", "c-1"), ("events", "c-1"), ("leases",), ("db", "current")):
        code, out, err = cli(*command, db=missing)
        assert (code, out) == (1, "")
        assert f"no delegation database at {missing}" in err
    assert not missing.parent.exists()


@pytest.mark.sqlite_only  # an empty SQLite file, made by the stdlib driver
async def test_a_file_without_the_schema_is_refused(cli: Cli, tmp_path: Path) -> None:
    bare = tmp_path / "bare.db"
    sqlite3.connect(bare).close()
    code, out, err = cli("children", db=bare)
    assert (code, out) == (1, "")
    assert "no schema" in err and "delegation db upgrade" in err


@pytest.mark.parametrize(
    ("runner", "config", "says"),
    [
        ("command", None, "needs settings: give --runner-config"),
        ("command", "[command]\nshell = true\n", "cannot load runner"),
        ("no_such_module_x:thing", None, "No module named"),
        ("delegation.runners:BUILT_IN", None, "no prepare()"),
    ],
)
def test_serve_refuses_a_runner_it_cannot_load(
    runner: str, config: str | None, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["serve", "--stdio", "--db", str(tmp_path / "x.db"), "--runner", runner]
    if config is not None:
        (tmp_path / "runner.toml").write_text(config)
        args += ["--runner-config", str(tmp_path / "runner.toml")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert says in err
    assert "Traceback" not in err
    assert not (tmp_path / "x.db").exists(), "nothing was opened"


def test_serve_never_replaces_a_file_that_is_not_a_socket(cli: Cli, db_path: Path) -> None:
    before = fingerprint(db_path)
    code, _, err = cli("serve", "--socket", str(db_path))
    assert code == 2
    assert "exists and is not a socket" in err
    assert db_path.exists() and fingerprint(db_path) == before


def test_the_distribution_has_a_name_of_its_own() -> None:
    """The package index's "delegation" is another project: this one installs as
    durable-delegation (issue 29), and --version reads that distribution."""
    import importlib.metadata
    import tomllib

    from delegation.about import DISTRIBUTION

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION == "durable-delegation"
    assert importlib.metadata.version(DISTRIBUTION) == project["version"]
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("delegation")), "--version"],
        capture_output=True,
        text=True,
    )
    assert proc.stdout.strip() == f"delegation {project['version']}"


def test_a_reader_that_goes_away_gets_no_traceback() -> None:
    """Issue 28/29: `delegation events --json | head` printed an 18-line BrokenPipeError.
    The reader here is gone before the command writes (the pipe's read end is closed)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("delegation")), "completion", "bash"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write)
    assert proc.stderr == ""
    assert proc.returncode == 1
