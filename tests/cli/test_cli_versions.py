"""What an operator sees of versions and patches (design §34): ``delegation children
--patch NAME`` (the live executions and the value each recorded), ``children --pinned``,
and ``show``/``show --json``: the version that prepared a child, its newest attempt's,
the version it is pinned to, each step's version, and drift (the recorded steps the
newest attempt never asked for). An unversioned child shows what it always showed."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from delegation import ChildContext, EngineConfig, Event
from delegation.clock import ManualClock
from tests.harness.restarts import LEASE, restarted, route, until_event
from tests.harness.support import Harness, ScriptRunner
from tests.harness.terminal import Cli, in_process

VERSION_KEYS = {"version", "attemptVersion", "pinnedVersion", "unpinnedAt", "drift"}


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], db_url: str) -> Cli:
    return in_process(capsys, db_url)


@pytest.fixture
def config() -> EngineConfig:
    return EngineConfig(release_drain_s=1.0, runner_version="v1")


def write(url: str, sql: str, params: dict[str, object]) -> None:
    """A write from outside the engine (what the versions core will do: a pin)."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(text(sql), params)
    finally:
        engine.dispose()


async def hold(ctx: ChildContext, said: str) -> None:
    ctx.emit(Event(kind="text", text=said))
    await asyncio.Event().wait()


async def test_children_patch_lists_live_executions_with_their_recorded_value(
    harness: Harness, cli: Cli, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    async def ahead(ctx: ChildContext) -> None:  # went past the patch on old code
        await ctx.admit()
        if ctx.recovery is None:
            await ctx.step("a", lambda: 1)
            await hold(ctx, "old")
        patched = await ctx.patched("p")
        await ctx.step("a", lambda: 1)
        await hold(ctx, f"new {patched}")

    async def asks(ctx: ChildContext) -> None:
        await ctx.admit()
        await hold(ctx, f"new {await ctx.patched('p')}")

    async def never(ctx: ChildContext) -> None:
        await ctx.admit()
        await hold(ctx, "never")

    async def ended(ctx: ChildContext) -> None:
        await ctx.admit()
        await ctx.patched("p")
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = route(ahead=ahead, asks=asks, never=never, ended=ended)
    gone = await harness.start("q0", message="ended")
    await harness.wait_done(gone.conversation_id)
    started = {}
    for n, which in enumerate(("ahead", "asks", "never"), 1):
        started[which] = await harness.start(f"q{n}", message=which, lease_id=LEASE)
    await until_event(harness.engine, started["ahead"].conversation_id, "old")
    await harness.engine.close()
    fresh = ScriptRunner(script=harness.runner.script)
    async with restarted(harness, db_url, fresh, config, clock) as h:
        await until_event(h.engine, started["ahead"].conversation_id, "new False")
        await until_event(h.engine, started["asks"].conversation_id, "new True")
        await until_event(h.engine, started["never"].conversation_id, "never")
        code, out, err = cli("children", "--patch", "p", "--json")
        assert (code, err) == (0, "")
        listed = {row["conversationId"]: row["patch"] for row in json.loads(out)}
        assert listed == {
            started["ahead"].conversation_id: False,
            started["asks"].conversation_id: True,
            started["never"].conversation_id: None,
        }  # the ended child is not live
        code, out, err = cli("children", "--patch", "p", "--wide")
        assert code == 0 and "patch p" in out
        lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("c-")}
        assert " false " in lines[started["ahead"].conversation_id]
        assert " true " in lines[started["asks"].conversation_id]
        assert " not asked " in lines[started["never"].conversation_id]
        code, _, err = cli("children", "--patch", "p", "--state", "running")
        assert code == 2 and "take no --state" in err
        code, _, err = cli("children", "--patch", "")
        assert code == 2 and "ctx.patched" in err


async def test_children_pinned_lists_only_pinned_children_and_their_version(
    harness: Harness, cli: Cli, db_url: str
) -> None:
    first = await harness.start("q1")
    second = await harness.start("q2")
    for started in (first, second):
        await harness.wait_done(started.conversation_id)
    await harness.engine.close()
    write(
        db_url,
        # As a pin leaves it: waiting (a pinned child that ended is no longer listed).
        "UPDATE children SET pinned_version = 'v0.9', state = 'waiting', finished_at = NULL"
        " WHERE conversation_id = :c",
        {"c": second.conversation_id},
    )
    code, out, err = cli("children", "--pinned", "--json")
    assert (code, err) == (0, "")
    (only,) = json.loads(out)
    assert (only["conversationId"], only["pinnedVersion"]) == (second.conversation_id, "v0.9")
    code, out, _ = cli("children", "--pinned", "--wide")
    assert code == 0 and "pinned" in out and "v0.9" in out
    assert second.conversation_id in out and first.conversation_id not in out
    code, out, _ = cli("show", second.conversation_id)
    assert "pinnedVersion" in out and "v0.9" in out


async def test_show_prints_versions_step_versions_and_drift(
    harness: Harness, cli: Cli, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        if ctx.recovery is None:  # old code: a, b, then the host closes
            for name in ("a", "b"):
                await ctx.step(name, lambda name=name: name)
            await hold(ctx, "old")
        await ctx.step("a", lambda: "a")  # new code: b is gone
        await ctx.step("c", lambda: "c")
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start(lease_id=LEASE)
    child = started.conversation_id
    await until_event(harness.engine, child, "old")
    code, out, _ = cli("show", child, "--json")
    shown = json.loads(out)
    assert "drift" not in shown  # its newest attempt runs
    assert (shown["version"], shown["attemptVersion"]) == ("v1", "v1")
    code, out, _ = cli("show", child)
    assert "its newest attempt runs" in out
    await harness.engine.close()
    newer = dataclasses.replace(config, runner_version="v2")
    fresh = ScriptRunner(script=run)
    async with restarted(harness, db_url, fresh, newer, clock) as h:
        await h.wait_done(child)
    code, out, err = cli("show", child, "--json")
    assert (code, err) == (0, "")
    shown = json.loads(out)
    assert (shown["version"], shown["attemptVersion"]) == ("v1", "v2")
    assert "pinnedVersion" not in shown
    assert shown["drift"] == ["b"]
    steps = {step["name"]: step.get("version") for step in shown["recentSteps"]}
    assert steps == {"a": "v1", "b": "v1", "c": "v2"}
    code, out, _ = cli("show", child)
    assert code == 0
    assert any(line.split()[:2] == ["drift", "b"] for line in out.splitlines())
    assert any(line.split()[1:2] == ["c"] and line.rstrip().endswith("v2") for line in
               out.splitlines())  # fmt: skip
    code, out, _ = cli("steps", child, "--json")
    assert [step["version"] for step in json.loads(out)["steps"]] == ["v1", "v1", "v2"]


@pytest.mark.parametrize("config", [EngineConfig(release_drain_s=1.0)])  # unversioned
async def test_an_unversioned_child_shows_what_it_always_showed(
    harness: Harness, cli: Cli, db_url: str
) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await ctx.step("a", lambda: 1)
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    await harness.wait_done(started.conversation_id)
    _, out, _ = cli("show", started.conversation_id, "--json")
    shown = json.loads(out)
    assert not VERSION_KEYS & shown.keys()
    assert "version" not in shown["recentSteps"][0]
    _, out, _ = cli("children", "--json")
    assert not VERSION_KEYS & json.loads(out)[0].keys()
    _, out, _ = cli("show", started.conversation_id)
    fields = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert not VERSION_KEYS & fields
