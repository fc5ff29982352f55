"""A runner whose hook at boot fails, for tests/store/test_bad_rows.py: it is used in the
test's process and by a host process that imports it by name, so it lives here rather than
in a test module."""

from __future__ import annotations

from typing import Any

from tests.harness.support import ScriptRunner


class Refusing(ScriptRunner):
    """A runner whose hook at boot fails, after the engine took the database."""

    def protect_paths(self, paths: Any) -> None:
        raise RuntimeError("cannot protect the database")
