"""The package's shape (issues 25, 37): no import circle between any two of its modules,
the store's dialects reached only through their records, every module under 600 lines,
a top level of at most 30 entries grouped by role, each folder's ``__init__`` its map,
the tools outside the package. import-linter holds the layers (pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

import delegation
from delegation.store import registry

MAX_LINES = 600  # every module is under this (issue 25)


def _cycle(graph: grimp.ImportGraph, modules: set[str]) -> list[str] | None:
    """One import circle among ``modules``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module) & modules):
            if state.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(modules):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_no_module_imports_another_in_a_circle() -> None:
    graph = grimp.build_graph("delegation")
    modules = {m for m in graph.modules if m.startswith("delegation")}
    assert _cycle(graph, modules) is None


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    graph = grimp.build_graph("delegation")
    graph.add_import(importer="delegation.wire", imported="delegation.engine.api")
    modules = {m for m in graph.modules if m.startswith("delegation")}
    assert _cycle(graph, modules) is not None


def test_the_stores_own_modules_reach_a_dialect_only_through_its_record() -> None:
    """A dialect is a folder of ``store/`` and its line in ``store/registry.py``; the
    store's own modules reach it only through its record, never by an import (no circle
    between the store and its dialects: the ``acyclic_siblings`` contract on
    ``delegation.store`` holds that too)."""
    store = Path(delegation.__file__).parent / "store"
    folders = sorted(p.parent.name for p in store.glob("*/__init__.py"))
    graph = grimp.build_graph("delegation")
    inside = {
        m for m in graph.modules for f in folders if f"{m}.".startswith(f"delegation.store.{f}.")
    }
    own = {f"delegation.store.{p.stem}".removesuffix(".__init__") for p in store.glob("*.py")}
    reaching = {
        (m, i) for m in own for i in graph.find_modules_directly_imported_by(m) if i in inside
    }
    assert reaching == set()
    found = {name: registry.record(name) for name in registry.DIALECTS}
    assert {name: record.name for name, record in found.items()} == {n: n for n in found}
    homes = sorted(registry.DIALECTS[name].split(".")[2] for name in found)
    assert homes == folders


def test_every_module_is_under_600_lines() -> None:
    root = Path(delegation.__file__).parent
    long = {
        str(path.relative_to(root)): n
        for path in root.rglob("*.py")
        if (n := len(path.read_text().splitlines())) >= MAX_LINES
    }
    assert long == {}


def _lazy_imports_for_type_checkers() -> dict[str, str]:
    """The names ``delegation/__init__.py`` imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(Path(delegation.__file__).read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imported in node.body:
                assert isinstance(imported, ast.ImportFrom) and imported.module is not None
                found.update({alias.name: imported.module for alias in imported.names})
    return found


def test_the_lazy_names_are_the_names_type_checkers_see() -> None:
    # Two lists name the lazy exports (one for mypy, one for PEP 562); they must agree
    # (the error classes come by `import *` of delegation.errors, forwarded by its
    # __all__), and every name the package exports must resolve.
    assert _lazy_imports_for_type_checkers() == {**delegation._LAZY, "*": "delegation.errors"}
    missing = [name for name in delegation.__all__ if not hasattr(delegation, name)]
    assert missing == []
    assert set(delegation.__all__) <= set(delegation._LAZY)


def test_the_library_never_waits_with_wait_for() -> None:
    # On Python 3.11, asyncio.wait_for swallows a cancellation that comes in the turn its
    # inner wait finishes: a stopped follow read on forever, and a run cancelled as a
    # steer arrived would have run on. asyncio.timeout does not. Only the tools (outside
    # the library) and the demo's top level may use it.
    root = Path(delegation.__file__).parent
    allowed = {"cli/demo.py"}
    found = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if "tools" not in path.relative_to(root).parts
        and str(path.relative_to(root)) not in allowed
        and "wait_for(" in path.read_text()
    ]
    assert found == []


ROOMS = (
    "cli",
    "client",
    "engine",
    "host",
    "operator",
    "run",
    "runners",
    "store",
    "usecases",
    "web",
)
# Packages of the contract itself, at the top beside its modules (not rooms of roles).
CONTRACT = ("errors",)


def test_the_top_level_is_a_short_hall_of_rooms() -> None:
    """Issue 37: 50 flat modules met a newcomer; the contract and the pure core stay at
    the top, everything else lives in a room named for its role."""
    root = Path(delegation.__file__).parent
    entries = sorted(p.name for p in root.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 30, entries
    rooms = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == sorted(ROOMS + CONTRACT), rooms


def test_each_rooms_init_is_its_map() -> None:
    """Each folder's ``__init__`` says what lives in it: a docstring naming its modules."""
    root = Path(delegation.__file__).parent
    for room in ROOMS + CONTRACT:
        init = root / room / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = [
            p.stem for p in (root / room).glob("*.py") if p.stem not in ("__init__", "__main__")
        ]
        unnamed = [m for m in modules if m not in doc]
        assert doc and unnamed == [], (room, unnamed)


def test_the_tools_are_outside_the_package() -> None:
    """Issue 37: 4,790 lines of tools shipped inside the wheel."""
    root = Path(delegation.__file__).parent
    assert not (root / "tools").exists()
    assert (root.parent / "tools" / "soak" / "__init__.py").is_file()
