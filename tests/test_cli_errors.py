"""Clean failures of ``delegation serve`` (design §9): stdin of any kind, and refusals
that print one line, exit 2 and create nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from delegation.cli.commands import main

ROOT = Path(__file__).resolve().parent.parent


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
