"""What no process of a child may reach (design §10, §17, §23): the host's database and
what stands for it, and the host's own code and configuration.

The engine protects the directory of its database, the files of its credentials
(:mod:`delegation.store.credentials`), the host's own code (its Python prefixes and
site-packages, the ``delegation`` package) and every directory it imports code from
(each ``sys.path`` entry, ``__main__``'s directory), and hands that set to every run as
``ctx.protected``: a runner that starts processes checks its confinement against it,
whatever runner wraps it. The command runner adds its TOML file.

Hazard: a child that can write the host's code runs unconfined at the host's next start
(a ``.pth`` file in site-packages is executed by every interpreter that starts).
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from delegation.authority import within

DATABASE_REACHED = "child confinement would reach the host database"
HOST_REACHED = "child confinement would reach the host"
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # delegation/


def forms(paths: Iterable[str]) -> tuple[str, ...]:
    """Each path as written (made absolute) and as it resolves: a symlink on the way,
    which a child able to replace it could redirect, is as much the host's as its
    target."""
    found: dict[str, None] = {}
    for path in paths:
        if path:
            found[os.path.normpath(os.path.abspath(path))] = None
            found[os.path.realpath(path)] = None
    return tuple(found)


@dataclass(frozen=True, slots=True)
class Protected:
    """Paths no process of a child may reach, each as written and as it resolves.

    ``database``: the directory of the host's database (SQLite); no allowed directory
    may contain it. ``host``: the host's own code and configuration; no directory a
    child may write may contain it or lie inside it (reading it is allowed: a
    ``python3`` child needs the interpreter's files). ``imports``: the directories the
    host imports code from; no directory a child may write may contain one (a module
    planted there shadows one the host imports at its next start). ``secret``: files
    no child may read (the database's credentials): none may lie in or contain a
    directory it may write, and the read-only roots are carved around them
    (:mod:`delegation.runners.child_view`).
    """

    database: tuple[str, ...] = ()
    host: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()
    secret: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        database: Iterable[str] = (),
        host: Iterable[str] = (),
        imports: Iterable[str] = (),
        secret: Iterable[str] = (),
    ) -> Protected:
        return cls(forms(database), forms(host), forms(imports), forms(secret))

    def __or__(self, other: Protected) -> Protected:
        def both(mine: tuple[str, ...], theirs: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(dict.fromkeys([*mine, *theirs]))

        return Protected(
            both(self.database, other.database),
            both(self.host, other.host),
            both(self.imports, other.imports),
            both(self.secret, other.secret),
        )

    def refusal(self, writable: Iterable[str], readable: Iterable[str]) -> str | None:
        """Why a child that may write beneath ``writable`` and read beneath ``readable``
        would reach what is protected, or None. Each root counts as its real path (the
        directory the kernel will grant); the database's directory is named first."""
        writable = list(writable)
        for root in [*writable, *readable]:
            real = os.path.realpath(root)
            if any(within(guarded, real) for guarded in self.database):
                return f"{DATABASE_REACHED}: {root}"
        for root in writable:
            real = os.path.realpath(root)
            both_ways = [*self.host, *self.secret]
            if any(within(guarded, real) or within(real, guarded) for guarded in both_ways):
                return f"{HOST_REACHED}: {root}"
            if any(within(guarded, real) for guarded in self.imports):
                return f"{HOST_REACHED}: {root}"
        return None

    def hidden(self) -> list[str]:
        """The real paths no child may read (``secret``), for the launcher's rules."""
        return list(dict.fromkeys(os.path.realpath(path) for path in self.secret))


NOTHING = Protected()


def host_imports() -> tuple[str, ...]:
    """The directories the host imports code from now: every ``sys.path`` entry (an
    empty one is the working directory) and the directory of ``__main__``'s file (a
    script's, or the package ``python -m`` ran)."""
    paths = [entry or os.getcwd() for entry in sys.path]
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main:
        paths.append(os.path.dirname(os.path.abspath(main)))
    return tuple(dict.fromkeys(paths))


@cache
def host_code() -> tuple[str, ...]:
    """The host's own code: its Python prefixes, the directories its interpreter loads
    modules and ``.pth`` files from (site-packages, the user's when enabled), and the
    ``delegation`` package (its source, for an editable install)."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    paths += [sysconfig.get_path(name) for name in ("purelib", "platlib")]
    paths += site.getsitepackages()
    if site.ENABLE_USER_SITE:
        paths.append(site.getusersitepackages())
    paths.append(PACKAGE)
    return tuple(dict.fromkeys(path for path in paths if path))
