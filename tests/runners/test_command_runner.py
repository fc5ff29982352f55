"""The ``command`` runner (design §8) with real subprocesses, through a real Engine.

Every command is ``sys.executable -c SCRIPT``; the scripts print what the tests check
(their pid, cwd, environment, what they read on stdin).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from delegation import Event, Identity, Preset, Recovery, Request, errors
from delegation.runners import load_runner
from delegation.runners.command import (
    DEFAULT_ENV_ALLOW,
    CommandConfigError,
    CommandRunner,
    UnknownProfile,
    child_env,
    parse_line,
)
from tests.harness.commands import hosted, preset, script, texts
from tests.harness.support import Harness, identity
from tests.harness.trees import alive, child_tree, launchers, program_of

LEASE = "lease-1"


async def until_text(h: Harness, conversation_id: str, prefix: str) -> str:
    """The first text event starting with ``prefix``, waiting up to 5 s for it."""
    deadline = time.monotonic() + 60
    while True:
        for text in await texts(h, conversation_id):
            if text.startswith(prefix):
                return text
        if time.monotonic() > deadline:
            raise AssertionError(f"no {prefix!r} in {await texts(h, conversation_id)}")
        await asyncio.sleep(0.01)


async def cancel(h: Harness, conversation_id: str) -> float:
    """Cancel a child, wait until it ends; the seconds that took."""
    began = time.monotonic()
    await h.engine.call(h.conn, "child.cancel", h.params(child_id=conversation_id))
    record = await h.wait_done(conversation_id, timeout=60)
    assert record.state == "cancelled"
    return time.monotonic() - began


# --- events, output, cwd ----------------------------------------------------------

EVENTS = """
    import json, os, sys
    print(json.dumps({"kind": "tool", "toolName": "grep", "toolCallId": "t1",
                      "input": "needle", "toolOutput": "found", "success": True,
                      "sequence": 99}))
    print("plain words")
    print("")
    print(json.dumps({"kind": "tool", "apiKey": "not an event field"}))
    print("message=" + sys.stdin.readline().rstrip("\\n"))
    print("argv=" + json.dumps(sys.argv[1:]))
    print("cwd=" + os.getcwd(), flush=True)
    print(json.dumps({"kind": "result", "text": "all done"}))
"""


async def test_stdout_lines_become_events_and_the_result_line_the_output(
    db_url: str, workspace: Path
) -> None:
    argv = [*script(EVENTS), "{message}", "{profile}", "{conversation_id}", "{run_id}", "{cwd}"]
    runner = CommandRunner(profiles={"worker": argv})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="find {the} needle")
        record = await h.wait_done(started.conversation_id)
        assert (record.state, record.error, record.output) == ("done", "", "all done")
        result = await h.read(started.conversation_id)
    tool, *rest = result.events
    assert [e.sequence for e in result.events] == list(range(1, len(result.events) + 1))
    assert (tool.kind, tool.tool_name, tool.tool_call_id) == ("tool", "grep", "t1")
    assert (tool.input, tool.tool_output, tool.success) == ("needle", "found", True)
    assert [e.kind for e in rest] == ["text"] * 5 + ["result"]
    assert rest[0].text == "plain words"  # the blank line left no event
    assert json.loads(rest[1].text) == {"kind": "tool", "apiKey": "not an event field"}
    assert rest[2].text == "message=find {the} needle"
    cwd = os.path.realpath(workspace)
    assert json.loads(rest[3].text.removeprefix("argv=")) == [
        "find {the} needle",
        "worker",
        started.conversation_id,
        started.run_id,
        cwd,
    ]
    assert rest[4].text == f"cwd={cwd}"
    assert result.output == "all done"


async def test_the_command_runs_in_the_childs_cwd(db_url: str, workspace: Path) -> None:
    runner = CommandRunner(profiles={"worker": script("import os; print(os.getcwd())")})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", cwd="sub")
        await h.wait_done(started.conversation_id)
        assert await texts(h, started.conversation_id) == [os.path.realpath(workspace / "sub")]


def test_a_line_is_an_event_only_when_it_decodes_as_one() -> None:
    assert parse_line(b"  \r\n") is None
    assert parse_line(b'{"kind": "note", "text": "x"}\n') == Event(kind="note", text="x")
    assert parse_line(b'{"kind": "", "text": "x"}\n') == Event(
        kind="text", text='{"kind": "", "text": "x"}'
    )
    assert parse_line(b'{"kind": "note", "sequence": -1}') == Event(
        kind="text", text='{"kind": "note", "sequence": -1}'
    )
    assert parse_line(b"caf\xc3\xa9 \xff\r\n") == Event(kind="text", text="café \ufffd")


# --- steering ---------------------------------------------------------------------

ECHO = """
    import sys
    print("task: " + sys.stdin.readline().strip(), flush=True)
    for line in sys.stdin:
        print("heard: " + line.rstrip("\\n"), flush=True)
        if line.strip() == "stop":
            break
    print('{"kind": "result", "text": "stopped"}')
"""


async def test_a_steer_reaches_the_commands_stdin_as_one_line(db_url: str, workspace: Path) -> None:
    runner = CommandRunner(profiles={"worker": script(ECHO)})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="survey the code")
        child_id = started.conversation_id
        assert await until_text(h, child_id, "task: ") == "task: survey the code"
        steered = await h.engine.call(
            h.conn,
            "child.steer",
            h.params(child_id=child_id, request_id="s1", message="go left\nthen right"),
        )
        assert steered.outcome == "injected"
        assert await until_text(h, child_id, "heard: ") == "heard: go left then right"
        await h.engine.call(
            h.conn, "child.steer", h.params(child_id=child_id, request_id="s2", message="stop")
        )
        record = await h.wait_done(child_id)
        assert (record.state, record.output) == ("done", "stopped")


# --- cancellation -----------------------------------------------------------------

TERM_AWARE = """
    import os, pathlib, signal, sys
    def leave(signum, frame):
        pathlib.Path("terminated").write_text(str(signum))
        sys.exit(0)
    signal.signal(signal.SIGTERM, leave)
    print(os.getpid(), flush=True)
    for line in sys.stdin:
        pass
"""

TERM_DEAF = """
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(os.getpid(), flush=True)
    while True:
        time.sleep(1)
"""


async def test_cancel_sends_sigterm_and_reaps_the_process(db_url: str, workspace: Path) -> None:
    runner = CommandRunner(profiles={"worker": script(TERM_AWARE)}, grace_s=60.0)
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1")
        await until_text(h, started.conversation_id, "")
        tree = child_tree()
        took = await cancel(h, started.conversation_id)
        assert took < 30  # well within the grace: SIGTERM, not SIGKILL, ended it
        assert (workspace / "terminated").read_text() == "15"
        assert tree and not any(alive(pid) for pid in tree)


async def test_a_command_ignoring_sigterm_is_killed_after_the_grace(
    db_url: str, workspace: Path
) -> None:
    runner = CommandRunner(profiles={"worker": script(TERM_DEAF)}, grace_s=0.3)
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1")
        await until_text(h, started.conversation_id, "")
        tree = child_tree()
        took = await cancel(h, started.conversation_id)
        assert 0.3 <= took < 30  # the grace, then SIGKILL (the command sleeps for ever)
        record = await h.engine.get_child(started.conversation_id)
        assert record is not None and record.error.startswith("cancelled")
        assert tree and not any(alive(pid) for pid in tree)


SPAWNS = """
    import os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=%s)
    if %s:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(os.getpid(), child.pid, flush=True)
    time.sleep(60)
"""


async def test_cancel_stops_the_commands_whole_process_group(db_url: str, workspace: Path) -> None:
    runner = CommandRunner(profiles={"worker": script(SPAWNS % (False, False))}, grace_s=60.0)
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1")
        await until_text(h, started.conversation_id, "")
        tree = child_tree()
        assert len(tree) >= 2, "the command and its child"
        assert await cancel(h, started.conversation_id) < 30  # SIGTERM, not the grace
        assert not any(alive(pid) for pid in tree)


async def test_a_descendant_holding_the_pipes_cannot_stall_a_cancel(
    db_url: str, workspace: Path
) -> None:
    """A grandchild that left the process group holds the pipes; the command ignores
    SIGTERM. The cancel still completes once the command itself is reaped (and, in a PID
    namespace, the grandchild dies with it)."""
    runner = CommandRunner(profiles={"worker": script(SPAWNS % (True, True))}, grace_s=0.2)
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1")
        await until_text(h, started.conversation_id, "")
        (keeper,) = launchers()
        program = program_of(keeper)
        tree = child_tree()
        try:
            assert await cancel(h, started.conversation_id) < 30  # not the 60 s sleep
            assert not alive(program)
            if runner.containment.namespaces:
                assert not any(alive(pid) for pid in tree), "setsid left a process behind"
        finally:
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.1)  # its pipes close; the runner's last readers end


# --- failure ----------------------------------------------------------------------


async def test_a_nonzero_exit_is_the_error_with_the_code_and_stderrs_tail(
    db_url: str, workspace: Path
) -> None:
    failing = "import sys; sys.stderr.write('x' * 200_000 + 'the end: boom'); sys.exit(3)"
    runner = CommandRunner(profiles={"worker": script(failing)})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1")
        record = await h.wait_done(started.conversation_id)
    assert record.state == "done"
    assert "exited with code 3" in record.error
    assert record.error.endswith("the end: boom")
    assert len(record.error) < 5000  # only a bounded tail is quoted


async def test_an_overlong_stdout_line_fails_the_run(db_url: str, workspace: Path) -> None:
    flood = "import sys; sys.stdout.write('x' * (9 * 1024 * 1024) + '\\n'); print('after')"
    runner = CommandRunner(profiles={"worker": script(flood)})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1")
        record = await h.wait_done(started.conversation_id)
    assert record.state == "done"
    assert "a line over 8388608 bytes" in record.error


async def test_a_command_that_cannot_start_fails_the_run(db_url: str, workspace: Path) -> None:
    runner = CommandRunner(profiles={"worker": ["/nonexistent/agent", "{message}"]})
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1")
        record = await h.wait_done(started.conversation_id)
    assert record.state == "done"
    assert "'/nonexistent/agent' could not start" in record.error


async def test_an_unknown_profile_fails_in_prepare(db_url: str, workspace: Path) -> None:
    runner = CommandRunner(profiles={"worker": script("print('never')")})
    async with hosted(db_url, workspace, runner, profiles=("worker", "other")) as h:
        with pytest.raises(errors.AdmissionFailed) as refused:
            await h.start("q1", profile="other")
    assert "the command runner has no profile 'other'" in str(refused.value)
    with pytest.raises(UnknownProfile):
        await runner.prepare(*prepare_args("other"))


# --- environment ------------------------------------------------------------------

PRINT_ENV = "import json, os; print('env=' + json.dumps(dict(os.environ)))"


async def test_the_environment_is_the_allowlist_and_the_childs_ids(
    db_url: str, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELEGATION_TEST_SECRET", "hunter2")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-host-only")
    monkeypatch.setenv("DELEGATION_TEST_EXTRA", "passed")
    runner = CommandRunner(
        profiles={"worker": script(PRINT_ENV)}, env_allow=["DELEGATION_TEST_EXTRA"]
    )
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1")
        env = json.loads(
            (await until_text(h, started.conversation_id, "env=")).removeprefix("env=")
        )
    assert "DELEGATION_TEST_SECRET" not in env
    assert "OPENAI_API_KEY" not in env
    assert "hunter2" not in json.dumps(env)
    assert env["PATH"] == os.environ["PATH"]
    assert env["DELEGATION_TEST_EXTRA"] == "passed"
    assert env["DELEGATION_CONVERSATION_ID"] == started.conversation_id
    assert env["DELEGATION_RUN_ID"] == started.run_id
    assert env["DELEGATION_PROFILE"] == "worker"
    assert "DELEGATION_RECOVERY_ATTEMPT" not in env
    allowed = {*DEFAULT_ENV_ALLOW, "DELEGATION_TEST_EXTRA"}
    # Whatever else is there, the interpreter put there itself (e.g. LC_CTYPE).
    assert {k for k in env if not k.startswith("DELEGATION_")} - allowed <= {"LC_CTYPE"}


def prepare_args(
    profile: str = "worker", recovery: Recovery | None = None
) -> tuple[Request, Preset, Identity, Recovery | None]:
    request = Request(request_id="q1", profile=profile, message="hello")
    return request, preset(profile), identity(), recovery


def test_child_env_builds_from_the_allowlist_only() -> None:
    host: Mapping[str, str] = {"PATH": "/bin", "HOME": "/h", "AWS_SECRET_ACCESS_KEY": "s"}
    env = child_env(DEFAULT_ENV_ALLOW, identity(), Recovery(attempt=2, last_sequence=41), host)
    assert env == {
        "PATH": "/bin",
        "HOME": "/h",
        "DELEGATION_CONVERSATION_ID": "c-1",
        "DELEGATION_RUN_ID": "r-1",
        "DELEGATION_PROFILE": "worker",
        "DELEGATION_RECOVERY_ATTEMPT": "2",
        "DELEGATION_LAST_SEQUENCE": "41",
    }


async def test_prepare_freezes_the_recovery_into_the_environment() -> None:
    runner = CommandRunner(profiles={"worker": ["agent", "{run_id}", "{cwd}"]})
    run = await runner.prepare(*prepare_args(recovery=Recovery(attempt=1, last_sequence=5)))
    assert run.env["DELEGATION_RECOVERY_ATTEMPT"] == "1"
    assert run.env["DELEGATION_LAST_SEQUENCE"] == "5"
    assert run.argv("/w") == ["agent", "r-1", "/w"]


RESUMABLE = """
    import os, sys
    attempt = os.environ.get("DELEGATION_RECOVERY_ATTEMPT", "none")
    last = os.environ.get("DELEGATION_LAST_SEQUENCE", "none")
    print(f"attempt={attempt} last={last}", flush=True)
    for line in sys.stdin:
        pass
"""


async def test_a_resumed_child_runs_the_command_again_with_recovery_variables(
    db_url: str, workspace: Path
) -> None:
    runner = CommandRunner(profiles={"worker": script(RESUMABLE)}, grace_s=1.0)
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", lease_id=LEASE)
        child_id = started.conversation_id
        assert await until_text(h, child_id, "attempt=") == "attempt=none last=none"
    async with hosted(db_url, workspace, runner) as h:
        again = await until_text(h, child_id, "attempt=1")
        (recovery,) = [e for e in await h.engine.events(child_id) if e.kind == "recovery"]
        assert again == f"attempt=1 last={recovery.sequence}"
        record = await h.engine.get_child(child_id)
        assert record is not None and record.run_id == started.run_id
        assert record.state == "running"


async def test_prepare_puts_the_delivered_steers_after_the_message_on_a_resume() -> None:
    runner = CommandRunner(profiles={"worker": ["agent"]})
    recovery = Recovery(attempt=2, last_sequence=9, delivered_steers=("go left", "a\nb"))
    run = await runner.prepare(*prepare_args(recovery=recovery))
    assert run.message == "hello\ngo left\na b\n"
    fresh = await runner.prepare(*prepare_args())
    assert fresh.message == "hello\n"


STEERED = """
    import os, sys
    attempt = os.environ.get("DELEGATION_RECOVERY_ATTEMPT", "0")
    last = os.environ.get("DELEGATION_LAST_SEQUENCE", "none")
    print(f"attempt={attempt} last={last}", flush=True)
    for line in sys.stdin:
        print(f"{attempt} read: " + line.rstrip("\\n"), flush=True)
"""


async def test_a_resumed_command_gets_its_delivered_steers_again_first_and_in_order(
    db_url: str, workspace: Path
) -> None:
    runner = CommandRunner(profiles={"worker": script(STEERED)}, grace_s=1.0)
    async with hosted(db_url, workspace, runner) as h:
        started = await h.start("q1", message="survey", lease_id=LEASE)
        child_id = started.conversation_id
        for n, message in enumerate(["go left", "then\nright"]):
            steered = await h.engine.call(
                h.conn,
                "child.steer",
                h.params(child_id=child_id, request_id=f"s{n}", message=message, lease_id=LEASE),
            )
            assert steered.outcome == "injected"
        await until_text(h, child_id, "0 read: then right")
    # The host is gone and its command killed with it; a new host resumes the child.
    async with hosted(db_url, workspace, runner) as h:
        await until_text(h, child_id, "1 read: then right")
        (recovery,) = [e for e in await h.engine.events(child_id) if e.kind == "recovery"]
        resumed = [t for t in await texts(h, child_id) if t.startswith("1 ")]
        assert resumed == ["1 read: survey", "1 read: go left", "1 read: then right"]
        assert f"attempt=1 last={recovery.sequence}" in await texts(h, child_id)
        steered = await h.engine.call(
            h.conn,
            "child.steer",
            h.params(
                child_id=child_id, request_id="s9", message="more", lease_id=LEASE, tool_call_id=""
            ),
        )
        assert steered.outcome == "injected"
        await until_text(h, child_id, "1 read: more")


# --- configuration ----------------------------------------------------------------


def test_from_file_reads_the_command_table(tmp_path: Path) -> None:
    path = tmp_path / "runner.toml"
    path.write_text(
        textwrap.dedent(
            """
            [command]
            env_allow = ["EXTRA_NAME"]
            grace_s = 0.5
            [command.profiles.echo]
            argv = ["python3", "-c", "import sys; print(sys.stdin.readline().strip())"]
            [command.profiles.review]
            argv = ["reviewer", "--run", "{run_id}", "--", "{message}"]
            """
        )
    )
    runner = CommandRunner.from_file(path)
    assert runner.profiles["echo"][:2] == ("python3", "-c")
    assert runner.profiles["review"] == ("reviewer", "--run", "{run_id}", "--", "{message}")
    assert runner.env_allow == (*DEFAULT_ENV_ALLOW, "EXTRA_NAME")
    assert runner.grace_s == 0.5
    loaded = load_runner("command", path)
    assert isinstance(loaded, CommandRunner) and loaded.profiles == runner.profiles


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[command.profiles.a]\nargv = ['x', '{secret}']", "unknown placeholder {secret}"),
        ("[command.profiles.a]\nargv = ['x', '{message.upper}']", "unknown placeholder"),
        ("[command.profiles.a]\nargv = ['x', '{message!r}']", "unknown placeholder"),
        ("[command.profiles.a]\nargv = ['x', '{}']", "unknown placeholder"),
        ("[command.profiles.a]\nargv = ['x', 'a}b']", "bad template"),
        ("[command.profiles.a]\nargv = []", "argv must be a nonempty list"),
        ("[command.profiles.a]\nargv = 'x {message}'", "argv must be a nonempty list"),
        ("[command.profiles.a]\nargv = ['x']\nshell = true", "may set only argv, close_stdin"),
        ("[command]\nshell = true\n[command.profiles.a]\nargv = ['x']", "unknown [command]"),
        ("[command]\ngrace_s = -1\n[command.profiles.a]\nargv = ['x']", "grace_s must be"),
        ("[command]\nenv_allow = 'PATH'\n[command.profiles.a]\nargv = ['x']", "env_allow must"),
        ("[command]\nenv_allow = ['A=B']\n[command.profiles.a]\nargv = ['x']", "not ['A=B']"),
        (
            "[command]\nenv_allow = ['PGPASSWORD']\n[command.profiles.a]\nargv = ['x']",
            "may not name PGPASSWORD: it gives the host's database to a child",
        ),
        (
            "[command]\nenv_allow = ['DELEGATION_DB']\n[command.profiles.a]\nargv = ['x']",
            "may not name DELEGATION_DB",
        ),
        ("[other]\nx = 1", "a [command] table with"),
        ("[command]\n", "[command.profiles.NAME] is required"),
        ("[command", "runner.toml: "),
    ],
)
def test_a_bad_configuration_is_refused_at_construction(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "runner.toml"
    path.write_text(text)
    with pytest.raises(CommandConfigError) as refused:
        CommandRunner.from_file(path)
    assert message in str(refused.value)


def test_the_constructor_checks_templates_too() -> None:
    with pytest.raises(CommandConfigError, match=r"unknown placeholder \{home\}"):
        CommandRunner(profiles={"a": ["x", "--dir={home}"]})
    with pytest.raises(CommandConfigError, match="at least one profile"):
        CommandRunner(profiles={})
    assert CommandRunner(profiles={"a": ["x", "{{literal}}"]}).profiles["a"] == (
        "x",
        "{{literal}}",
    )
