"""A network cut on loopback: every packet to or from one address dropped (nftables), so
that whatever listens there goes silent -- no reset, no error, as in a partition -- while
it runs on. The address is one of loopback's own (all of 127.0.0.0/8 is this machine).

Each cut is a table of its own (named by process and address), deleted when the cut
heals. The tests that cut skip without ``nft`` (or without the right to use it), unless
``DELEGATION_REQUIRE_NETCUT=1`` (CI's ``.ci/run`` installs nftables and sets it): then
that is a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

REQUIRE = "DELEGATION_REQUIRE_NETCUT"


def require_nft() -> str:
    """``nft``, usable here; skip without it (fail when required)."""
    found = shutil.which("nft")
    why = "nft is not installed (apt-get install nftables)"
    if found is not None:
        probe = subprocess.run([found, "list", "tables"], capture_output=True, text=True)
        why = "" if probe.returncode == 0 else f"nft cannot be used here: {probe.stderr.strip()}"
    if why:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(why)
        pytest.skip(why)
    assert found is not None
    return found


def address(n: int) -> str:
    """A loopback address of this process's own, the ``n``-th (1-250)."""
    return f"127.77.{os.getpid() % 250 + 1}.{n}"


def cut(at: str) -> str:
    """Cut ``at`` off the network; returns the table to give :func:`heal`."""
    nft = require_nft()
    table = f"delegation_cut_{os.getpid()}_{at.replace('.', '_')}"
    rules = [
        f"add table inet {table}",
        f"add chain inet {table} out {{ type filter hook output priority 0; }}",
        f"add rule inet {table} out ip daddr {at} drop",
        f"add rule inet {table} out ip saddr {at} drop",
    ]
    subprocess.run([nft, "-f", "-"], input="\n".join(rules), text=True, check=True)
    return table


def heal(table: str) -> None:
    subprocess.run([require_nft(), "delete", "table", "inet", table], check=True)


@contextlib.contextmanager
def silenced(at: str) -> Iterator[None]:
    """``at`` cut off the network inside the block."""
    table = cut(at)
    try:
        yield
    finally:
        heal(table)
