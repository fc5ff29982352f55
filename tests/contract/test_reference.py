"""The API reference (docs/reference.md, rendered by mkdocstrings) shows the root as its
face: every name of ``delegation.__all__`` under ``delegation.``, the whole error tree
under ``delegation.errors``, and every other name the root still forwards (the wire
types, the codec, the records) in the module where it lives, not under the root."""

from __future__ import annotations

import re
from pathlib import Path

import delegation
import delegation.errors

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def _rendered() -> set[str]:
    return set(re.findall(r"^::: (\S+)", REFERENCE.read_text(encoding="utf-8"), re.M))


def test_every_name_of_the_face_is_in_the_reference() -> None:
    rendered = _rendered()
    assert "delegation.errors" in rendered  # the whole tree, every class of it
    missing = [
        name
        for name in delegation.__all__
        if f"delegation.{name}" not in rendered and name not in delegation.errors.__all__
    ]
    assert missing == []


def test_every_forwarded_name_is_in_the_reference_where_it_lives() -> None:
    rendered = _rendered()
    forwarded = {
        name: module for name, module in delegation._LAZY.items() if name not in delegation.__all__
    }
    assert "START_METHOD" in forwarded and "Rewind" in forwarded  # wire types, in delegation.wire
    missing = [f"{module}.{name}" for name, module in forwarded.items()]
    assert [path for path in missing if path not in rendered] == []


def test_the_reference_shows_no_name_under_the_root_that_the_face_does_not_list() -> None:
    under_root = {
        path.removeprefix("delegation.")
        for path in _rendered()
        if path.startswith("delegation.") and path.count(".") == 1
    }
    modules = {"errors"}  # a module documented whole, not a name of the root
    assert under_root - modules <= set(delegation.__all__)
