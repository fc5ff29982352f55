"""What other tests use of contract/test_fuzz.py, kept here so that no test module imports
another: snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.harness import rows


def snapshot(db: Path | str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, through a separate read-only connection: ``db`` is a
    SQLite file's path or a database's URL."""
    return rows.snapshot(rows.url_of(db) if isinstance(db, Path) else db)
