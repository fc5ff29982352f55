"""Options of the whole command line (design §13): ``--version``, and ``--db`` before or
after the command, or from ``DELEGATION_DB``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from delegation import cli
from delegation.about import DISTRIBUTION


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"delegation {version(DISTRIBUTION)}\n"


# What --version has no use for: the store, the scheduler, the migrations, msgspec's types.
HEAVY = ("sqlalchemy", "alembic", "apscheduler", "msgspec", "delegation.engine", "delegation.wire")


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_version_and_help_import_no_engine_store_or_wire(argv: list[str]) -> None:
    """Issue 29: `delegation --version` took 0.8 s idle, importing the whole engine (the
    package's __init__ imported it); now each name is imported when first used."""
    code = (
        "import sys\nfrom delegation.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n"
        "    pass\nprint(sorted(m for m in sys.modules if m.startswith(%r)), file=sys.stderr)"
        % (argv, HEAVY)
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stderr.strip() == "[]", done.stderr


def test_every_name_the_package_exports_is_there_when_first_used() -> None:
    """The package's names are imported lazily (PEP 562): each of __all__ resolves, in a
    fresh interpreter, and `import *` brings them all."""
    code = (
        "import delegation\nnames = {n: getattr(delegation, n) for n in delegation.__all__}\n"
        "assert all(v is not None for v in names.values())\n"
        "assert set(delegation.__all__) <= set(dir(delegation))\n"
        "scope = {}\nexec('from delegation import *', scope)\n"
        "assert set(delegation.__all__) <= set(scope)\n"
        "assert delegation.Engine is __import__('delegation.engine').engine.Engine"
    )
    subprocess.run([sys.executable, "-c", code], timeout=60, check=True)


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


def _serve_and_hang_up(db: Path, *flags: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "serve", "--stdio", "--db", str(db), *flags],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "DELEGATION_LOG"},
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def test_serve_logs_one_json_object_per_line_with_its_fields(tmp_path: Path) -> None:
    lines = _serve_and_hang_up(tmp_path / "new.db", "--log-level", "debug", "--log-json")
    records = [json.loads(line) for line in lines]  # every line is one object
    started = [r for r in records if r.get("action") == "serve_started"]
    assert started and started[0]["level"] == "info" and started[0]["message"] == "serving"
    assert {"time", "level", "logger", "message"} <= set(started[0])
    hung_up = next(r for r in records if r.get("action") == "peer_hung_up")
    assert hung_up["in_flight"] == 0, "the structured fields come along"
    chatty = [r for r in records if r["logger"].split(".")[0] in ("alembic", "apscheduler")]
    assert chatty == [], "a new file was migrated and timers armed, quietly"


def test_serve_log_level_for_people_and_its_default(tmp_path: Path) -> None:
    lines = _serve_and_hang_up(tmp_path / "new.db", "--log-level", "info")
    assert any("serving action=serve_started" in line for line in lines)
    assert not any(" alembic" in line or " apscheduler" in line for line in lines)
    assert _serve_and_hang_up(tmp_path / "new.db") == [], "warnings only, by default"
