"""``--runner-config``: a setting the runner does not know is a usage error (exit 2),
before any database is made."""

from __future__ import annotations

from pathlib import Path

import pytest

from delegation.cli import main


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
