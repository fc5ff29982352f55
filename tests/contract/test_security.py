"""The security claims in one place (design §2.1, §3.4, §3.8, §8), each proven end to end.

* Credential-free by construction: an unknown field (``apiKey``, ``token``,
  ``credentials``) is refused at every level of what a caller sends, through
  ``Engine.call`` and through ``delegation serve``; the command runner's process sees
  none of the host's secret variables and none of its open files.
* The cwd stays confined even when a directory on it is swapped for a symlink leading
  out of the workspace after the start was checked (before admission, or while the
  host was down before a resume).
* The socket is born 0600 under any umask and refuses a peer with another uid.
* A frame of exactly 4 MiB is served; one byte more is refused and the stream goes on.
* Every cap is refused exactly one past its default number, with its message, also
  when the calls race: 64 children per grant (those whose prepare failed included),
  1024 leases plus tombstones per runner, 128 steer receipts per child, 32 presets,
  nesting depth 8.

Everything runs on both stores (a SQLite file and a real PostgreSQL server) through the
real migrations, with real subprocesses.
Shorter checks of some of these live beside their subject (test_decode, test_methods,
test_serve, test_command_runner); the cases here are the ones those leave open.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import shutil
import socket
import stat
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from sqlalchemy import make_url

from delegation import (
    START_METHOD,
    ChildContext,
    Engine,
    EngineConfig,
    Identity,
    Preset,
    Recovery,
    Request,
    Result,
    errors,
)
from delegation.clock import ManualClock
from delegation.host.serve import CHUNK, serve_socket
from delegation.run.context import Run
from delegation.runners.command import DEFAULT_ENV_ALLOW, CommandRunner
from tests.harness import rows
from tests.harness.authority_cases import snapshot
from tests.harness.commands import hosted, script, texts
from tests.harness.serving import OWNER, Client, host, socket_client, start_params
from tests.harness.serving import PRESET as SERVE_PRESET
from tests.harness.support import PRESET, Harness, ScriptRunner, open_harness
from tests.harness.tool_calls import open_tool, release, steer

FRAME_LIMIT = 4 * 1024 * 1024
SECRET_NAMES = ("apiKey", "token", "credentials")


def count_rows(db_url: str, table: str) -> int:
    return int(rows.scalar(db_url, f'SELECT COUNT(*) FROM "{table}"'))


async def connect_when_listening(path: Path) -> Client:
    """A client of the socket, once the host listens (its file appears at bind, before)."""
    for _ in range(400):
        with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
            return await socket_client(path)
        await asyncio.sleep(0.025)
    raise AssertionError(f"nothing listens on {path}")


@contextlib.asynccontextmanager
async def served(
    transport: str, db_url: str, tmp_path: Path, *args: str, umask: int | None = None
) -> AsyncIterator[Client]:
    """A ``delegation serve`` subprocess and one client connected to it."""
    path = tmp_path / "host.sock"
    where = ("--stdio",) if transport == "stdio" else ("--socket", str(path))
    previous = os.umask(umask) if umask is not None else None
    try:
        proc = await host(*where, "--db", db_url, *args)
    finally:
        if previous is not None:
            os.umask(previous)
    try:
        if transport == "stdio":
            assert proc.stdin is not None and proc.stdout is not None
            client = Client(proc.stdout, proc.stdin)
        else:
            client = await connect_when_listening(path)
        try:
            yield client
        finally:
            await client.close()
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        if transport == "socket":
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 20)


# --- credential-free: unknown fields at every level -----------------------------------


def start_doc() -> dict[str, Any]:
    """A valid child.start for the harness, with a request and nested options."""
    return {
        "runId": "parent-run",
        "toolCallId": "call-1",
        "extensionId": PRESET.extension_id,
        "generation": PRESET.generation,
        "request": {
            "requestId": "q1",
            "profile": PRESET.name,
            "message": "do the task",
            "options": {"maxTurns": 3, "allowedTools": ["grep_tool"]},
        },
    }


LEVELS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "params": lambda doc: doc,
    "request": lambda doc: doc["request"],
    "options": lambda doc: doc["request"]["options"],
}


@pytest.mark.parametrize("name", SECRET_NAMES)
@pytest.mark.parametrize("level", list(LEVELS))
async def test_an_unknown_field_at_any_level_is_refused_by_engine_call(
    level: str, name: str, harness: Harness, db_url: str
) -> None:
    doc = start_doc()
    LEVELS[level](doc)[name] = "sk-live-0123456789"
    before = snapshot(db_url)
    with pytest.raises(errors.MalformedInput) as caught:
        await harness.engine.call(harness.conn, START_METHOD, json.dumps(doc).encode())
    assert f"unknown field `{name}`" in str(caught.value)
    assert (caught.value.reason, caught.value.rpc_code) == ("malformed_input", -32602)
    await asyncio.sleep(0.02)
    assert harness.runner.prepared == []
    assert snapshot(db_url) == before, "a refused call writes nothing"
    del LEVELS[level](doc)[name]
    started = await harness.engine.call(harness.conn, START_METHOD, json.dumps(doc))
    assert isinstance(started, Result) and len(harness.runner.prepared) == 1


def tool_begin(**preset_changes: Any) -> dict[str, Any]:
    preset = {**SERVE_PRESET, "options": {"noSkills": True}, **preset_changes}
    return {
        "runId": "run-1",
        "conversationId": "conv-1",
        "toolCallId": "call-1",
        "extensionId": "ext",
        "presets": [preset],
        "workspace": "",
    }


async def test_serve_refuses_an_unknown_field_at_every_level(
    db_url: str, tmp_path: Path, workspace: Path
) -> None:
    register = {"runnerId": "r1", "hostInstanceId": "h1"}
    begin = tool_begin()
    begin["workspace"] = str(workspace)
    start = start_params("q1", "work in 1 steps")
    start["request"]["options"] = {"maxTurns": 2}
    bad: list[tuple[str, dict[str, Any], Callable[[dict[str, Any]], dict[str, Any]]]] = [
        ("runner.register", register, lambda d: d),
        ("tool.begin", begin, lambda d: d),
        ("tool.begin", begin, lambda d: d["presets"][0]),  # a preset: the Profile fields
        ("tool.begin", begin, lambda d: d["presets"][0]["options"]),
        ("child.start", start, lambda d: d),
        ("child.start", start, lambda d: d["request"]),
        ("child.start", start, lambda d: d["request"]["options"]),
        ("child.read", {**OWNER, "childId": "c"}, lambda d: d),
        ("tool.end", {"runId": "run-1", "toolCallId": "call-1"}, lambda d: d),
        ("run.finish", {"runId": "run-1", "succeeded": True}, lambda d: d),
    ]
    ready: set[str] = set()
    async with served("stdio", db_url, tmp_path) as client:
        for index, (method, params, where) in enumerate(bad):
            for name in SECRET_NAMES:
                doc = copy.deepcopy(params)
                where(doc)[name] = "sk-live-0123456789"
                answer = await client.call(method, doc)
                assert answer["error"]["code"] == -32602, (method, index, name, answer)
                assert answer["error"]["data"] == {"reason": "malformed_input"}
                assert name in answer["error"]["message"]
            if method in ("runner.register", "tool.begin") and method not in ready:
                await client.ok(method, params)  # what follows needs them
                ready.add(method)
        started = await client.ok("child.start", start)
        assert started["parentRunId"] == "run-1"
    assert count_rows(db_url, "children") == 1, "only the well-formed start reserved a child"


# --- credential-free: the command runner's process ------------------------------------

HOST_SECRETS = {
    "OPENAI_API_KEY": "sk-proj-host-only",
    "ANTHROPIC_API_KEY": "sk-ant-host-only",
    "AWS_SECRET_ACCESS_KEY": "aws-host-only",
    "GITHUB_TOKEN": "ghp_host_only",
    "DELEGATION_SECRET": "prefixed-host-only",  # the DELEGATION_ prefix is no pass
    "LD_PRELOAD": "/nonexistent/libhost-only.so",
}


async def test_the_commands_environment_holds_no_host_secret(
    db_url: str, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = {**HOST_SECRETS, f"X_{uuid.uuid4().hex.upper()}": uuid.uuid4().hex}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SECURITY_TEST_EXTRA", "passed")
    env_program = shutil.which("env")
    assert env_program is not None
    runner = CommandRunner(profiles={"worker": [env_program]}, env_allow=["SECURITY_TEST_EXTRA"])
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1")
        record = await h.wait_done(started.conversation_id)
        assert (record.state, record.error) == ("done", "")
        lines = await texts(h, started.conversation_id)
    seen = dict(line.split("=", 1) for line in lines)
    for name, value in secrets.items():
        assert name not in seen
        assert not any(value in line for line in lines), name
    allowed = [*DEFAULT_ENV_ALLOW, "SECURITY_TEST_EXTRA"]
    expected = {name for name in allowed if name in os.environ}
    expected |= {"DELEGATION_CONVERSATION_ID", "DELEGATION_RUN_ID", "DELEGATION_PROFILE"}
    expected |= {"TMPDIR"}  # the child's private temp dir (design §10), never the host's
    assert set(seen) == expected, "exactly the allowlisted names and the child's own ids"
    assert os.path.basename(seen["TMPDIR"]).startswith("delegation-child-")
    assert seen["SECURITY_TEST_EXTRA"] == "passed"


def open_paths() -> set[str]:
    """What this process's file descriptors name."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
    return paths


def database_files(db_url: str) -> set[str]:
    """What a descriptor open on the database names: the SQLite file, or a TCP socket
    (``socket:[inode]``) connected to the PostgreSQL server's port (of any process)."""
    url = make_url(db_url)
    if rows.is_sqlite(db_url):
        assert url.database is not None
        return {os.path.realpath(url.database)}
    port = url.port or 5432
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as lines:
            next(lines)  # the header
            for line in lines:
                fields = line.split()
                state, remote, inode = fields[3], fields[2], fields[9]
                if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port:  # established
                    found.add(f"socket:[{inode}]")
    return found


async def test_the_command_inherits_none_of_the_hosts_open_files(
    db_url: str, workspace: Path
) -> None:
    ls_program = shutil.which("ls")
    assert ls_program is not None
    runner = CommandRunner(profiles={"worker": [ls_program, "/proc/self/fd"]})
    before = database_files(db_url) & open_paths()  # the fixtures' own connections
    async with hosted(db_url, workspace, runner) as h:
        assert (database_files(db_url) & open_paths()) - before, "the host has its database open"
        started = await h.start("q1")
        await h.wait_done(started.conversation_id)
        fds = await texts(h, started.conversation_id)
    assert fds == ["0", "1", "2", "3"], "the three pipes and ls's own listing, nothing more"


# --- cwd confinement: a symlink swapped in after the check ----------------------------

MARK_AND_PRINT = "import os; open('marker', 'w').close(); print(os.getcwd())"


class SwappingRunner(CommandRunner):
    """The command runner, with a swap of the workspace done after the start's check:
    in ``prepare`` (the reservation has committed) or in the run just before it admits."""

    def __init__(self, swap: Callable[[], None], when: str) -> None:
        super().__init__(profiles={"worker": script(MARK_AND_PRINT)})
        self.swap = swap
        self.when = when
        self.engine: Engine | None = None
        self.reserved: Any = None

    async def prepare(  # type: ignore[override]
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        run = await super().prepare(request, preset, identity, recovery)
        if self.when == "prepare":
            assert self.engine is not None
            self.reserved = await self.engine.get_child(identity.conversation_id)
            self.swap()
            return run

        async def swap_then_run(ctx: ChildContext) -> None:
            self.swap()
            await run(ctx)

        return swap_then_run


def replace_with_link(directory: Path, target: Path) -> None:
    shutil.rmtree(directory)
    directory.symlink_to(target, target_is_directory=True)


SWAPS = {
    # cwd, what the swap does, the refusal
    "leaf-to-outside": ("sub", "sub", "child working directory exceeds parent workspace"),
    "parent-to-outside": ("a/b", "a", "child working directory exceeds parent workspace"),
    "removed": ("sub", "", "invalid child working directory"),
}


@pytest.mark.parametrize("when", ["prepare", "before-admit"])
@pytest.mark.parametrize("swap", list(SWAPS))
async def test_a_directory_swapped_for_a_symlink_after_the_check_is_refused_at_admission(
    swap: str, when: str, db_url: str, workspace: Path
) -> None:
    cwd, swapped, refusal = SWAPS[swap]
    outside = workspace.parent / "outside"
    (outside / "b").mkdir(parents=True)
    (workspace / "a" / "b").mkdir(parents=True)
    checked = os.path.realpath(workspace / cwd)

    def do_swap() -> None:
        if swapped:
            replace_with_link(workspace / swapped, outside)
        else:
            shutil.rmtree(workspace / cwd)

    runner = SwappingRunner(do_swap, when)
    async with hosted(db_url, workspace, runner) as h:
        runner.engine = h.engine
        with pytest.raises(errors.AdmissionFailed) as caught:
            await h.start("q1", cwd=cwd)
        assert str(caught.value) == f"child admission failed: {refusal}"
        (record,) = await h.engine.list_children()
        assert (record.state, record.error, record.cwd) == ("done", refusal, checked)
        assert record.admitted_at is None
        assert await texts(h, record.conversation_id) == [], "the command never ran"
        with pytest.raises(errors.AdmissionFailed):
            await h.read(record.conversation_id)
    if when == "prepare":  # the swap came after the reservation committed the checked cwd
        assert (runner.reserved.state, runner.reserved.cwd) == ("prepared", checked)
    assert list(outside.rglob("marker")) == [], "nothing was done outside the workspace"
    assert list(workspace.rglob("marker")) == []


@pytest.mark.parametrize("cwd", ["", "sub"])
async def test_a_workspace_swapped_for_a_symlink_after_the_tool_opened_is_refused(
    cwd: str, db_url: str, workspace: Path
) -> None:
    """The tool stored its workspace's real path; a start resolves against that path,
    so a workspace that became a link leads outside it and is refused before prepare."""
    outside = workspace.parent / "outside"
    (outside / "sub").mkdir(parents=True)
    assert (workspace / "sub").is_dir()  # the fixture's
    runner = CommandRunner(profiles={"worker": script(MARK_AND_PRINT)})
    async with hosted(db_url, workspace, runner) as h:
        replace_with_link(workspace, outside)
        with pytest.raises(errors.CwdOutsideWorkspace):
            await h.start("q1", cwd=cwd)
        assert await h.engine.list_children() == [], "nothing was reserved"
    assert list(outside.rglob("marker")) == []


async def test_a_swap_while_the_host_was_down_is_refused_on_resume(
    db_url: str, workspace: Path, clock: ManualClock
) -> None:
    outside = workspace.parent / "outside"
    outside.mkdir()
    gate = asyncio.Event()

    async def hold(ctx: ChildContext) -> None:
        await ctx.admit()
        await gate.wait()

    first = ScriptRunner(script=hold)
    async with Engine(db_url, runner=first, clock=clock) as engine:
        h = await open_harness(engine, first, workspace)
        started = await h.start("q1", cwd="sub", lease_id="L1")
    replace_with_link(workspace / "sub", outside)  # while no host is running

    cwds: list[str] = []

    async def record_cwd(ctx: ChildContext) -> None:
        cwds.append(os.path.realpath(ctx.cwd))

    second = ScriptRunner(script=record_cwd)
    async with Engine(db_url, runner=second, clock=clock) as engine:
        h = Harness(engine, second, h.conn, h.tool, str(workspace))
        record = await h.wait_done(started.conversation_id)
    assert [p.recovery for p in second.prepared] == [Recovery(attempt=1, last_sequence=1)]
    assert (record.state, record.error) == (
        "done",
        "child working directory exceeds parent workspace",
    )
    assert (second.started, cwds) == (0, []), "the resumed run never started"


# --- the socket -----------------------------------------------------------------------


async def test_the_socket_is_0600_even_under_a_permissive_umask(
    db_url: str, tmp_path: Path, workspace: Path
) -> None:
    own = str(os.getuid())
    async with served("socket", db_url, tmp_path, "--allow-uid", own, umask=0) as client:
        info = (tmp_path / "host.sock").stat()
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_uid == os.getuid()
        await client.setup(workspace)  # the allowed uid is served


async def test_the_socket_is_born_0600_so_no_other_user_can_race_the_chmod(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "born.sock"
    born: list[int] = []
    chmod = os.chmod

    def observe_then_chmod(target: Any, mode: int, **kwargs: Any) -> None:
        born.append(stat.S_IMODE(os.stat(target).st_mode))  # the mode before the chmod
        chmod(target, mode, **kwargs)

    monkeypatch.setattr(os, "chmod", observe_then_chmod)  # a stdlib probe, not our code
    stop = asyncio.Event()
    previous = os.umask(0)
    try:
        server = asyncio.create_task(serve_socket(engine, str(path), stop, os.getuid()))
        while not born and not server.done():
            await asyncio.sleep(0.01)
    finally:
        os.umask(previous)
    stop.set()
    await asyncio.wait_for(server, 10)
    assert born == [0o600]


def knock(path: Path, frame: bytes) -> list[bytes]:
    """Connect as a peer, send ``frame`` at once, read until the host hangs up.

    A plain blocking socket: it reads what the host wrote before it closed, even when
    the host closed first (an asyncio transport drops that once its own write fails).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        for _ in range(400):
            try:
                sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.025)
        with contextlib.suppress(OSError):  # the host may have hung up already
            sock.sendall(frame)
        received = b""
        with contextlib.suppress(ConnectionResetError):  # what it sent was never read
            while chunk := sock.recv(CHUNK):
                received += chunk
    return received.splitlines()


async def test_a_peer_with_another_uid_is_refused_and_nothing_it_sends_is_served(
    db_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "host.sock"
    other = str(os.getuid() + 4242)
    proc = await host("--socket", str(path), "--db", db_url, "--allow-uid", other)
    try:
        register = {"runnerId": "r1", "hostInstanceId": "h1"}
        frame = {"jsonrpc": "2.0", "id": 1, "method": "runner.register", "params": register}
        lines = await asyncio.to_thread(knock, path, msgspec.json.encode(frame) + b"\n")
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 20)
    (refused,) = map(msgspec.json.decode, lines)  # one answer, then the host hung up
    assert refused["id"] is None
    assert refused["error"]["code"] == -32602
    assert refused["error"]["message"] == "peer is not allowed on this socket"
    assert refused["error"]["data"] == {"reason": "not_authorized"}
    assert count_rows(db_url, "runners") == 0, "its registration was never served"


# --- the 4 MiB frame limit ------------------------------------------------------------


def padded(method: str, params: Any, request_id: str, size: int) -> bytes:
    """A JSON-RPC request of exactly ``size`` bytes before its newline (JSON white space)."""
    body = msgspec.json.encode(
        {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    )
    assert len(body) < size
    return body + b" " * (size - len(body)) + b"\n"


@pytest.mark.parametrize("transport", ["stdio", "socket"])
async def test_a_frame_of_exactly_4_mib_is_served_and_one_byte_more_is_refused(
    transport: str, db_url: str, tmp_path: Path, workspace: Path
) -> None:
    register = {"runnerId": "r1", "hostInstanceId": "h1"}
    begin = tool_begin(options={})
    begin["workspace"] = str(workspace)
    async with served(transport, db_url, tmp_path) as client:
        await client.send_raw(padded("runner.register", register, "exact", FRAME_LIMIT))
        exact = await client.receive()
        assert exact["id"] == "exact"
        assert exact["result"]["generation"] == 1
        await client.send_raw(padded("tool.begin", begin, "over", FRAME_LIMIT + 1))
        over = await client.receive()
        assert over["id"] is None
        assert over["error"]["code"] == -32600
        assert over["error"]["message"] == "invalid request: message exceeds 4 MiB"
        # The stream goes on, and the refused frame had no effect: this tool call
        # would be "already open" had it been served.
        assert await client.ok("tool.begin", begin) == {}
        started = await client.ok("child.start", start_params("q1", "work in 1 steps"))
        assert started["parentRunId"] == "run-1"


# --- caps, exactly one past their default numbers --------------------------------------


async def test_64_children_per_grant_count_those_whose_prepare_failed(harness: Harness) -> None:
    assert harness.engine.config.max_children_per_grant == 64
    harness.runner.prepare_error = RuntimeError("prepare refused")
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(harness.start(f"q{i}") for i in range(65)), return_exceptions=True), 20
    )
    failed = [o for o in outcomes if isinstance(o, errors.AdmissionFailed)]
    refused = [o for o in outcomes if isinstance(o, errors.SubmissionLimit)]
    assert (len(failed), len(refused)) == (64, 1), "exactly one past the cap, though they raced"
    assert {str(o) for o in failed} == {"child admission failed: prepare refused"}
    assert str(refused[0]) == "child submission limit exceeded"
    assert (refused[0].reason, refused[0].rpc_code) == ("submission_limit", -32602)
    assert len(harness.runner.prepared) == 64
    children = await harness.engine.list_children(limit=1000)
    assert len(children) == 64 and {c.state for c in children} == {"done"}
    harness.runner.prepare_error = None
    with pytest.raises(errors.SubmissionLimit):
        await harness.start("q-after")
    # A replay of a failed start answers its own failure, not the cap.
    with pytest.raises(errors.AdmissionFailed, match="prepare refused"):
        await harness.start(children[0].request_id)
    assert len(harness.runner.prepared) == 64


@pytest.mark.parametrize("config", [EngineConfig(max_children_per_grant=3)], ids=["cap3"])
async def test_a_lease_grant_has_its_own_children_cap(harness: Harness) -> None:
    for i in range(3):
        started = await harness.start(f"q{i}", lease_id="L1")
        await harness.wait_done(started.conversation_id)
    with pytest.raises(errors.SubmissionLimit, match=r"^child submission limit exceeded$"):
        await harness.start("q3", lease_id="L1")
    assert len(harness.runner.prepared) == 3
    # The tool grant is another grant: its children are counted apart.
    await harness.start("q-tool")
    assert len(harness.runner.prepared) == 4


async def test_1024_live_leases_per_runner_and_tombstones_never_lock_it_out(
    harness: Harness,
) -> None:
    config = harness.engine.config
    assert (config.max_leases_per_runner, config.max_tombstones_per_extension) == (1024, 1024)
    live = await harness.start("q-live", lease_id="L-live")
    # design §9: releases of unknown leases need no grant; 2,000 of them used to fill the
    # lease capacity for a week. They are outside it, and only the newest 1024 are kept.
    tombstones = [release(harness, f"T{i}") for i in range(2000)]
    outcomes = await asyncio.wait_for(asyncio.gather(*tombstones), 60)
    assert all(r.done for r in outcomes)
    leases = await harness.engine.leases("runner-1")
    assert len(leases) == 1 + 1024
    assert {lease.lease_id for lease in leases if lease.revoked_at} == {
        f"T{i}" for i in range(976, 2000)
    }, "the oldest tombstones were dropped first"
    more = await harness.start("q-more", lease_id="L-new")  # a new lease still fits
    await harness.wait_done(more.conversation_id)
    await harness.wait_done(live.conversation_id)
    for i in range(1022):  # up to the cap of live leases: 1024 with L-live and L-new
        await harness.start(f"q{i}", lease_id=f"L{i}")
    with pytest.raises(errors.LeaseCapacity, match=r"^child lease capacity exceeded$") as caught:
        await harness.start("q-over", lease_id="L-over")
    assert (caught.value.reason, caught.value.rpc_code) == ("lease_capacity", -32602)
    prepared = len(harness.runner.prepared)
    # Releasing a live lease frees its place.
    assert (await release(harness, "L-live")).done
    await harness.start("q-over", lease_id="L-over")
    assert len(harness.runner.prepared) == prepared + 1


async def test_128_steer_receipts_per_child_whatever_their_outcome(harness: Harness) -> None:
    assert harness.engine.config.max_steers_per_child == 128
    first = await harness.start("q1")
    sibling = await harness.start("q2")
    await harness.wait_done(first.conversation_id)
    conv = first.conversation_id
    outcomes = await asyncio.wait_for(
        asyncio.gather(
            *(steer(harness, conv, f"s{i}", f"message {i}") for i in range(129)),
            return_exceptions=True,
        ),
        20,
    )
    stored = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, errors.SteerLimit)]
    assert (len(stored), len(refused)) == (128, 1), "exactly one past the cap, though they raced"
    assert {o.outcome for o in stored} == {"promptRequired"}  # a finished child: still counted
    assert str(refused[0]) == "child steer request limit exceeded"
    assert (refused[0].reason, refused[0].rpc_code) == ("steer_limit", -32602)
    # A stored receipt still answers at the cap; the cap is per child.
    assert (await steer(harness, conv, "s0", "message 0")).outcome == "promptRequired"
    await steer(harness, sibling.conversation_id, "s0", "message 0")


async def test_32_presets_per_extension(harness: Harness) -> None:
    assert harness.engine.config.max_presets_per_extension == 32
    presets = tuple(
        Preset(name=f"p{i}", extension_id=PRESET.extension_id, generation=PRESET.generation)
        for i in range(33)
    )
    full = await open_tool(harness, "call-32", presets=presets[:32])
    await harness.wait_done((await full.start("q1", profile="p31")).conversation_id)
    with pytest.raises(errors.PresetLimit) as caught:
        await open_tool(harness, "call-33", presets=presets)
    # design §3.8 quotes no message for this cap; this is the library's.
    assert str(caught.value) == "execution preset limit exceeded"
    assert (caught.value.reason, caught.value.rpc_code) == ("preset_limit", -32602)


async def test_nesting_depth_8_also_through_a_lease(harness: Harness) -> None:
    assert harness.engine.config.max_depth == 8
    level = harness
    for depth in range(1, 9):
        child = await level.start(f"q{depth}", lease_id=f"L{depth}")
        await harness.wait_done(child.conversation_id)
        record = await harness.engine.get_child(child.conversation_id)
        assert record is not None and (record.depth, record.lease_id) == (depth, f"L{depth}")
        level = await open_tool(
            harness, f"call-{depth + 1}", run_id=child.run_id, conversation_id=child.conversation_id
        )
    for lease_id in ("L9", ""):
        with pytest.raises(errors.NestingLimit) as caught:
            await level.start("q9", lease_id=lease_id)
        assert str(caught.value) == "child nesting limit exceeded"
        assert (caught.value.reason, caught.value.rpc_code) == ("nesting_limit", -32602)
    assert len(harness.runner.prepared) == 8
    leases = {lease.lease_id for lease in await harness.engine.leases("runner-1")}
    assert leases == {f"L{depth}" for depth in range(1, 9)}, "the refused start left no lease"
