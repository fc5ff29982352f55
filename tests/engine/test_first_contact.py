"""What a new user met first (issue 37): a plain path refused, a plain function refused
by ``ctx.step``, a host that never said where it listens, a refusal that did not say what
was missing, leased children cancelled without a word, ``--allow-uid -5`` accepted."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from delegation import ChildContext, Engine, Event, errors, rpc
from tests.harness import rows
from tests.harness.support import PRESET, Harness, ScriptRunner

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("where", ["relative", "absolute"])
async def test_a_plain_path_opens_the_file_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """It was refused with a message that said a path would do."""
    monkeypatch.chdir(tmp_path)
    path = "plain.db" if where == "relative" else str(tmp_path / "plain.db")
    async with Engine(path, runner=ScriptRunner()) as engine:
        await engine.connect("runner-1", "host-a")
    assert rows.scalar(f"sqlite:///{tmp_path / 'plain.db'}", "SELECT COUNT(*) FROM runners") == 1


async def test_a_plain_path_in_a_missing_folder_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(errors.DelegationError) as caught:
        await Engine(str(tmp_path / "nowhere" / "x.db"), runner=ScriptRunner()).open()
    assert "nowhere" in str(caught.value)
    assert not (tmp_path / "nowhere").exists()


def _plain_step(ctx: ChildContext, calls: list[str]) -> dict[str, int]:
    calls.append(ctx.identity.run_id)
    return {"answer": 42}


async def test_a_step_takes_a_plain_function(harness: Harness) -> None:
    """`ctx.step(name, plain_fn)` failed with "object dict can't be used in 'await'"."""
    calls: list[str] = []
    got: list[object] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        got.append(await ctx.step("plain", _plain_step, ctx, calls))
        got.append(await ctx.step("plain", _plain_step, ctx, calls))  # recorded: not again
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    record = await harness.wait_done(started.conversation_id)
    assert record.error == "" and got == [{"answer": 42}, {"answer": 42}]
    assert len(calls) == 1


async def test_a_refusal_says_what_is_missing(harness: Harness) -> None:
    """A start under no open tool call, or at another generation, got "not owned" only."""
    with pytest.raises(errors.NotOwned) as caught:
        await harness.engine.call(harness.conn, "child.start", harness.start_params(run_id="x"))
    assert str(caught.value) == str(errors.NotOwned())  # the contract's message, unchanged
    assert "no tool call 'x'/'call-1' is open on this connection" in caught.value.detail
    with pytest.raises(errors.NotOwned) as caught:
        await harness.engine.call(harness.conn, "child.start", harness.start_params(generation=8))
    assert caught.value.detail == (
        f"generation 8 is not one of the tool call's presets' ({PRESET.generation} expected)"
    )


async def test_the_wire_keeps_its_refusal_as_the_contract_says(harness: Harness) -> None:
    """The detail is the host's (a note on its traceback, a field of its error); the wire's
    ``data`` stays ``{"reason": ...}`` (design §2.3)."""
    raw = json.dumps(
        {"runId": "x", "toolCallId": "call-1", "extensionId": "ext", "generation": 7,
         "request": {"requestId": "q1", "profile": "worker", "message": "m"}}
    )  # fmt: skip
    with pytest.raises(errors.NotOwned) as caught:
        await harness.engine.call(harness.conn, "child.start", raw)
    assert caught.value.detail != "" and caught.value.__notes__ == [caught.value.detail]
    wire = json.loads(rpc.error_frame(caught.value, 1))["error"]
    assert wire == {
        "code": -32602,
        "message": str(errors.NotOwned()),
        "data": {"reason": "not_owned"},
    }


async def test_a_new_host_instance_that_cancels_leased_children_is_logged(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    gate = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await gate.wait()

    harness.runner.script = run
    started = await harness.start(lease_id="L1")
    caplog.set_level(logging.WARNING, logger="delegation")
    await harness.engine.connect("runner-1", "host-b")  # a restart that forgot its id
    record = await harness.wait_done(started.conversation_id)
    assert record.state == "cancelled" and record.error == "cancelled: runner restarted"
    said = [r for r in caplog.records if getattr(r, "action", "") == "runner_restarted"]
    assert len(said) == 1
    assert "host-b" in said[0].getMessage() and "host-a" in said[0].getMessage()
    assert "1 leases were revoked and 1 children cancelled" in said[0].getMessage()


async def test_the_same_host_instance_says_nothing(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="delegation")
    await harness.engine.connect("runner-1", "host-a")
    assert not [r for r in caplog.records if getattr(r, "action", "") == "runner_restarted"]


def test_serve_says_where_it_listens(tmp_path: Path) -> None:
    """A first client met FileNotFoundError: nothing said the host was ready."""
    sock = tmp_path / "host.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "delegation.cli", "serve", "--socket", str(sock),
         "--db", str(tmp_path / "h.db")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == f"delegation serve: listening on {sock}\n"
        assert sock.exists()  # said once it is there
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@pytest.mark.parametrize("uid", ["-5", "-1", "4294967295", "root", "1.5"])
def test_allow_uid_takes_user_ids_only(tmp_path: Path, uid: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "serve", "--socket", str(tmp_path / "s"),
         "--allow-uid", uid, "--db", str(tmp_path / "h.db")],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"{uid!r} is not a user id (0 to 4294967294)" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_the_demo_without_its_extra_names_the_install_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rich took "[pydantic-ai]" for markup: the line said `pip install 'durable-delegation'`."""
    from delegation.cli import demo

    monkeypatch.setitem(sys.modules, "pydantic_ai", None)  # as if it were not installed
    assert demo.run_demo(f"sqlite:///{tmp_path / 'd.db'}", runner="pydantic-ai") == 2  # usage
    said = capsys.readouterr().err
    assert said.startswith("delegation: ") and said.count("\n") == 1
    assert "pip install -e '.[pydantic-ai]' from the checkout" in said
    assert "(once published: pip install 'durable-delegation[pydantic-ai]')" in said
    assert os.listdir(tmp_path) == []
