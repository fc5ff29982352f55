"""Tools that measure and try the library from outside, never part of it, beside
``tests/`` and outside the installed package: the benchmarks (:mod:`tools.bench`,
``python -m delegation.bench``), the soak (:mod:`tools.soak`, ``python -m
delegation.soak``), the floods of a serve socket and of the web page, and the start's
floor. They import the library; nothing of the library imports them (the layout test
checks it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default this process's) for a child process that runs ``-m tools...``:
    the checkout first on its ``PYTHONPATH``, wherever it is started from."""
    found = dict(os.environ if env is None else env)
    paths = [str(CHECKOUT), *filter(None, found.get("PYTHONPATH", "").split(os.pathsep))]
    found["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return found
