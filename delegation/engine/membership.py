"""This host's membership among the hosts of one database (design §7, §12): its boot's
takeover, its heartbeats, the takeover of dead hosts, the fence when another host took
it over, the cut-off when no heartbeat commits, and the rejoin after either. On a SQLite
file, the one host's hold on it: a file replaced under it stops the host (design §18).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Sequence

from delegation import errors
from delegation import os_processes as processes
from delegation.clock import ServerClock
from delegation.engine.resuming import Resuming
from delegation.engine.runtime import Runtime, Use
from delegation.engine.supervisor import Supervisor
from delegation.engine.timers import WAKE_JOB, Timers
from delegation.runners import tmpdirs
from delegation.store import lifecycle
from delegation.store.batch import boot_clock
from delegation.usecases import maintenance, waiting

log = logging.getLogger("delegation.engine")

DEFERRALS_WARNED = 3  # heartbeats in a row whose takeover was held back: said once
BOOT_ATTEMPTS = 3  # boot takeovers that met a held row, before the opening fails busy
BEAT_RETRY_S = 0.25  # a heartbeat that failed is tried again this soon
CLOCK_TRUSTED_S = 0.25  # the longest round trip a reading of the server's clock is used from


class Membership:
    """One engine's place among the hosts of its database (see the module)."""

    def __init__(
        self, rt: Runtime, supervisor: Supervisor, resuming: Resuming, timers: Timers
    ) -> None:
        self._rt = rt
        self._supervisor = supervisor
        self._resuming = resuming
        self._timers = timers
        self._task: asyncio.Task[None] | None = None
        self._alive_deadline = math.inf  # see _alive_since; none before the first beat
        self.open = False  # a closing host only beats: it takes nothing over
        self._given_up = asyncio.Event()  # a replaced database was let go (see lost)
        self._deferred = 0  # heartbeats in a row whose takeover met a held row
        self._clock_read = False  # the server's clock was read once (see _correct_clock)

    # --- boot ---------------------------------------------------------------------------

    async def boot(self) -> maintenance.Takeover:
        """Name a new host instance and take over from the previous ones (design §7):
        kill what lost runs left running, remove the private temp dirs hosts that ended
        left (:mod:`delegation.runners.tmpdirs`), and stop what the takeover cancelled. Returns
        the takeover, whose children :meth:`Resuming.resume` runs once the engine is
        open."""
        rt = self._rt
        loop = asyncio.get_running_loop()
        rt.lost = None  # a file replaced under an earlier opening is another's now
        self._given_up.clear()
        rt.instance_id = f"h-{secrets.token_hex(16)}"
        await loop.run_in_executor(None, rt.db.claim, rt.instance_id)
        if isinstance(rt.clock, ServerClock):  # before anything is stamped
            await self._correct_clock(rt.clock)
        await self._await_unproven(rt)
        beat, takeover = await self._reconcile(rt)
        self._alive_since(beat)  # the boot's own heartbeat
        self._supervisor.ended(takeover.ended)
        await self._kill_lost(takeover)
        # After the orphans, which could still be writing in theirs.
        await loop.run_in_executor(None, tmpdirs.remove_stale)
        await self._supervisor.stop(takeover.stopping)
        return takeover

    @staticmethod
    async def _reconcile(rt: Runtime) -> tuple[float, maintenance.Takeover]:
        """The boot's takeover, and the clock of its heartbeat. A row another host
        holds (one paused in a transaction, until the server's idle-transaction timeout
        ends it) makes it wait out the lock timeout: it tries again, up to
        ``BOOT_ATTEMPTS`` times, before the opening fails busy."""
        use = Use(maintenance.reconcile, rt.config, rt.instance_id, rt.db.shared)
        for _ in range(BOOT_ATTEMPTS - 1):
            beat = boot_clock()
            try:
                return beat, await rt.write(use)
            except errors.DatabaseBusy:
                log.warning("boot takeover met rows another host holds; trying again")
        beat = boot_clock()
        return beat, await rt.write(use)

    @staticmethod
    async def _await_unproven(rt: Runtime) -> None:
        """Wait (at most two beats) until a free lock of a fresh instance proves its
        host dead: a live host takes its lock again before its next heartbeat."""
        if not rt.db.shared:
            return
        suspect = 2 * rt.config.host_heartbeat_s
        wait = await rt.db.read(lambda c: lifecycle.unproven_dead(c, rt.instance_id, suspect))
        if wait > 0:
            await asyncio.sleep(wait)

    def start(self) -> None:
        """Heartbeat from now on, on a database several hosts share; on a file, look
        every ``host_heartbeat_s`` whether it is still the one opened (design §18)."""
        beats = self._heartbeats() if self._rt.db.shared else self._hold_file()
        self._task = asyncio.create_task(beats, name="delegation-beat")

    async def stop(self) -> None:
        """Stop beating (or looking at the file). A host closing on a replaced file,
        noticed or not, gives its path up before its connections close (see lost)."""
        beating, self._task = self._task, None
        if beating is not None:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
        if self._rt.lost is not None or not self._rt.db.held():
            await asyncio.get_running_loop().run_in_executor(None, self._rt.db.let_go)

    async def _kill_lost(self, takeover: maintenance.Takeover) -> None:
        """Before anything resumes: a process a lost run started and that outlived its
        host would otherwise run beside the resumed child."""
        if takeover.processes:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, _kill_orphans, takeover.processes)

    # --- a replaced file ----------------------------------------------------------------

    async def _hold_file(self) -> None:
        """An idle host notices a replaced file too (a writing one, at its next commit):
        one ``stat`` a period."""
        while self._rt.db.held():
            await asyncio.sleep(self._rt.config.host_heartbeat_s)

    def lost(self, failure: errors.DelegationError) -> None:
        """The store found its file replaced (a restore renamed over it), on the loop's
        thread before any caller of a refused write hears of it. Every write is refused
        from now on; an open host stops every local run at once, without a write (their
        children resume on the host that opens the file next, as after a crash); once
        they stopped, the path is given up to the file now there (``Store.let_go``),
        and :meth:`failed` returns. A host opening or closing only refuses its writes:
        its open or close raises the error."""
        rt = self._rt
        if rt.lost is not None:
            return
        rt.lost = failure
        if not self.open:
            return
        running = list(self._supervisor.runs)
        for local in running:
            local.suspend()
        log.error(
            "%s: %d runs stopped, nothing more is written; this host stops",
            failure,
            len(running),
            extra={"action": "database_replaced", "instance": rt.instance_id},
        )
        rt.background(self._give_up())

    async def _give_up(self) -> None:
        await self._supervisor.suspend_all()
        await asyncio.get_running_loop().run_in_executor(None, self._rt.db.let_go)
        self._given_up.set()

    async def failed(self) -> errors.DelegationError:
        """Wait until a replaced database was given up (see :meth:`lost`); its error."""
        await self._given_up.wait()
        assert self._rt.lost is not None
        return self._rt.lost

    # --- heartbeats -------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        """Heartbeat every ``host_heartbeat_s``, and take over what dead hosts left.

        The first beat comes at once: a host killed just before this one opened is seen
        dead (its lock free) without waiting a whole period. Nothing a beat meets ends
        the loop: a host that stopped beating would be taken over while it runs."""
        delay, failing = 0.25, False
        while True:
            await asyncio.sleep(delay)
            delay = self._rt.config.host_heartbeat_s
            try:
                await self._beat()
            except errors.DelegationError as exc:  # busy, or the server away
                # Tried again soon, not a period later (design §32): a restart freed this
                # host's lock, and another host takes a free lock whose heartbeat is two
                # beats old for a dead host's. Said once a lapse.
                level = logging.DEBUG if failing else logging.WARNING
                log.log(level, "heartbeat failed: %s", exc, extra={"action": "heartbeat_failed"})
                delay, failing = min(BEAT_RETRY_S, delay), True
                await self._cut_off()
            except Exception:
                log.exception("heartbeat failed", extra={"action": "heartbeat_failed"})
            else:
                failing = False

    async def _beat(self) -> None:
        rt = self._rt
        # The lock first: a heartbeat commits only after it is held on the same server.
        await asyncio.get_running_loop().run_in_executor(None, rt.db.keep_lock)
        beat = boot_clock()
        use = Use(
            maintenance.heartbeat,
            rt.config,
            rt.instance_id,
            self.open,
            rt.db.reconnected,  # read as the beat runs: after any reconnect
        )
        try:
            takeover = await rt.write(use, committed=self._resuming.will_resume)
        except errors.HostFenced:
            await self._fenced()
            return
        self._alive_since(beat)
        self._deferred = self._deferred + 1 if takeover.deferred else 0
        if self._deferred == DEFERRALS_WARNED:
            log.warning(
                "the takeover of dead hosts met rows held by another transaction"
                " %d heartbeats in a row",
                self._deferred,
                extra={"action": "takeover_held_back", "instance": rt.instance_id},
            )
        if self._rt.cut_off and self.open:  # a closing host hands nothing over to itself
            await self._back_from_cut()
        self._supervisor.ended(takeover.ended)
        if isinstance(rt.clock, ServerClock):
            await self._correct_clock(rt.clock)
        if takeover.taken:
            await self._take_over(takeover)

    async def _take_over(self, takeover: maintenance.Takeover) -> None:
        """Run what a takeover committed to this instance: nothing else would (the
        children are a live host's now), so a failure on the way resumes them anyway."""
        log.warning(
            "took over %d dead host instances",
            len(takeover.taken),
            extra={"action": "hosts_taken_over", "instances": takeover.taken},
        )
        await self._kill_lost(takeover)
        try:
            await self._supervisor.stop(takeover.stopping)
        finally:
            self._resuming.resume(takeover)
        self._timers.arm(await self._rt.db.read(maintenance.next_deadline))
        # The waiting children it took are this host's to wake (design §21).
        me = self._rt.instance_id
        self._timers.arm(await self._rt.db.read(lambda c: waiting.next_wake(c, me)), WAKE_JOB)

    async def _correct_clock(self, clock: ServerClock) -> None:
        """Read the server's clock on the reader (not behind queued writes), so the
        round trip that brackets it is one statement's. The reading is off by up to half
        its round trip, and a host ahead purges what retention still keeps: after an
        outage the first reading reconnects the reader, so the shortest of up to three is
        used once within ``CLOCK_TRUSTED_S``, or when the clock was never corrected; else
        the offset is kept as it was (logged)."""
        best: tuple[float, float, float, float] | None = None  # trip, server_now, sent, answered
        for _ in range(3):
            sent = time.time()
            try:
                server_now = await self._rt.db.read_now(maintenance.server_time)
            except errors.DelegationError as exc:
                log.warning("server clock not read: %s", exc, extra={"action": "clock_unread"})
                return
            answered = time.time()
            if best is None or answered - sent < best[0]:
                best = (answered - sent, server_now, sent, answered)
            if best[0] <= CLOCK_TRUSTED_S:
                break
        assert best is not None
        if best[0] <= CLOCK_TRUSTED_S or not self._clock_read:
            clock.correct(*best[1:])
            self._clock_read = True
            return
        log.warning(
            "server clock kept: its readings took %.2f s at best",
            best[0],
            extra={"action": "clock_untrusted"},
        )

    def _alive_since(self, beat: float) -> None:
        """A heartbeat sent at ``beat`` (``boot_clock``) committed: no host declares this
        one dead before host_timeout_s after it (on the database's clock); a heartbeat's
        margin covers the clocks' drift."""
        cfg = self._rt.config
        self._alive_deadline = beat + cfg.host_timeout_s - cfg.host_heartbeat_s
        self._rt.db.alive_until(self._alive_deadline)

    # --- cut off, fenced, rejoined ----------------------------------------------------

    async def _cut_off(self) -> None:
        """No heartbeat has committed for so long that another host may declare this
        one dead any moment (the database away, or this host cut off from it): stop
        every local run now, without a write, so none runs beside the copy a taking
        host would resume (design §19). Once a heartbeat commits again, the host rejoins
        (:meth:`_back_from_cut`)."""
        if self._rt.cut_off or boot_clock() < self._alive_deadline:
            return
        self._rt.cut_off = True
        log.error(
            "no heartbeat for too long: %d runs stopped until the database is back",
            len(self._supervisor.runs),
            extra={"action": "host_cut_off", "instance": self._rt.instance_id},
        )
        await self._supervisor.suspend_all()

    async def _back_from_cut(self) -> None:
        """A heartbeat committed after :meth:`_cut_off`, and nobody took this instance
        over: its stopped runs' children are still its own, yet nothing runs them. The
        host goes on as a new instance, as a fenced one does, and takes the old one over
        itself (:func:`maintenance.hand_over`): that resumes those children here."""
        rt = self._rt
        old = rt.instance_id
        await self._rejoin()
        use = Use(maintenance.hand_over, rt.config, old, rt.instance_id)
        takeover = await rt.write(use, committed=self._resuming.will_resume)
        self._rt.cut_off = False  # only now: a failure on the way is tried again at the next beat
        log.warning(
            "the database is back: this host goes on as a new instance",
            extra={"action": "host_rejoined", "old_instance": old, "instance": rt.instance_id},
        )
        if takeover.taken:
            await self._take_over(takeover)

    async def _fenced(self) -> None:
        """Another host declared this one dead (it was paused, or cut off, past
        ``host_timeout_s``) and took its children: every local run stops without a
        write (the store refuses them anyway), and the host goes on as a new instance.

        Until it has, writes are refused: one begun now would name the instance that
        was taken over, yet be fenced on the new one (a connection left open on it)."""
        lost, old = len(self._supervisor.runs), self._rt.instance_id
        self._rt.cut_off = False  # what a cut stopped was taken over: nothing to resume here
        await self._rejoin()
        log.error(
            "this host was taken over while it could not heartbeat; %d runs stopped",
            lost,
            extra={"action": "host_fenced", "old_instance": old, "instance": self._rt.instance_id},
        )

    async def _rejoin(self) -> None:
        """Stop every local run without a write, and go on as a new host instance."""
        rt = self._rt
        rt.rejoining = True
        try:
            await self._supervisor.suspend_all()
            new = f"h-{secrets.token_hex(16)}"
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, rt.db.claim, new)
            beat = boot_clock()
            await rt.write(
                Use(maintenance.rejoin, new, rt.config.runner_version), while_rejoining=True
            )
            rt.instance_id = new  # once its row exists: connections name it
            # The rejoin committed the new instance's first heartbeat: its time alive
            # counts from there, not from the old one's last beat (long past, if it was
            # paused), or the next failed beat would cut it off at once and it would
            # hand itself over (a live host taken over: the soak's live_taken).
            self._alive_since(beat)
        finally:
            rt.rejoining = False


def _kill_orphans(recorded: Sequence[processes.ProcessId]) -> None:
    killed = [p.pid for p in recorded if processes.kill_group(p)]
    if killed:
        log.warning(
            "killed %d child processes that outlived their host",
            len(killed),
            extra={"action": "orphans_killed", "pids": killed},
        )
