"""Operators see a child's steps (design §15): ``delegation show`` lists the last ones and
``delegation steps CHILD [--json]`` all of them — name, place, size and time, never the
value — read through the :class:`Inspector`, bounded, on both stores."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from rich.cells import cell_len

from delegation import ChildContext, Event
from delegation.cli.show import RECENT_STEPS, byte_size
from delegation.usecases import inspector
from delegation.usecases.inspector import Inspector
from tests.harness.support import Harness, finish_after_admit
from tests.harness.terminal import Cli, in_process

SECRET = "the value itself, never shown"
LONG = "n" * 1024  # the longest name a step may have
NASTY = "\x1b[2J[red]x[/red]\u202e\n"
# name → the step's result (bytes are stored as they are, the rest as JSON)
VALUES: dict[str, Any] = {
    "fetch page": {"secret": SECRET},
    "raw bytes": b"\x00" * 2000,
    LONG: 7,
    NASTY: "x" * 1536,
}


def size_of(value: Any) -> int:
    return len(value) if isinstance(value, bytes) else len(msgspec.json.encode(value))


async def recording(ctx: ChildContext) -> None:
    await ctx.admit()
    for name, value in VALUES.items():
        ctx.emit(Event(kind="text", text=f"before {name[:10]}"))

        async def result(value: Any = value) -> Any:
            return value

        await ctx.step(name, result)
    ctx.emit(Event(kind="result", text="ok"))


def many(count: int) -> Any:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for n in range(1, count + 1):

            async def result(n: int = n) -> int:
                return n

            await ctx.step(f"s{n}", result)

    return run


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], db_url: str) -> Cli:
    return in_process(capsys, db_url)


@pytest.fixture
async def child(harness: Harness) -> str:
    """A done child that recorded the four steps of ``VALUES``."""
    harness.runner.script = recording
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    return str(started.conversation_id)


async def test_steps_json_lists_name_place_size_and_time_never_the_value(
    cli: Cli, child: str, harness: Harness
) -> None:
    code, out, err = cli("steps", child, "--json")
    assert (code, err) == (0, "")
    record = await harness.engine.get_child(child)
    assert record is not None
    document = json.loads(out)
    assert SECRET not in out
    assert set(document) == {"conversationId", "runId", "stepCount", "steps"}
    assert (document["conversationId"], document["runId"]) == (child, record.run_id)
    assert document["stepCount"] == len(VALUES)
    steps = document["steps"]
    assert [s["name"] for s in steps] == list(VALUES)  # exactly, the odd one too
    assert [s["ordinal"] for s in steps] == [1, 2, 3, 4]
    assert [s["size"] for s in steps] == [size_of(v) for v in VALUES.values()]
    assert all(set(s) == {"name", "ordinal", "size", "recordedAt"} for s in steps)
    assert all(s["recordedAt"] == harness.engine.clock.now() for s in steps)


async def test_steps_table_fits_the_terminal_and_escapes_names(
    cli: Cli, child: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = cli("steps", child)
    assert (code, err) == (0, "")
    assert SECRET not in out
    lines = out.splitlines()
    assert lines[0].split() == ["#", "name", "size", "recorded"]
    assert all(cell_len(line) <= 80 for line in lines), out
    body = [line for line in lines[2:] if line.strip()]
    assert [line.split()[0] for line in body] == ["1", "2", "3", "4"]
    assert "fetch page" in body[0] and f"{size_of(VALUES['fetch page'])} B" in body[0]
    assert "2.0 KiB" in body[1]
    assert "nnnn…" in body[2], "a long name is cut, with …"
    assert "\\x1b[2J[red]x[/red]\\u202e\\n" in body[3]  # escaped, and not read as markup
    assert "\x1b" not in out and "\u202e" not in out

    code, out, _ = cli("steps", child, "--wide")
    assert code == 0 and LONG in out, "--wide: every name whole"


async def test_show_lists_the_last_steps_and_how_many(
    cli: Cli, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.runner.script = many(RECENT_STEPS + 2)
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    child = started.conversation_id

    code, out, _ = cli("show", child, "--json")
    document = json.loads(out)
    assert code == 0
    assert document["stepCount"] == RECENT_STEPS + 2
    recent = document["recentSteps"]
    assert [s["name"] for s in recent] == [f"s{n}" for n in range(3, RECENT_STEPS + 3)]
    assert [s["ordinal"] for s in recent] == list(range(3, RECENT_STEPS + 3))
    assert all(s["size"] == len(str(s["ordinal"])) for s in recent)

    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = cli("show", child)
    assert code == 0
    assert ["steps", str(RECENT_STEPS + 2)] in [line.split() for line in out.splitlines()]
    names = [line.split()[1] for line in out.splitlines() if line.split()[:1] in (["3"], ["12"])]
    assert names == ["s3", f"s{RECENT_STEPS + 2}"]
    assert " s1 " not in out and " s2 " not in out
    assert f"2 earlier: delegation steps {child}" in out


async def test_show_of_a_child_with_steps_keeps_its_values_out(cli: Cli, child: str) -> None:
    code, out, _ = cli("show", child)
    assert code == 0 and "fetch page" in out and SECRET not in out
    code, out, _ = cli("show", child, "--json")
    document = json.loads(out)
    assert SECRET not in out
    assert [s["name"] for s in document["recentSteps"]] == list(VALUES)


async def test_a_child_without_steps_is_a_clear_empty_result(
    cli: Cli, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # piped: one line, as for grep
    harness.runner.script = finish_after_admit
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    child, run = started.conversation_id, started.run_id

    assert cli("steps", child) == (0, f"no steps recorded by child {child} run {run}\n", "")
    code, out, _ = cli("steps", child, "--json")
    assert code == 0
    assert json.loads(out) == {"conversationId": child, "runId": run, "stepCount": 0, "steps": []}
    code, out, _ = cli("show", child, "--json")
    assert (json.loads(out)["stepCount"], json.loads(out)["recentSteps"]) == (0, [])
    code, out, _ = cli("show", child)
    assert ["steps", "0"] in [line.split() for line in out.splitlines()]


async def test_an_unknown_child_is_the_error_every_command_gives(cli: Cli, child: str) -> None:
    for argv in (("steps", "c-missing"), ("steps", "c-missing", "--json")):
        assert cli(*argv) == (1, "", "delegation: no child c-missing\n")
    assert cli("steps", child, "--run", "r-nope") == (
        1,
        "",
        f"delegation: no child {child} run r-nope\n",
    )
    code, _, err = cli("steps", "c-a")
    assert code == 1
    assert err == "delegation: no child c-a (an id prefix needs at least 4 characters)\n"


async def test_steps_take_prefixes_and_choose_the_execution(cli: Cli, harness: Harness) -> None:
    """A follow-up is a new execution of the same conversation: ``--run`` picks one
    (its id or a prefix), the newest by default."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()

        async def said() -> str:
            return ctx.request.message

        await ctx.step(f"turn of {ctx.request.message}", said)

    harness.runner.script = run
    first = await harness.start("q1", message="first")
    await harness.wait_done(first.conversation_id)
    second = await harness.start("q2", message="second", resume=first.conversation_id)
    await harness.wait_done(first.conversation_id, child_run_id=second.run_id)

    def names(*argv: str) -> list[str]:
        code, out, err = cli("steps", *argv, "--json")
        assert (code, err) == (0, "")
        return [step["name"] for step in json.loads(out)["steps"]]

    conversation = first.conversation_id
    assert names(conversation) == ["turn of second"]
    assert names(conversation[:8]) == ["turn of second"]
    assert names(conversation, "--run", first.run_id) == ["turn of first"]
    assert names(conversation[:8] + "…", "--run", first.run_id[:8]) == ["turn of first"]


async def test_the_inspector_reads_steps_bounded(
    harness: Harness, db_url: str, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.runner.script = many(7)
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    child = started.conversation_id
    with Inspector(db_url) as reader:
        first = reader.steps(child, limit=3)
        assert [s.name for s in first.steps] == ["s1", "s2", "s3"]
        assert (first.count, first.more) == (7, 4)
        last = reader.steps(child, limit=3, latest=True)
        assert [s.name for s in last.steps] == ["s5", "s6", "s7"]
        assert [s.ordinal for s in last.steps] == [5, 6, 7]
        assert reader.steps(child, limit=0).steps == []
        assert reader.steps("c-missing").child is None
        # Never more than MAX_STEPS_LISTED, whatever is asked.
        monkeypatch.setattr(inspector, "MAX_STEPS_LISTED", 5)
        assert len(reader.steps(child, limit=10**9).steps) == 5
    code, out, _ = cli("steps", child)
    assert code == 0
    assert "2 more not listed" in out
    code, out, _ = cli("steps", child, "--json")
    document = json.loads(out)
    assert (document["stepCount"], len(document["steps"])) == (7, 5)


def test_sizes_read_as_people_read_them() -> None:
    assert [byte_size(n) for n in (0, 40, 1023, 1024, 1536, 1024**2, 3 * 1024**2 // 2)] == [
        "0 B", "40 B", "1023 B", "1.0 KiB", "1.5 KiB", "1.0 MiB", "1.5 MiB",
    ]  # fmt: skip
