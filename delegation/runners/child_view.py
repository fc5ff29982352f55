"""What a command child may see of the host's files (design §17, §23), worked out on the
host's side for the launcher to carry out (:mod:`delegation.runners.child_launcher`).

* :func:`read_rules`: the Landlock rules for reading beneath the ``read_only`` roots
  with the ``hidden`` paths (the database's credentials) carved out. Landlock only
  grants, so a root that holds a hidden path is not granted whole: the root and each
  directory on the way down to it may be listed (``READ_DIR``, which reads no file),
  and every other entry beside the way is granted on its own, opened by the launcher
  without following a symlink (what a symlink leads to is judged on its own path when
  it is used). An entry made after the child started is not readable to it.
* :func:`user_plan`: for a root host whose children run as a user of their own, how
  the launcher lets that user reach its roots: a root-owned directory it could not
  enter on the way to one (``/root`` above a Python installed there) is mounted over
  itself idmapped and read-only, so the user may enter it (Landlock keeps it from all
  there but its roots, which is why such a directory is also carved out of every
  read-only root that holds it), and each read-only root beneath it is mounted back
  as it is, so its files keep their modes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

# Landlock's file access rights (include/uapi/linux/landlock.h), and a read-only grant.
EXECUTE, READ_FILE, READ_DIR = 1, 4, 8
READ_ONLY = EXECUTE | READ_FILE | READ_DIR
_X = 1  # the search bit, as "other" holds it

# A Landlock read rule as the launcher takes it: [path, access, follow a symlink].
Rule = tuple[str, int, bool]


def beneath(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def read_rules(
    roots: Iterable[str], hidden: Sequence[str], closed: Sequence[str] = ()
) -> list[str | Rule]:
    """The read-only roots as the launcher takes them: a root with nothing hidden in
    it as it is, one holding a ``hidden`` path (real paths) carved around it, one at or
    beneath a hidden path left out. A ``closed`` directory (:func:`user_plan`: one the
    child's user may enter only through an idmapped mount, where root's files are its
    own) is left out as a hidden one is, but the roots beneath it stay (each its own)."""
    rules: list[str | Rule] = []
    for root in roots:
        real = os.path.realpath(root)
        if real in closed or any(beneath(real, secret) for secret in hidden):
            continue
        inside = [path for path in [*hidden, *closed] if beneath(path, real)]
        if inside:
            _carve(real, inside, rules)
        else:
            rules.append(root)
    return rules


def _carve(directory: str, hidden: list[str], rules: list[str | Rule]) -> None:
    rules.append((directory, READ_DIR, False))
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        deeper = [secret for secret in hidden if beneath(secret, path)]
        if path in deeper:
            continue
        if deeper and os.path.isdir(path) and not os.path.islink(path):
            _carve(path, deeper, rules)
        else:
            rules.append((path, READ_ONLY, False))


def user_plan(
    writable: Iterable[str], readable: Iterable[str], user: tuple[int, int]
) -> dict[str, list[str]]:
    """How the launcher gives a root host's child, running as ``user`` (uid, gid; no
    supplementary group), the roots it may write and read (real paths):

    * ``closed``: the root-owned directories ``user`` could not enter on the way to a
      root (never ``/``), outermost first: each is mounted idmapped and read-only, and
      left out of what it may read (:func:`read_rules`), but for its roots; one inside
      another too, since a read-only root between them is mounted back as it is;
    * ``beneath``: the read-only roots beneath a closed directory, mounted back over
      it as they are, read-only (the writable ones are mounted idmapped anyway), so
      their files keep their modes.

    A read-only root ``user`` may not read is left as it is: closed to it by its mode.
    """
    roots = [(os.path.realpath(r), False) for r in writable]
    roots += [(os.path.realpath(r), True) for r in readable]
    closed: set[str] = set()
    for path, _ in roots:
        for way in _ancestors(path):
            found = _stat(way)
            if found is not None and found.st_uid == 0 and not _may(found, user, _X):
                closed.add(way)
    ways = sorted(closed, key=lambda path: path.count("/"))
    covered = [
        path for path, read_only in roots
        if read_only and any(beneath(path, way) and path != way for way in ways)
    ]  # fmt: skip
    return {"closed": ways, "beneath": covered}


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _ancestors(path: str) -> list[str]:
    found, way = [], os.path.dirname(path)
    while way not in ("/", ""):
        found.append(way)
        way = os.path.dirname(way)
    return found


def _may(found: os.stat_result, user: tuple[int, int], bits: int) -> bool:
    """Whether ``user`` has ``bits`` on a file with no supplementary group."""
    shift = 6 if found.st_uid == user[0] else 3 if found.st_gid == user[1] else 0
    return (found.st_mode >> shift) & bits == bits
