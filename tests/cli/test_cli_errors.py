"""Clean failures of ``delegation serve`` (design §9): stdin of any kind, and refusals
that print one line, exit 2 and create nothing; and every command's one exit-code rule
(docs/cli.md, "Exit codes"): 0 done, 1 refused or failed, 2 a usage error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from delegation.cli.arguments import OK, REFUSED, USAGE
from delegation.cli.commands import main
from tests.harness.support import PRESET, Harness

ROOT = Path(__file__).resolve().parents[2]


def serve(*argv: str, stdin: Path | None = None, **env: str) -> subprocess.CompletedProcess[bytes]:
    with (stdin or Path(os.devnull)).open("rb") as source:
        return subprocess.run(
            [sys.executable, "-m", "delegation.cli", "serve", *argv],
            stdin=source, capture_output=True, timeout=60, cwd=ROOT, check=False,
            env={**os.environ, **env},
        )  # fmt: skip


def test_serve_stdio_reads_requests_from_a_regular_file(tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    register = {"runnerId": "r1", "hostInstanceId": "h1"}
    requests.write_bytes(
        b'{"jsonrpc":"2.0","id":1,"method":"runner.register","params":%s}\n'
        b'{"jsonrpc":"2.0","id":2,"method":"no.such.method"}\n'
        b'{"jsonrpc":"2.0","id":3,"method":"child.read","params":{}}'
        % msgspec.json.encode(register)
    )  # the last line has no newline: end of file ends it
    done = serve("--stdio", "--db", str(tmp_path / "x.db"), stdin=requests)
    assert done.returncode == 0, done.stderr
    answers = {a["id"]: a for a in map(msgspec.json.decode, done.stdout.splitlines())}
    assert answers[1]["result"]["generation"] == 1
    assert answers[2]["error"]["code"] == -32601
    assert answers[3]["error"]["code"] == -32602
    assert done.stderr == b""


def test_serve_stdio_with_nothing_to_read_ends_at_once(tmp_path: Path) -> None:
    done = serve("--stdio", "--db", str(tmp_path / "x.db"))  # stdin is /dev/null
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--socket", "{tmp}/missing/host.sock"], "no directory"),
        (["--socket", "{tmp}/" + "s" * 120], "longer than"),
        (["--db", "{tmp}/missing/dir/x.db"], "no directory"),
        (["--db", "{tmp}"], "is a directory"),
        (["--runner", "no_such_module_x:thing"], "cannot load runner"),
        (["--runner", "nope"], "cannot load runner"),
    ],
)
def test_serve_refuses_bad_paths_and_runners_in_one_line(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(tmp=tmp_path) for a in argv]
    if "--db" not in args:
        args += ["--db", str(tmp_path / "x.db")]
    if "--socket" not in args:
        args.append("--stdio")
    before = sorted(tmp_path.rglob("*"))
    assert main(["serve", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("delegation: ") and err.count("\n") == 1, err
    assert says in err
    assert sorted(tmp_path.rglob("*")) == before, "nothing was created"


@pytest.mark.parametrize(
    "argv",
    [
        ["--lease-lifetime", "0"],
        ["--lease-lifetime", "-5"],
        ["--lease-lifetime", "nan"],
        ["--lease-lifetime", "inf"],
        ["--lease-lifetime", "soon"],
        ["--max-inflight", "0"],
        ["--max-inflight", "-1"],
        ["--max-inflight", "1.5"],
        ["--max-connections", "0"],
        ["--max-connections", "-1"],
        ["--max-connections", "many"],
        ["--max-page-bytes", "0"],
        ["--max-page-bytes", "4MiB"],
    ],
)
def test_serve_refuses_numbers_that_are_not_positive(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--stdio", "--db", str(tmp_path / "x.db"), *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}: {argv[1]!r} is not a positive" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == [], "nothing was created"


def test_an_unknown_log_level_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = serve("--stdio", "--db", str(tmp_path / "x.db"), DELEGATION_LOG="loud")
    assert done.returncode == 2
    assert done.stderr.startswith(b"delegation: DELEGATION_LOG=loud")
    assert done.stderr.count(b"\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["serve", "--socket", ""], "--socket: an empty path"),
        (["serve", "--stdio", "--lease-lifetime", "1e300"], "is more than 1000000000 seconds"),
        (["serve", "--stdio", "--max-inflight", str(10**30)], "is more than 1000000000"),
        (["serve", "--socket", "s", "--max-connections", str(10**30)], "is more than 1000000000"),
        (["serve", "--stdio", "--max-page-bytes", str(10**30)], "is more than 1000000000"),
        (["children", "--limit", str(10**20)], "is more than 1000000000"),
        (["serve", "--stdio", "--runner", "sys:exit"], "is not a runner"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    """Issue 28's last tracebacks and silent acceptances: each is one error line (after
    argparse's usage, where it gives one), exit 2, and no database created."""
    import subprocess
    import sys

    db = tmp_path / "never.db"
    command = [str(Path(sys.executable).with_name("delegation")), *args, "--db", f"sqlite:///{db}"]
    proc = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    errors_said = [
        line for line in proc.stderr.splitlines() if not line.startswith(("usage:", " "))
    ]
    assert len(errors_said) == 1 and says in errors_said[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_serve_on_a_closed_stdin_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """``serve --stdio <&-``: there is nothing to serve; it says so, creating nothing
    (it used to open the database, then die with an AttributeError)."""
    import subprocess
    import sys

    db = tmp_path / "never.db"
    command = [str(Path(sys.executable).with_name("delegation")), "serve", "--stdio"]
    # The shell's <&-: descriptor 0 closed in the child before it runs.
    proc = subprocess.run(
        ["sh", "-c", 'exec "$0" "$@" <&-', *command, "--db", f"sqlite:///{db}"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "delegation: --stdio: standard input is closed\n"
    assert list(tmp_path.iterdir()) == []


# --- one exit-code rule, every command ---------------------------------------------------

# What was typed cannot be right: exit 2, judged before the database is read or written.
USAGE_ERRORS = [
    ["nonsense"],
    ["db", "migrate"],
    ["show"],
    ["children", "--state", "finished"],
    ["children", "--pinned", "--lease", "lease-1"],
    ["children", "--patch", ""],
    ["children", "--limit", "0"],
    ["events", "c-1", "--after", "soon"],
    ["admission", "runner:r", "--rate", "5"],
    ["admission", "runner:r", "--rate", "5/0"],
    ["admission", "runner:r", "--rate", "/60"],
    ["admission", "runner:r", "--rate", "0/60"],
    ["admission", "runner:r", "--max-queued", "-1"],
    ["admission", "runner:r", "--concurrency", "0"],
    ["admission", "runner:r", "--max-priority", "10"],
    ["admission", "runner:r", "--max-priority", "high"],
    ["admission", "--max-priority", "5"],
    ["admission", "runner:r", "--remove", "--max-priority", "5"],
    ["admission", "--concurrency", "2"],
    ["admission", "--remove"],
    ["admission", "runner:r", "--remove", "--rate", "1/60"],
    ["admission", "tool:x", "--concurrency", "2"],
    ["admission", "preset:r/e", "--concurrency", "2"],
    ["cancel", "c-1", "--wait", "-1"],
    ["steer", "c-1"],
    ["input", "c-1", "i-1"],
    ["input", "c-1", "i-1", "--approve", "--deny"],
    ["send", "c-1", "k", "--data", "{nope"],
    ["rewind", "c-1"],
    ["controls", "--limit", "0"],
    ["web", "--port", "70000"],
    ["serve", "--stdio", "--runner", "nope"],
    ["containment", "--runner-config", "{tmp}/missing.toml"],
]
# Well formed, and the database says no: exit 1, one line, nothing written.
REFUSALS = [
    ["show", "c-nope"],
    ["events", "c-nope"],
    ["steps", "c-nope"],
    ["cancel", "c-nope"],
    ["steer", "c-nope", "go"],
    ["input", "c-nope", "i-1", "--approve"],
    ["send", "c-nope", "k"],
    ["unpin", "c-nope"],
    ["rewind", "c-nope", "--run", "r-nope"],
]
DONE = [["children"], ["leases"], ["admission"], ["controls"], ["db", "current"]]


def exit_code(argv: list[str]) -> int:
    """``delegation ARGV`` in this process: its exit code, argparse's own included."""
    try:
        return main(argv)
    except SystemExit as exited:
        return int(exited.code or 0)


@pytest.mark.parametrize(
    ("argv", "code"),
    [(a, USAGE) for a in USAGE_ERRORS] + [(a, REFUSED) for a in REFUSALS] + [(a, OK) for a in DONE],
    ids=lambda value: " ".join(value) if isinstance(value, list) else str(value),
)
def test_every_command_exits_by_one_rule(
    argv: list[str], code: int, db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = db_path.read_bytes()
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert exit_code([*args, "--db", str(db_path)]) == code
    out, err = capsys.readouterr()
    said = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
    if code == OK:
        assert said == [], err
        return
    assert len(said) == 1 and said[0].startswith("delegation"), err
    assert "Traceback" not in err
    assert out == ""
    assert db_path.read_bytes() == before, "nothing was written"


@pytest.mark.parametrize(
    ("argv", "code"),
    [(["children"], REFUSED), (["--db", "mysql://h/d", "children"], USAGE)],
)
def test_a_database_that_is_not_there_or_not_ours(
    argv: list[str], code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing file is a refusal (the command was right; the database is not there); a
    URL of no store delegation has cannot be right. Neither creates anything."""
    monkeypatch.setenv("DELEGATION_DB", str(tmp_path / "missing.db"))
    assert exit_code(argv) == code
    assert list(tmp_path.iterdir()) == []


def test_a_rate_without_its_seconds_is_refused_in_one_line(
    db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rate 5`` once stored 5 a second: per second or per minute, it was a guess."""
    assert exit_code(["admission", "runner:r", "--rate", "5", "--db", str(db_path)]) == USAGE
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "delegation admission: error: argument --rate: '5' is not N/SECONDS"
        " (N admissions per SECONDS, both above zero, e.g. 10/60)"
    )
    assert main(["admission", "--json", "--db", str(db_path)]) == OK
    assert capsys.readouterr().out.strip() == "[]"


async def test_a_scope_the_database_never_saw_warns_and_is_stored(
    harness: Harness, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A policy may come before its runner (it holds once a host brings it), so it is
    stored; a misspelled one would hold nothing, so it says so, once, on stderr."""
    ext = PRESET.extension_id
    await harness.start("q1", message="hi")  # runner-1 ran a child of ext/worker
    known = ["runner:runner-1", f"extension:runner-1/{ext}", f"preset:runner-1/{ext}/worker"]
    unseen = {
        "runner:runner-9": "runner 'runner-9'",
        f"extension:runner-1/{ext}x": f"extension 'runner-1/{ext}x'",
        f"preset:runner-1/{ext}/workr": f"preset 'runner-1/{ext}/workr'",
        f"preset:runner-9/{ext}/worker": "runner 'runner-9'",
    }
    for scope in [*known, "parent:c-never"]:
        code, _, err = _admission(scope, db_url, capsys)
        assert (code, err) == (OK, ""), scope
    for scope, what in unseen.items():
        code, out, err = _admission(scope, db_url, capsys)
        assert code == OK and scope in out
        assert err == (
            f"delegation: warning: this database has never seen {what}: the policy is"
            " stored, and holds once a host brings it (never, if misspelled)\n"
        )
    listed = [use.scope for use in await harness.engine.admission()]
    assert sorted(listed) == sorted([*known, "parent:c-never", *unseen])
    code, _, err = _admission("runner:runner-9", db_url, capsys, "--remove")
    assert (code, err) == (OK, ""), "a removal warns of nothing"


async def test_a_preset_offered_but_never_run_is_known(
    harness: Harness, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    scope = f"preset:runner-1/{PRESET.extension_id}/{PRESET.name}"
    assert _admission(scope, db_url, capsys)[::2] == (OK, "")


def _admission(
    scope: str, db_url: str, capsys: pytest.CaptureFixture[str], *more: str
) -> tuple[int, str, str]:
    change = more or ("--concurrency", "2")
    code = main(["admission", scope, *change, "--db", db_url])
    out, err = capsys.readouterr()
    return code, out, err
