"""The API reference (docs/reference.md, rendered by mkdocstrings) names everything
`delegation` exports, so that a name added to ``__all__`` is not left out of it."""

from __future__ import annotations

import re
from pathlib import Path

import delegation
import delegation.errors

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


def test_every_exported_name_is_in_the_reference() -> None:
    rendered = set(re.findall(r"^::: (\S+)", REFERENCE.read_text(encoding="utf-8"), re.M))
    assert "delegation.errors" in rendered  # the whole tree, every class of it
    missing = [
        name
        for name in delegation.__all__
        if f"delegation.{name}" not in rendered and name not in delegation.errors.__all__
    ]
    assert missing == []
