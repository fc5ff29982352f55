"""The children this host runs again, from where they stopped: those a takeover
committed here (resumed: a boot's, a dead host's, a rejoin's hand-over, design §7) and
those a wake-up or the admission pump committed ``running`` here (woken, design §21,
§22). Each is spawned on the :class:`~delegation.engine.supervisor.Supervisor` with the
``Recovery`` its stored progress gives (:func:`~delegation.engine.versions.recovery_of`).

A takeover's children are this host's from its commit (:meth:`Resuming.will_resume`),
before their runs are spawned: a cancellation meanwhile stops each as it is spawned
(:class:`~delegation.engine.supervisor.ToResume`). None runs again once the host
closes: they stay this instance's, and the next boot or another host's takeover
resumes them.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator, Sequence

from delegation.engine.local_run import LocalRun
from delegation.engine.runtime import Runtime, refused, unreadable
from delegation.engine.supervisor import Supervisor
from delegation.engine.versions import recovery_of
from delegation.records import Resumable
from delegation.usecases import maintenance, reservation

log = logging.getLogger("delegation.engine")


class Resuming:
    """The children one engine runs again (see the module), on its ``supervisor``."""

    def __init__(self, rt: Runtime, supervisor: Supervisor) -> None:
        self._rt = rt
        self._supervisor = supervisor

    def will_resume(self, takeover: maintenance.Takeover) -> None:
        """At the takeover's commit, before any other task sees it: until spawned, its
        children are this host's runs to stop (a lease expiring meanwhile would find no
        run and finish the child, then see it resumed)."""
        self._supervisor.to_resume.add(item.child.id for item in takeover.resumable)

    def resume(self, takeover: maintenance.Takeover) -> None:
        """Run the children a takeover committed here, unless the host closes meanwhile
        (a hand-over at the end of a close through a cut-off): they stay this instance's,
        closed with it, and the next boot or another host's takeover resumes them."""
        to_resume = self._supervisor.to_resume
        if self._supervisor.closing:
            to_resume.forget(item.child.id for item in takeover.resumable)
            return
        unreadable(takeover.unreadable)
        refused(takeover.refused)
        for item in takeover.resumable:
            local = self._spawn(item)
            if to_resume.spawned(item.child.id):
                local.cancel()
            log.info(
                "child resumed",
                extra={"action": "child_recovered", "run_id": item.child.run_id},
            )

    def wake(self, woken: Sequence[Resumable]) -> None:
        """Run again the children a wake-up committed ``running`` here (design §21);
        none once the host closes (as :meth:`resume`)."""
        if self._supervisor.closing:
            return
        for item in woken:
            self._spawn(item)
            log.info("child woken", extra={"action": "child_woken", "run_id": item.child.run_id})

    def _spawn(self, item: Resumable) -> LocalRun:
        """Spawn the run of a child that ran before, told where it stopped."""
        recovery = recovery_of(item, self._rt.config)
        plan = reservation.plan_of(item.child, item.policy)
        return self._supervisor.spawn(item.child, plan, recovery, item.steers)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a boot resumes its children.

    Resuming 10k children allocates a few hundred thousand long-lived objects, none
    of them garbage, and the full collections they trigger each scan the whole heap:
    half the boot went there. The collector is restored on the way out.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
