"""Tables fit 80 columns (design §13), with ids as long as the wire allows (128 bytes),
names as long, and outputs of wide characters; ``--wide`` shows every column with
every id whole. Measured with ``$COLUMNS`` and on a real terminal 80 columns wide."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.cells import cell_len

from delegation import ChildContext, Event, Params, Preset, Request
from tests.harness.support import Harness, finish_after_admit
from tests.harness.terminal import Cli, in_process, in_terminal

RUNNER = "runner-" + "r" * 121
EXTENSION = "extension-" + "e" * 118
PROFILE = "profile-" + "p" * 120
PARENT_RUN = "parent-run-" + "q" * 117
PARENT_CONVERSATION = "parent-conversation-" + "c" * 108
LEASES = ("lease-" + "l" * 121 + "1", "lease-" + "l" * 121 + "2")  # alike but the last
WIDE_TEXT = "漢字かな交じり文 " * 40 + "[bold]not markup[/bold]"
TOKEN = "y" * 300  # one word longer than any line


STEP = ("漢字 " * 150)[:420]  # a step name of wide characters, 980 of its 1024 bytes


async def wordy(ctx: ChildContext) -> None:
    await ctx.admit()
    ctx.emit(Event(kind="tool", tool_name=PROFILE, input=WIDE_TEXT, tool_output=WIDE_TEXT))

    async def tool() -> str:
        return WIDE_TEXT

    await ctx.step(STEP, tool)
    ctx.emit(Event(kind="result", text=WIDE_TEXT))


@dataclass
class Crowd:
    conversations: list[str]
    runs: list[str]


@pytest.fixture
async def crowd(harness: Harness) -> Crowd:
    """Two children under long leases of a runner, extension, profile and parent run of
    128 characters each, and a short one of the usual harness; all done."""
    engine = harness.engine
    harness.runner.script = wordy
    conn = await engine.connect(RUNNER, "host-b")
    preset = Preset(name=PROFILE, extension_id=EXTENSION, generation=1)
    await engine.open_tool(
        conn, run_id=PARENT_RUN, conversation_id=PARENT_CONVERSATION, tool_call_id="call-1",
        extension_id=EXTENSION, presets=[preset], workspace=harness.workspace,
    )  # fmt: skip
    owner = {"run_id": PARENT_RUN, "tool_call_id": "call-1", "extension_id": EXTENSION}
    started = []
    for n, lease in enumerate(LEASES):
        message = f"{WIDE_TEXT} {TOKEN}"
        request = Request(request_id=f"q{n}", profile=PROFILE, message=message, lease_id=lease)
        params = Params(**owner, generation=1, lease_id=lease, request=request)
        started.append(await engine.start(conn, params))
    harness.runner.script = finish_after_admit
    started.append(await harness.start("short"))
    records = [await harness.wait_done(child.conversation_id) for child in started]
    return Crowd([r.conversation_id for r in records], [r.run_id for r in records])


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], db_url: str) -> Cli:
    return in_process(capsys, db_url)


def commands(crowd: Crowd) -> list[list[str]]:
    child = crowd.conversations[0]
    return [["children"], ["leases"], ["show", child], ["steps", child], ["events", child]]


def too_wide(text: str, width: int = 80) -> list[str]:
    return [line for line in text.splitlines() if cell_len(line) > width]


@pytest.mark.parametrize("columns", [None, "80"])
async def test_every_table_fits_80_columns(
    crowd: Crowd, cli: Cli, columns: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``COLUMNS=80``, and piped without it (tables keep to 80 then too)."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    for argv in commands(crowd)[: 4 if columns is None else 5]:  # piped, events are lines
        code, out, err = cli(*argv)
        assert (code, err) == (0, ""), argv
        assert out.count("\n") >= 2, argv
        assert too_wide(out) == [], argv
        if argv[0] == "show":
            assert out.count("y") > len(TOKEN), "a long word is folded, not cut"


@pytest.mark.sqlite_only  # one store is enough for the terminal itself
async def test_every_table_fits_a_terminal_80_columns_wide(crowd: Crowd, db_path: Path) -> None:
    for argv in commands(crowd):
        ran = in_terminal(["-m", "delegation.cli", *argv, "--db", str(db_path)])
        assert (ran.code, ran.other) == (0, ""), argv
        assert b"\x1b[" in ran.raw, "a terminal: rich wrote its styles"
        assert ran.terminal.count("\n") >= 2, argv
        assert too_wide(ran.terminal) == [], argv
    ran = in_terminal(["-m", "delegation.cli", "children", "--db", str(db_path)], columns=120)
    assert max(cell_len(line) for line in ran.terminal.splitlines()) > 80, "a wider terminal"


async def test_ids_are_shortened_to_prefixes_that_find_them(crowd: Crowd, cli: Cli) -> None:
    _, out, _ = cli("children")
    rows = out.splitlines()[2:]
    assert len(rows) == 3
    newest_first = zip(reversed(crowd.conversations), reversed(crowd.runs), strict=True)
    for row, (conversation, run) in zip(rows, newest_first, strict=True):
        short_conversation, short_run = row.split()[:2]
        assert short_conversation.endswith("…") and short_run.endswith("…")
        assert len(short_conversation) == len(short_run) == 11
        code, shown, err = cli("show", short_conversation, "--run", short_run)
        assert (code, err) == (0, ""), err
        assert conversation in shown and run in shown
    _, out, _ = cli("leases")
    assert not any(lease in out for lease in LEASES)
    assert "runner-rrr" in out and RUNNER not in out


async def test_wide_shows_every_column_and_every_id_whole(crowd: Crowd, cli: Cli) -> None:
    code, out, err = cli("children", "--wide")
    assert (code, err) == (0, "")
    headings = re.split(r"\s{2,}", out.splitlines()[0].strip())
    assert headings == [
        "conversation", "run", "state", "profile", "runner", "extension", "lease",
        "parent conversation", "parent run", "created", "finished", "age", "error / output",
    ]  # fmt: skip
    for text in (*crowd.conversations, *crowd.runs, *LEASES, RUNNER, EXTENSION, PROFILE):
        assert text in out, text
    assert PARENT_RUN in out and PARENT_CONVERSATION in out
    assert len(out.splitlines()) == 2 + 3, "one line a row, however long"
    code, out, _ = cli("leases", "--wide")
    headings = re.split(r"\s{2,}", out.splitlines()[0].strip())
    assert headings == [
        "lease", "runner", "extension", "parent run", "parent conversation", "children",
        "created", "status",
    ]  # fmt: skip
    for text in (*LEASES, RUNNER, EXTENSION, PARENT_RUN, PARENT_CONVERSATION):
        assert text in out, text


async def test_ids_that_begin_alike_are_shown_until_they_differ(harness: Harness, cli: Cli) -> None:
    harness.runner.script = finish_after_admit
    alike = ("lease-of-the-nightly-job-1", "lease-of-the-nightly-job-2", "lease-other-job")
    for n, lease in enumerate(alike):
        await harness.wait_done((await harness.start(f"q{n}", lease_id=lease)).conversation_id)
    _, out, _ = cli("leases")
    shown = {row.split()[0] for row in out.splitlines()[2:]}
    assert shown == {"lease-of-the-nightly-job-1", "lease-of-the-nightly-job-2", "lease-othe…"}
