"""A follow-up continues its task frozen as first given (design §14): the Go original's
resume rules, found by porting kodelet's own policy and resume tests to this engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from delegation import Engine, ExecutionOptions, Preset, errors
from delegation.options import effective_options
from tests.harness import rows as db
from tests.harness.support import PRESET, Harness, open_harness

WIDE = msgspec.structs.replace(
    PRESET,
    system_prompt="you are the first worker",
    options=ExecutionOptions(allowed_tools=["grep", "bash"], model="m-1", provider="anthropic"),
)


@pytest.fixture
async def wide(engine: Engine, runner: Any, workspace: Path) -> Harness:
    """The usual harness, its preset with a system prompt and wider options."""
    return await open_harness(engine, runner, workspace, presets=[WIDE])


async def call_again(h: Harness, tool_call_id: str, presets: list[Preset]) -> Harness:
    """A later tool call of the same parent run: its own grant and presets."""
    tool = await h.engine.open_tool(
        h.conn,
        run_id=h.tool.run_id,
        conversation_id="parent-conv",
        tool_call_id=tool_call_id,
        extension_id=PRESET.extension_id,
        presets=presets,
        workspace=h.workspace,
    )
    return Harness(h.engine, h.runner, h.conn, tool, h.workspace)


async def first_then_follow_up(h: Harness, first: dict[str, Any], then: dict[str, Any]) -> Any:
    started = await h.start("q1", **first)
    await h.wait_done(started.conversation_id)
    return started, await h.start("q2", resume=started.conversation_id, **then)


def stored(db_url: str, conversation_id: str) -> list[tuple[Any, ...]]:
    sql = (
        "SELECT run_id, request, preset, options, cwd FROM children"
        " WHERE conversation_id = :c ORDER BY id"
    )
    return [tuple(row) for row in db.rows(db_url, sql, {"c": conversation_id})]


async def test_a_follow_up_without_options_keeps_the_first_executions_narrowed_tools(
    wide: Harness,
) -> None:
    await first_then_follow_up(wide, {"options": ExecutionOptions(allowed_tools=["grep"])}, {})
    first, follow_up = wide.runner.prepared
    assert first.request.options.allowed_tools == ["grep"]
    # The preset's bash does not come back: the snapshot is the first start's options.
    assert follow_up.request.options.allowed_tools == ["grep"]
    assert follow_up.request.options.model == "m-1"


async def test_a_preset_registered_again_does_not_reach_a_follow_up(
    wide: Harness, db_url: str
) -> None:
    started = await wide.start("q1")
    await wide.wait_done(started.conversation_id)
    renewed = msgspec.structs.replace(
        WIDE,
        system_prompt="you are someone else now",
        options=ExecutionOptions(
            allowed_tools=["grep", "bash", "edit"], model="m-1", provider="anthropic"
        ),
    )
    later = await call_again(wide, "call-2", [renewed])
    before = stored(db_url, started.conversation_id)
    follow_up = await later.start("q2", resume=started.conversation_id)
    await later.wait_done(started.conversation_id, child_run_id=follow_up.run_id)
    prepared = wide.runner.prepared[-1]
    assert prepared.preset.system_prompt == "you are the first worker"
    assert prepared.request.system_prompt == "you are the first worker"
    assert prepared.request.options.allowed_tools == ["grep", "bash"]
    # The earlier execution's record is as it was; the follow-up stores the snapshot.
    after = stored(db_url, started.conversation_id)
    assert after[0] == before[0]
    assert msgspec.json.decode(after[1][2], type=Preset).system_prompt == "you are the first worker"


@pytest.mark.parametrize(
    ("options", "error"),
    [
        (ExecutionOptions(allowed_tools=["grep", "bash"]), errors.ToolsWidened),
        (ExecutionOptions(no_tools=False), None),
        (ExecutionOptions(allowed_tools=[]), None),
    ],
)
async def test_a_follow_up_may_narrow_the_snapshot_and_never_widen_it(
    wide: Harness, options: ExecutionOptions, error: type[errors.DelegationError] | None
) -> None:
    started = await wide.start("q1", options=ExecutionOptions(allowed_tools=["grep"]))
    await wide.wait_done(started.conversation_id)
    if error is not None:
        with pytest.raises(error):
            await wide.start("q2", resume=started.conversation_id, options=options)
        assert len(wide.runner.prepared) == 1
        return
    await wide.start("q2", resume=started.conversation_id, options=options)
    prepared = wide.runner.prepared[-1].request.options
    assert prepared.allowed_tools == (
        options.allowed_tools if options.allowed_tools is not msgspec.UNSET else ["grep"]
    )


async def test_a_follow_up_with_no_tools_keeps_no_tools(wide: Harness) -> None:
    started = await wide.start("q1", options=ExecutionOptions(no_tools=True))
    await wide.wait_done(started.conversation_id)
    with pytest.raises(errors.NoToolsRelaxed):
        await wide.start(
            "q2", resume=started.conversation_id, options=ExecutionOptions(no_tools=False)
        )
    await wide.start("q3", resume=started.conversation_id)
    assert wide.runner.prepared[-1].request.options.tools_disabled()


@pytest.mark.parametrize(
    "changed",
    [
        {"options": ExecutionOptions(provider="openai")},
        {"options": ExecutionOptions(model="m-2")},
        {"options": ExecutionOptions(reasoning_effort="high")},
        {"options": ExecutionOptions(use_weak_model=True)},
        {"system_prompt": "a different prompt"},
        {"cwd": "sub"},
    ],
)
async def test_a_follow_up_may_not_change_what_fixes_its_task(
    wide: Harness, changed: dict[str, Any]
) -> None:
    started = await wide.start("q1")
    await wide.wait_done(started.conversation_id)
    with pytest.raises(errors.ResumeMismatch) as refused:
        await wide.start("q2", resume=started.conversation_id, **changed)
    assert str(refused.value) == (
        "the child task cannot resume with a different parent, host or execution preset"
    )
    assert len(wide.runner.prepared) == 1


@pytest.mark.parametrize(
    "same",
    [
        {"options": ExecutionOptions(provider="anthropic", model="m-1")},
        {"system_prompt": "you are the first worker"},
        {"cwd": "."},
    ],
)
async def test_a_follow_up_may_repeat_what_fixes_its_task(
    wide: Harness, same: dict[str, Any]
) -> None:
    started = await wide.start("q1")
    await wide.wait_done(started.conversation_id)
    follow_up = await wide.start("q2", resume=started.conversation_id, **same)
    assert follow_up.conversation_id == started.conversation_id
    assert len(wide.runner.prepared) == 2


async def test_the_saved_cwd_stands_when_a_follow_up_gives_none(
    wide: Harness, workspace: Path
) -> None:
    started = await wide.start("q1", cwd="sub")
    await wide.wait_done(started.conversation_id)
    await wide.start("q2", resume=started.conversation_id)
    record = await wide.engine.get_child(started.conversation_id)
    assert record is not None and record.cwd == str((workspace / "sub").resolve())
    with pytest.raises(errors.ResumeMismatch):
        await wide.start("q3", resume=started.conversation_id, cwd=".")


async def test_a_runner_back_with_another_host_instance_cannot_follow_up(
    wide: Harness,
) -> None:
    started = await wide.start("q1")
    await wide.wait_done(started.conversation_id)
    conn = await wide.engine.connect(wide.conn.runner_id, "host-b")
    tool = await wide.engine.open_tool(
        conn,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-b",
        extension_id=PRESET.extension_id,
        presets=[WIDE],
        workspace=wide.workspace,
    )
    other = Harness(wide.engine, wide.runner, conn, tool, wide.workspace)
    with pytest.raises(errors.ResumeMismatch):
        await other.start("q2", resume=started.conversation_id)
    # The same host instance, connected again, still may.
    back = await wide.engine.connect(wide.conn.runner_id, "host-a")
    tool = await wide.engine.open_tool(
        back,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-c",
        extension_id=PRESET.extension_id,
        presets=[WIDE],
        workspace=wide.workspace,
    )
    again = Harness(wide.engine, wide.runner, back, tool, wide.workspace)
    follow_up = await again.start("q3", resume=started.conversation_id)
    assert follow_up.conversation_id == started.conversation_id


async def test_the_parent_policy_of_the_new_call_narrows_the_snapshot_too(
    wide: Harness,
) -> None:
    started = await wide.start("q1")
    await wide.wait_done(started.conversation_id)
    tool = await wide.engine.open_tool(
        wide.conn,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-p",
        extension_id=PRESET.extension_id,
        presets=[WIDE],
        workspace=wide.workspace,
        policy=ExecutionOptions(allowed_tools=["grep"]),
    )
    narrow = Harness(wide.engine, wide.runner, wide.conn, tool, wide.workspace)
    # The snapshot (grep, bash) is wider than the new parent's policy: refused as a
    # fresh start of that preset would be.
    with pytest.raises(errors.ToolsWidened):
        await narrow.start("q2", resume=started.conversation_id)
    await narrow.start(
        "q3", resume=started.conversation_id, options=ExecutionOptions(allowed_tools=["grep"])
    )
    assert wide.runner.prepared[-1].request.options.allowed_tools == ["grep"]


def test_effective_options_of_a_preset_without_options_inherit_the_policy() -> None:
    policy = ExecutionOptions(allowed_tools=["grep"])
    assert effective_options(policy, PRESET, PRESET).allowed_tools == ["grep"]
