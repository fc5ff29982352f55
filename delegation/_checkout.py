"""Where the tools live: ``tools/`` of a checkout, beside ``delegation/``, outside the
installed package (the wheel ships the library only). ``python -m delegation.bench``
and ``python -m delegation.soak`` are thin entries that run them from a checkout."""

from __future__ import annotations

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def tools_on_path(what: str) -> None:
    """Make the checkout's ``tools`` package importable, or exit with one line."""
    if not (CHECKOUT / "tools" / "__init__.py").is_file():
        sys.exit(
            f"delegation: {what} lives in tools/ of a checkout of the project (it is not in"
            " the installed package): run it from one, e.g. pip install -e ."
        )
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
