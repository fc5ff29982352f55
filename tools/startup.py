"""What the ``delegation`` command costs before it does anything (issue 29).

``python -m tools.startup [--runs N]`` runs each command line below N times
(default 9) in a fresh interpreter with ``-X importtime`` and prints, per command, the
median wall time of the whole process and the median time its imports took (the sum of
the top-level entries ``-X importtime`` reports), with the modules it loaded that the
command should not need. To compare with another checkout, run it with that checkout on
``PYTHONPATH``: it measures whichever ``delegation`` the interpreter imports (``-P``: not
the one in the current directory).

Operations tooling: nothing in the library imports it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS: tuple[tuple[str, ...], ...] = (("--version",), ("--help",), ("children", "--help"))
# What no command above needs: the store, the scheduler, the migrations, the wire's codec.
HEAVY = ("sqlalchemy", "alembic", "apscheduler", "msgspec", "rich")
_LOADED = (
    "import sys; from delegation.cli.commands import main\n"
    "try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
    "print(*sorted({{m.split('.')[0] for m in sys.modules}}), file=sys.stderr)"
)


def once(argv: tuple[str, ...]) -> tuple[float, float, set[str]]:
    """One run: wall seconds, import seconds, and the top-level packages it loaded."""
    code = _LOADED.format(argv=list(argv))
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-P", "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - began  # with -X importtime's own cost, small beside these
    lines = done.stderr.splitlines()
    imported = 0
    for line in lines:
        # "import time: self [us] | cumulative | <indent>name": top level has no indent.
        if line.startswith("import time:") and line.count("|") == 2:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit() and not name[1:].startswith(" "):
                imported += int(cumulative)
    loaded = set(lines[-1].split()) if lines else set()
    return wall, imported / 1e6, loaded


def _timed(command: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run(command, capture_output=True, check=True)
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="runs per command (default 9)")
    args = parser.parse_args(argv)
    print(f"{'command':<28} {'wall ms':>8} {'imports ms':>11}  heavy modules loaded")
    bare = [_timed([sys.executable, "-P", "-c", "pass"]) for _ in range(max(1, args.runs))]
    print(f"{'python -c pass':<28} {statistics.median(bare) * 1e3:>8.0f} {'':>11}  -")
    for command in COMMANDS:
        walls, imports, heavy = [], [], set()
        for _ in range(max(1, args.runs)):
            wall, imported, loaded = once(command)
            walls.append(wall)
            imports.append(imported)
            heavy |= loaded & set(HEAVY)
        line = f"delegation {' '.join(command)}"
        print(
            f"{line:<28} {statistics.median(walls) * 1e3:>8.0f}"
            f" {statistics.median(imports) * 1e3:>11.0f}  {', '.join(sorted(heavy)) or '-'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
