"""Text children wrote never drives the terminal it is printed on (design §9).

A child fills every printed field (event kind, text, tool name, ids, input, output,
error, its request and its result) with terminal escapes, C1 controls, a bidi
override and rich markup; every human view prints them escaped and literal, and
``--json`` still carries them exactly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from delegation import ChildContext, Event
from delegation.cli.commands import main
from delegation.cli.show import printable
from tests.harness.support import Harness

NASTY = (
    "\x1b[2J"  # clear the screen
    "\x1b]8;;http://x\x07link\x1b]8;;\x07"  # an OSC 8 hyperlink
    "\x9b31m"  # C1 CSI: red, without an ESC
    "\x7f\x00\u202e"
    "[red]x[/red] [link=http://x]y[/link]"  # rich markup
    "\r\n\t end"
)
# Anything that reaches a terminal raw and is not a plain line break.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


async def nasty_failure(ctx: ChildContext) -> None:
    await ctx.admit()
    ctx.emit(
        Event(
            kind="tool" + NASTY, text=NASTY, tool_name=NASTY, tool_call_id=NASTY,
            input=NASTY, tool_output=NASTY, error=NASTY, success=False,
        )
    )  # fmt: skip

    async def tool() -> str:
        return NASTY

    await ctx.step(NASTY, tool)
    raise RuntimeError(NASTY)


async def nasty_result(ctx: ChildContext) -> None:
    await ctx.admit()
    ctx.emit(Event(kind="result", text=NASTY))


@pytest.fixture
async def children(harness: Harness) -> tuple[str, str]:
    harness.runner.script = nasty_failure
    failed = (await harness.start("q1", message=NASTY)).conversation_id
    await harness.wait_done(failed)
    harness.runner.script = nasty_result
    done = (await harness.start("q2", message="fine")).conversation_id
    await harness.wait_done(done)
    return failed, done


def run(capsys: pytest.CaptureFixture[str], db: Path, *argv: str) -> str:
    code = main([*argv, "--db", str(db)])
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), err
    return out


def test_printable_escapes_controls_and_keeps_text() -> None:
    assert printable("plain [red]text[/red] é 中") == "plain [red]text[/red] é 中"
    assert printable("a\nb\tc\r") == "a\\nb\\tc\\r"
    assert printable("\x1b[2J\x07\x9b\x7f\x00") == "\\x1b[2J\\x07\\x9b\\x7f\\x00"
    assert printable("\u202eevil\u2028") == "\\u202eevil\\u2028"


async def test_every_human_view_prints_child_text_escaped_and_literal(
    children: tuple[str, str], db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failed, done = children
    views = {
        "children": run(capsys, db_path, "children"),
        "children wide": run(capsys, db_path, "children", "--wide"),
        "show failed": run(capsys, db_path, "show", failed),
        "show done": run(capsys, db_path, "show", done),
        "events failed": run(capsys, db_path, "events", failed),
        "events done": run(capsys, db_path, "events", done),
        "steps failed": run(capsys, db_path, "steps", failed),
        "steps failed wide": run(capsys, db_path, "steps", failed, "--wide"),
        "leases": run(capsys, db_path, "leases"),
        "leases wide": run(capsys, db_path, "leases", "--wide"),
    }
    for name, out in views.items():
        assert not RAW.search(out), (name, RAW.findall(out))
    for name in ("children", "steps failed"):
        assert "\\x1b[2J" in views[name], "cut to fit 80 columns, after escaping"
    for name in (
        *("children wide", "show failed", "show done", "events failed", "events done"),
        "steps failed wide",
    ):
        assert "[red]x[/red]" in views[name], name  # markup printed, not applied
        assert "\\x1b[2J" in views[name], name
    assert "\\x1b]8;;http://x\\x07link" in views["events failed"]
    assert "\\x9b31m" in views["show done"]  # the output field
    assert "\\u202e" in views["show failed"]  # the error and the request's message


async def test_json_output_carries_child_text_exactly(
    children: tuple[str, str], db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failed, done = children
    event = json.loads(run(capsys, db_path, "events", failed, "--json").splitlines()[0])
    assert event["text"] == event["toolName"] == event["error"] == NASTY
    record = json.loads(run(capsys, db_path, "show", failed, "--json"))
    assert record["error"] == NASTY
    assert [step["name"] for step in record["recentSteps"]] == [NASTY]
    steps = json.loads(run(capsys, db_path, "steps", failed, "--json"))["steps"]
    assert [step["name"] for step in steps] == [NASTY]
    assert record["request"]["message"] == NASTY
    listed = json.loads(run(capsys, db_path, "children", "--json"))
    assert {c["conversationId"]: c["output"] for c in listed}[done] == NASTY
