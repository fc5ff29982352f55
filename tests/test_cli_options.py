"""Options of the whole command line (SPEC §13): ``--version``, and ``--db`` before or
after the command, or from ``DELEGATION_DB``."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from delegation import cli


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"delegation {version('delegation')}\n"


@pytest.mark.parametrize("where", ["before", "after", "environment"])
def test_db_comes_before_or_after_the_command_or_from_the_environment(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / f"{where}.db"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DELEGATION_DB", raising=False)
    argv = {
        "before": ["--db", str(missing), "children"],
        "after": ["children", "--db", str(missing)],
        "environment": ["children"],
    }[where]
    if where == "environment":
        monkeypatch.setenv("DELEGATION_DB", str(missing))
    assert cli.main(argv) == 1
    assert f"no delegation database at {missing}" in capsys.readouterr().err
    assert not missing.exists(), "inspection never creates a database"


def test_the_db_nearest_the_command_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELEGATION_DB", str(tmp_path / "environment.db"))
    assert (
        cli.main(["--db", str(tmp_path / "top.db"), "children", "--db", str(tmp_path / "sub.db")])
        == 1
    )
    assert f"no delegation database at {tmp_path / 'sub.db'}" in capsys.readouterr().err
    assert cli.main(["--db", str(tmp_path / "top.db"), "children"]) == 1
    assert f"no delegation database at {tmp_path / 'top.db'}" in capsys.readouterr().err


def test_without_db_anywhere_it_is_the_current_directorys_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DELEGATION_DB", raising=False)
    assert cli.main(["children"]) == 1
    assert f"no delegation database at {tmp_path / 'delegation.db'}" in capsys.readouterr().err
