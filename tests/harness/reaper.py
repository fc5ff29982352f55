"""Run one command as a child subreaper, so that nothing it starts outlives it unseen.

    python -m tests.harness.reaper COMMAND [ARG...]

``pg_autoctl`` runs Postgres under supervisor processes that fork and exit; killed with
SIGKILL, it leaves them orphaned. Orphans are normally handed to PID 1, which in a
container may never reap them (zombies) nor be asked about them again (strays). Under
this process they are handed here instead (``PR_SET_CHILD_SUBREAPER``): every process
of a node is a descendant of its reaper, so ``tests/harness/failover.py`` finds them all by
walking ``/proc`` from here, and this process reaps each as it exits. It exits with the
command's status once no descendant is left.

The reaper keeps the user it was started as; the command runs as the unprivileged user
of tests/harness/postgres.py when that is root (the Python running this may not be readable by
that user).
"""

from __future__ import annotations

import ctypes
import os
import sys

from tests.harness import postgres

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    command = os.fork()
    if command == 0:
        demote = postgres._as_user()
        if demote is not None:
            demote()
        os.execvp(argv[0], argv)
    status = 1
    while True:
        try:
            pid, code = os.wait()
        except ChildProcessError:  # no descendant left
            return status
        if pid == command:
            status = os.waitstatus_to_exitcode(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
