"""``--runner-config``: a setting the runner does not know is a usage error (exit 2),
before any database is made."""

from __future__ import annotations

from pathlib import Path

import pytest

from delegation.cli.commands import main


def test_a_runner_config_with_an_unknown_setting_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = tmp_path / "runner.toml"
    settings.write_text("[scripted]\nbogus = 1\n")
    db = tmp_path / "d.db"
    code = main(["serve", "--stdio", "--runner-config", str(settings), "--db", str(db)])
    assert code == 2
    assert "Traceback" not in capsys.readouterr().err
    assert not db.exists()


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ("timeout_s = 0", "profile 'w': timeout_s must be a finite number of seconds > 0"),
        ("close_stdin = 'no'", "profile 'w': close_stdin must be true or false, not 'no'"),
    ],
)
def test_a_bad_command_profile_option_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str, says: str
) -> None:
    """Issue 29's profile options are checked when the host loads its TOML: one line,
    exit 2, no database made."""
    settings = tmp_path / "runner.toml"
    settings.write_text(f"[command.profiles.w]\nargv = ['cat']\n{table}\n")
    db = tmp_path / "d.db"
    argv = ["serve", "--stdio", "--runner", "command", "--runner-config", str(settings)]
    assert main([*argv, "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not db.exists()
