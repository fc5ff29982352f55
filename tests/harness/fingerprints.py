"""What other tests use of cli/test_cli.py, kept here so that no test module imports another:
fingerprint."""

from __future__ import annotations

import hashlib
from pathlib import Path


def fingerprint(db_path: Path) -> tuple[str, str]:
    """The bytes of the database and of its WAL, an absent WAL counting as empty.

    (A read-only SQLite reader may create an empty WAL and the shared-memory index
    beside a closed database; neither holds data.)
    """
    wal = db_path.with_name(db_path.name + "-wal")
    content = wal.read_bytes() if wal.exists() else b""
    return hashlib.sha256(db_path.read_bytes()).hexdigest(), hashlib.sha256(content).hexdigest()
