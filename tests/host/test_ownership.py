"""One owner per database, and bounds on everything a peer controls (design §9).

Each test reproduces a finding of issue 12 against the real engine on a real file:
a second host on a live file, file modes, runners ending each other's runs, the
host's exact cancel, ids and event names of any size, and options that widen the
parent run's policy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from delegation import (
    ChildContext,
    Engine,
    EngineConfig,
    Event,
    ExecutionOptions,
    Preset,
    Request,
    effective_options,
    encode,
    errors,
)
from delegation.store.stores import upgrade
from delegation.usecases.inspector import Inspector
from tests.harness.fuzzing import snapshot
from tests.harness.support import PRESET, Harness, ScriptRunner, hold, open_harness

ROOT = Path(__file__).resolve().parents[2]
LOCK_HOST = Path(__file__).resolve().parents[1] / "harness" / "lock_host.py"


def files_of(db_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in db_path.parent.glob(f"{db_path.name}*")}


# --- one live host per file ---------------------------------------------------------


async def test_a_second_engine_on_a_live_file_is_refused_having_changed_nothing(
    engine: Engine, db_path: Path, runner: ScriptRunner, workspace: Path
) -> None:
    await open_harness(engine, runner, workspace)
    rows, files = snapshot(db_path), files_of(db_path)
    for url in (f"sqlite:///{db_path}", f"sqlite:///{db_path.parent}/./{db_path.name}"):
        second = Engine(url, runner=ScriptRunner())
        with pytest.raises(errors.HostConflict) as caught:
            await second.open()
        assert str(caught.value) == "database is in use by another live host"
        assert (caught.value.reason, caught.value.rpc_code) == ("host_conflict", -32603)
        assert not second.is_open
    assert snapshot(db_path) == rows, "no takeover, no migration, no row"
    assert files_of(db_path) == files
    assert (await engine.connect("runner-2", "host-b")).generation == 1  # the first goes on


async def test_a_link_to_a_live_file_is_the_same_file(engine: Engine, db_path: Path) -> None:
    link = db_path.with_name("alias.db")
    link.symlink_to(db_path)
    with pytest.raises(errors.HostConflict):
        await Engine(f"sqlite:///{link}", runner=ScriptRunner()).open()


async def test_the_file_is_free_again_once_its_host_closed(
    db_url: str, runner: ScriptRunner
) -> None:
    async with Engine(db_url, runner=runner):
        pass
    async with Engine(db_url, runner=runner) as again:
        assert again.is_open


async def test_inspection_works_beside_a_live_host_but_an_upgrade_is_refused(
    harness: Harness, db_url: str
) -> None:
    child = await harness.start("q1")
    with Inspector(db_url) as inspector:
        assert inspector.get_child(child.conversation_id) is not None
    current, _ = upgrade(db_url, apply=False)
    assert current is not None
    with pytest.raises(errors.HostConflict):
        upgrade(db_url, apply=True)


def test_two_host_processes_the_second_refused_until_the_first_is_killed(
    db_url: str, db_path: Path, workspace: Path
) -> None:
    first = subprocess.Popen(
        [sys.executable, str(LOCK_HOST), "first", db_url, str(workspace)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    second: subprocess.Popen[str] | None = None
    try:
        assert first.stdout is not None
        conversation = first.stdout.readline().split()[1]
        second = subprocess.Popen(
            [sys.executable, str(LOCK_HOST), "second", db_url],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert second.stdout is not None
        assert second.stdout.readline().strip() == (
            "REFUSED host_conflict database is in use by another live host"
        )
        with Inspector(db_url) as inspector:
            record = inspector.get_child(conversation)
            assert record is not None and record.state == "running"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # The resume starts inside open(): the two lines come in either order.
        lines = {second.stdout.readline().strip() for _ in range(2)}
        assert lines == {"OPENED", f"RESUMED {conversation} 1"}
        assert second.wait(30) == 0
    finally:
        for proc in (first, second):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                assert proc.stdout is not None
                proc.stdout.close()
    with Inspector(db_url) as inspector:
        record = inspector.get_child(conversation)
        assert record is not None
        assert (record.state, record.output) == ("done", "finished by the second host")
        events = inspector.events(conversation, limit=100_000)
    sequences = [e.sequence for e in events]
    assert sequences == list(range(1, len(sequences) + 1)), "no gap, no event written twice"
    assert [e.kind for e in events].count("recovery") == 1


# --- file modes and paths ----------------------------------------------------------


async def test_database_wal_and_shm_are_created_owner_only(
    tmp_path: Path, runner: ScriptRunner
) -> None:
    path = tmp_path / "fresh.db"
    previous = os.umask(0o022)
    try:
        async with Engine(f"sqlite:///{path}", runner=runner) as engine:
            await engine.connect("runner-1", "host-a")
            modes = {
                suffix: Path(f"{path}{suffix}").stat().st_mode & 0o777
                for suffix in ("", "-wal", "-shm")
            }
    finally:
        os.umask(previous)
    assert modes == {"": 0o600, "-wal": 0o600, "-shm": 0o600}


async def test_an_older_world_readable_database_is_made_owner_only(
    db_path: Path, db_url: str, runner: ScriptRunner
) -> None:
    db_path.chmod(0o644)
    async with Engine(db_url, runner=runner) as engine:
        await engine.connect("runner-1", "host-a")
        for suffix in ("", "-wal", "-shm"):
            assert Path(f"{db_path}{suffix}").stat().st_mode & 0o777 == 0o600


async def test_a_database_in_a_missing_directory_is_refused_and_nothing_created(
    tmp_path: Path, runner: ScriptRunner
) -> None:
    missing = tmp_path / "missing" / "dir"
    with pytest.raises(errors.StoreError, match="does not exist"):
        await Engine(f"sqlite:///{missing}/x.db", runner=runner).open()
    assert not (tmp_path / "missing").exists()


# --- run.finish and tool.end act on the caller's own runner -----------------------


async def test_finish_run_given_a_connection_touches_only_that_runner(
    engine: Engine, runner: ScriptRunner, workspace: Path
) -> None:
    runner.script = hold(asyncio.Event())
    mine = await open_harness(engine, runner, workspace)
    leased = await mine.start("q1", lease_id="L1")
    foreground = await mine.start("q2")
    other = await engine.connect("runner-2", "host-b")
    await engine.open_tool(
        other,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-9",
        extension_id="ext",
        presets=[PRESET],
        workspace=str(workspace),
    )
    # Runner 2 knows runner 1's runId and says that run failed.
    await engine.finish_run("parent-run", succeeded=False, conn=other)
    for child in (leased, foreground):
        record = await engine.get_child(child.conversation_id)
        assert record is not None
        assert (record.state, record.cancel_requested_at) == ("running", None)
    assert [lease.revoked_at for lease in await engine.leases("runner-1")] == [None]
    assert (await mine.start("q3")).conversation_id  # runner 1's tool is still open
    stale = other
    await engine.connect("runner-2", "host-b")  # supersedes ``other``
    with pytest.raises(errors.StaleConnection):
        await engine.finish_run("parent-run", succeeded=False, conn=stale)
    # Without a connection (the host itself), the failed run ends everything it had.
    await engine.finish_run("parent-run", succeeded=False)
    record = await mine.wait_done(leased.conversation_id)
    assert (record.state, record.error) == ("cancelled", "cancelled: parent run failed")


# --- the host's exact cancel --------------------------------------------------------


async def test_cancel_child_cancels_exactly_that_execution_whatever_its_grant(
    engine: Engine, runner: ScriptRunner, workspace: Path
) -> None:
    runner.script = hold(asyncio.Event())
    h = await open_harness(engine, runner, workspace)
    leased = await h.start("q1", lease_id="L1")
    sibling = await h.start("q2", lease_id="L1")
    await engine.close_tool(h.tool)  # the leased children outlive their tool
    result = await engine.cancel_child(leased.conversation_id)
    assert (result.done, result.cancelled, result.error) == (True, True, "cancelled by host")
    assert result.run_id == leased.run_id
    assert [e.text for e in result.events] == ["working"]
    record = await engine.get_child(sibling.conversation_id)
    assert record is not None and (record.state, record.cancel_requested_at) == ("running", None)
    again = await engine.cancel_child(leased.conversation_id, leased.run_id, reason="other")
    assert again == result, "a finished child is returned unchanged"
    custom = await engine.cancel_child(sibling.conversation_id, reason="stopped by the user")
    assert custom.error == "stopped by the user"
    with pytest.raises(errors.ChildNotFound):
        await engine.cancel_child(leased.conversation_id, run_id="r-unknown")
    with pytest.raises(errors.ChildNotFound):
        await engine.cancel_child("c-unknown")
    with pytest.raises(errors.InvalidId):
        await engine.cancel_child("c/../x")


async def test_cancel_child_before_admission_answers_the_cancelled_child(
    engine: Engine, runner: ScriptRunner, workspace: Path
) -> None:
    entered, gate = asyncio.Event(), asyncio.Event()

    async def blocked_before_admit(ctx: ChildContext) -> None:
        entered.set()
        await gate.wait()
        await ctx.admit()

    runner.script = blocked_before_admit
    h = await open_harness(engine, runner, workspace)
    start = asyncio.create_task(h.start("q1"))
    await entered.wait()
    (record,) = await engine.list_children()
    result = await engine.cancel_child(record.conversation_id)
    assert (result.done, result.cancelled, result.error) == (True, True, "cancelled by host")
    with pytest.raises(errors.AdmissionFailed):
        await start


@pytest.mark.parametrize("config", [EngineConfig(release_drain_s=0.2)], ids=["drain0.2"])
async def test_cancel_child_of_a_run_that_ignores_it_is_unconfirmed(harness: Harness) -> None:
    stop = asyncio.Event()

    async def stubborn(ctx: ChildContext) -> None:
        await ctx.admit()
        while not stop.is_set():
            try:
                await stop.wait()
            except asyncio.CancelledError:
                continue

    harness.runner.script = stubborn
    child = await harness.start("q1", lease_id="L1")
    with pytest.raises(errors.CancelUnconfirmed) as caught:
        await harness.engine.cancel_child(child.conversation_id)
    assert str(caught.value) == "child cancellation cleanup is unconfirmed"
    assert caught.value.reason == "cancel_unconfirmed"
    record = await harness.engine.get_child(child.conversation_id)
    assert record is not None and record.cancel_reason == "cancelled by host"
    stop.set()
    result = await harness.engine.cancel_child(child.conversation_id)
    assert (result.done, result.cancelled) == (True, True)


async def test_finishing_a_childs_own_run_unsuccessfully_cancels_that_child(
    engine: Engine, runner: ScriptRunner, workspace: Path
) -> None:
    runner.script = hold(asyncio.Event())
    h = await open_harness(engine, runner, workspace)
    first = await h.start("q1", lease_id="L1")
    second = await h.start("q2", lease_id="L1")
    await engine.finish_run(first.run_id, succeeded=True)
    record = await engine.get_child(first.conversation_id)
    assert record is not None and record.state == "running"
    await engine.finish_run(first.run_id, succeeded=False)
    record = await engine.get_child(first.conversation_id)
    assert record is not None
    assert (record.state, record.error) == ("cancelled", "cancelled: run failed")
    sibling = await engine.get_child(second.conversation_id)
    assert sibling is not None and sibling.state == "running"


# --- every id is a valid ID ---------------------------------------------------------

BAD_IDS = ["", "a/b", "a\\b", ".", "..", "a b", "x" * 129, "é" * 65, "nul\x00", "del\x7f"]


@pytest.mark.parametrize(
    "field",
    ["run_id", "tool_call_id", "extension_id", "child_id", "child_run_id", "lease_id"],
)
async def test_every_id_of_a_call_must_be_a_valid_id(
    harness: Harness, field: str, db_url: str
) -> None:
    child = await harness.start("q0")
    await harness.wait_done(child.conversation_id)
    rows = snapshot(db_url)
    for bad in [b for b in BAD_IDS if b]:
        changes: dict[str, Any] = {field: bad}
        if field == "lease_id":
            changes["request"] = Request(
                request_id="q1", profile="worker", message="m", lease_id=bad
            )
        else:
            changes["request"] = Request(request_id="q1", profile="worker", message="m")
        with pytest.raises((errors.InvalidId, errors.BadLeaseId)):
            await harness.engine.call(harness.conn, "child.start", harness.params(**changes))
        for method in ("child.read", "child.cancel", "child.lease.release"):
            params = harness.params(child_id=child.conversation_id, lease_id="L1")
            params = msgspec.structs.replace(params, **{field: bad})
            with pytest.raises(errors.DelegationError) as caught:
                await harness.engine.call(harness.conn, method, params)
            if field != "tool_call_id" or method != "child.lease.release":
                assert isinstance(caught.value, errors.InputError), (method, bad)
    assert snapshot(db_url) == rows
    assert len(harness.runner.prepared) == 1


async def test_a_request_id_must_be_a_valid_id(harness: Harness) -> None:
    for bad in ("q/1", "q 1", "q\x1b[2J"):
        with pytest.raises(errors.InvalidId, match="requestId must be a valid ID"):
            await harness.start(bad)
    await harness.start("  q-padded  ")  # surrounding blanks are trimmed, as before
    assert len(harness.runner.prepared) == 1


async def test_releasing_with_a_huge_extension_id_writes_nothing(
    harness: Harness, db_path: Path
) -> None:
    rows = snapshot(db_path)
    size = sum(len(b) for b in files_of(db_path).values())
    for i in range(10):
        params = harness.params(lease_id=f"T{i}", extension_id="e" * (3 << 20))
        with pytest.raises(errors.InvalidId):
            await harness.engine.call(harness.conn, "child.lease.release", params)
    assert snapshot(db_path) == rows
    assert sum(len(b) for b in files_of(db_path).values()) <= size + (1 << 20)


async def test_host_calls_refuse_invalid_ids(harness: Harness) -> None:
    engine = harness.engine
    with pytest.raises(errors.InputError):
        await engine.connect("r" * 3000, "host-a")
    with pytest.raises(errors.InputError):
        await engine.open_tool(
            harness.conn,
            run_id="run\n1",
            conversation_id="c",
            tool_call_id="t",
            extension_id="ext",
            presets=[PRESET],
            workspace=harness.workspace,
        )
    with pytest.raises(errors.InvalidId):
        await engine.finish_run("r/1", succeeded=False)


# --- event names are cut -------------------------------------------------------------


async def test_event_kind_tool_name_and_tool_call_id_are_cut_to_1_kib(harness: Harness) -> None:
    huge = "ü" * 1_000_000  # 2 MB of two-byte characters

    async def noisy(ctx: ChildContext) -> None:
        await ctx.admit()
        for _ in range(128):
            ctx.emit(
                Event(
                    kind=huge,
                    text=huge,
                    tool_name=huge,
                    tool_call_id=huge,
                    input=huge,
                    tool_output=huge,
                    error=huge,
                )
            )

    harness.runner.script = noisy
    child = await harness.start("q1")
    await harness.wait_done(child.conversation_id)
    page = await harness.read(child.conversation_id)
    assert 0 < len(page.events) < 128  # cut by bytes (design §18, tests/usecases/test_pages.py)
    first = page.events[0]
    assert [len(getattr(first, f).encode()) for f in ("kind", "tool_name", "tool_call_id")] == [
        1024
    ] * 3
    assert len(first.text.encode()) == 32 * 1024
    assert len(encode(page)) <= harness.engine.config.max_page_bytes


# --- the parent run's policy is a ceiling --------------------------------------------

POLICY = ExecutionOptions(allowed_tools=["read", "grep"], max_tokens=1000, no_skills=True)


async def test_options_may_only_narrow_the_policy_the_preset_and_the_request(
    engine: Engine, runner: ScriptRunner, workspace: Path, db_path: Path
) -> None:
    wide_preset = Preset(
        name="wide",
        extension_id="ext",
        generation=7,
        options=ExecutionOptions(allowed_tools=["read", "bash"]),
    )
    narrow_preset = Preset(
        name="worker", extension_id="ext", generation=7, options=ExecutionOptions(max_tokens=500)
    )
    h = await open_harness(engine, runner, workspace, [wide_preset, narrow_preset], POLICY)
    rows = snapshot(db_path)
    refusals: list[tuple[dict[str, Any], type[errors.OptionsWidened]]] = [
        ({"profile": "wide"}, errors.ToolsWidened),  # the preset widens the policy
        ({"options": ExecutionOptions(max_tokens=800)}, errors.TokenLimitRaised),  # > preset
        ({"options": ExecutionOptions(allowed_tools=["bash"])}, errors.ToolsWidened),  # > policy
        ({"options": ExecutionOptions(no_skills=False)}, errors.NoSkillsRelaxed),
    ]
    for changes, error in refusals:
        with pytest.raises(error):
            await h.start("q-wide", **changes)
    assert snapshot(db_path) == rows, "refused before anything was written"
    assert runner.prepared == []
    sent = ExecutionOptions(allowed_tools=["read"])
    child = await h.start("q1", options=sent, lease_id="L1")
    prepared = runner.prepared[-1].request
    assert prepared.options == ExecutionOptions(
        allowed_tools=["read"], max_tokens=500, no_skills=True
    )
    record = await engine.get_child(child.conversation_id)
    assert record is not None
    assert msgspec.json.decode(record.request, type=Request).options == sent, "stored as sent"


def test_effective_options_inherit_and_narrow() -> None:
    preset = Preset(name="p", extension_id="e", generation=1)
    request = Request(request_id="q", profile="p", message="m")
    assert effective_options(None, preset, request) == ExecutionOptions()
    assert effective_options(POLICY, preset, request) == POLICY
    narrowing = Request(
        request_id="q", profile="p", message="m", options=ExecutionOptions(allowed_tools=[])
    )
    assert effective_options(POLICY, preset, narrowing).allowed_tools == []
    with pytest.raises(errors.FsSearchEnabled):
        effective_options(
            ExecutionOptions(enable_fs_search_tools=False),
            Preset(
                name="p",
                extension_id="e",
                generation=1,
                options=ExecutionOptions(enable_fs_search_tools=True),
            ),
            request,
        )


async def test_a_resumed_child_runs_under_the_same_effective_options(
    db_url: str, workspace: Path
) -> None:
    first = ScriptRunner(hold(asyncio.Event()))
    async with Engine(db_url, runner=first) as engine:
        h = await open_harness(engine, first, workspace, policy=POLICY)
        await h.start("q1", lease_id="L1", options=ExecutionOptions(max_tokens=10))
    resumed = ScriptRunner(hold(asyncio.Event()))
    async with Engine(db_url, runner=resumed):
        await asyncio.sleep(0.05)
        (prepared,) = resumed.prepared
        assert prepared.recovery is not None
        assert prepared.request.options == msgspec.structs.replace(POLICY, max_tokens=10)


async def test_an_invalid_policy_is_refused_when_the_tool_opens(harness: Harness) -> None:
    with pytest.raises(errors.InvalidOptions):
        await harness.engine.open_tool(
            harness.conn,
            run_id="parent-run",
            conversation_id="parent-conv",
            tool_call_id="call-2",
            extension_id="ext",
            presets=[PRESET],
            workspace=harness.workspace,
            policy=ExecutionOptions(max_tokens=0),
        )
