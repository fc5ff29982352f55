"""Several hosts at once on one PostgreSQL database (design §12), for ``--hosts N``.

Host ``slot`` k runs its own runners (``runner-<k>-<n>``, see
:func:`~tools.soak.host.runners_of`) with the soak's heartbeat and host timeout
(``--heartbeat``, ``--host-timeout``: 1 s and 6 s). Every second or two one running
host, never the last one running, is killed (SIGKILL), closed gracefully (SIGTERM) or
paused (SIGSTOP) for longer than it takes to be taken over, then continued (SIGCONT) to
be fenced and rejoin as a new instance; a killed or closed host is replaced at once by a
new process in its slot, with its runners, which come back as the host instance they
were (their leased children survive, now running on whichever host took them over) or
now and then anew. The first three disturbances are a pause, a kill and a close (past
the deadline if the machine is slow), then they come at random.

The database is checked every second or so and right before each paused host is
continued, against what the driver did (:class:`~tools.soak.liveness.Fleet`). At
the end every paused host is continued and fenced, every host closes, and a last host
comes back as a new host instance for every runner and drains, as with one host.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from tools.soak.driver import (
    CLOSE_TIMEOUT_S,
    READY_TIMEOUT_S,
    Driver,
    HostProcess,
    vm_hwm_mb,
)
from tools.soak.host import runners_of
from tools.soak.liveness import Fleet

# A dead host is taken over within the host timeout and 2 s (design §12: a kill, which
# tests/crash/test_several_hosts.py holds to exactly). A paused host is seen dead only at the
# first live heartbeat after its own went stale, on a machine the soak itself loads:
# the soak allows 2 s more, so that a slow beat is not reported as a lost takeover.
SETTLE_MARGIN_S = 4.0
TICK_S = 0.05
FIRST = ("pause", "kill", "close")
CHOICES = ("kill", "close", "pause")
WEIGHTS = (0.4, 0.3, 0.3)


class FleetDriver(Driver):
    """Runs ``hosts`` host processes at once and disturbs them at random (see module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fleet: list[HostProcess] = []
        self.dead: dict[str, float] = {}  # host instance -> when its host stopped running it
        self.stopped: set[str] = set()  # instances of hosts killed, paused or told to close
        self.paused_at: list[tuple[str, float]] = []  # (instance, when) of every pause
        self.settle_s = self.timeout_s + SETTLE_MARGIN_S
        self.slot_hids = {
            slot: {runner: f"hi-0-{runner}" for runner in runners_of(slot, self.hosts)}
            for slot in range(self.hosts)
        }

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + self.seconds
        self.prepare()
        try:
            for slot in range(self.hosts):
                host = self.spawn(slot, self.slot_hids[slot])
                if host is None:
                    return self.report(time.monotonic() - started)
                self.fleet.append(host)
            self.disturb(deadline)
            self.close_all()
            self.check(fleet=self.view())
            last = self.spawn(0, self.final_instances(), final=True)
            if last is not None:
                self.fleet.append(last)
                self.finish_last(last)
                self.died(last, time.time())
            self.check(final=True, fleet=self.view())
        finally:
            for host in self.fleet:
                host.reap()
        return self.report(time.monotonic() - started)

    def disturb(self, deadline: float) -> None:
        """Until the deadline: check now and then, and kill, close or pause a host."""
        plan = list(FIRST)
        next_check = next_act = time.monotonic() + self.rng.uniform(0.5, 1.5)
        while True:
            now = time.monotonic()
            for host in list(self.fleet):
                self.tend(host, now)
            # The first three disturbances happen however slow the machine: past the
            # deadline too, if that is when two hosts run again.
            if now >= deadline and not plan and all(h.state == "running" for h in self.fleet):
                return
            if now > deadline + 120:
                self.violation("stuck: the hosts did not settle two minutes after the end")
                return
            if now >= next_check:
                self.check(live=True, fleet=self.view())
                next_check = now + self.rng.uniform(0.5, 1.5)
            if (now < deadline or plan) and now >= next_act:
                what = plan[0] if plan else self.rng.choices(CHOICES, WEIGHTS)[0]
                if self.act(what):
                    if plan:
                        plan.pop(0)
                    next_act = now + self.rng.uniform(1.0, 2.5)
            time.sleep(TICK_S)

    def view(self) -> Fleet:
        known, stopped = frozenset(self.acks.instances), frozenset(self.stopped)

        def stalled(since: float) -> float:  # the hosts still running: not the paused
            return self.acks.stalled_since(since, stopped)

        pauses = tuple(self.paused_at)
        return Fleet(self.dead, stopped, known, self.settle_s, time.time(), stalled, pauses)

    # --- what is done to hosts ----------------------------------------------------------

    def act(self, what: str) -> bool:
        """Kill, close or pause one running host, if another one keeps running."""
        running = [h for h in self.fleet if h.state == "running"]
        if len(running) < 2:
            return False
        host = self.rng.choice(running)
        self.read_journals()
        self.rss_mb = max(self.rss_mb, vm_hwm_mb(host.pid))
        if what == "kill":
            host.proc.kill()
            host.proc.wait()
            self.killed.add(host.pid)
            self.kills += 1
            self.died(host, time.time())
            self.replace(host)
        elif what == "close":
            self.stopped |= self.acks.instances_of(host.pid)
            host.proc.send_signal(signal.SIGTERM)
            self.graceful += 1
            host.state, host.since = "closing", time.monotonic()
        else:
            instance = self.acks.current.get(host.pid, "")
            self.paused.add(host.pid)
            host.proc.send_signal(signal.SIGSTOP)
            self.pauses += 1
            self.stopped.add(instance)
            self.dead.setdefault(instance, time.time())
            self.paused_at.append((instance, time.time()))
            pause = self.settle_s + self.rng.uniform(0.5, 1.5)
            host.state, host.paused, host.resume_at = "paused", instance, time.monotonic() + pause
        return True

    def died(self, host: HostProcess, when: float) -> None:
        """Every instance the host process was is dead from ``when`` (if not before)."""
        self.read_journals()
        for instance in self.acks.instances_of(host.pid):
            self.stopped.add(instance)
            self.dead.setdefault(instance, when)

    def replace(self, host: HostProcess) -> None:
        """A new host process in the slot of one that is gone, with the same runners."""
        host.reap()
        self.fleet.remove(host)
        self.slot_hids[host.slot] = hids = self.next_instances(self.slot_hids[host.slot])
        new = self.spawn(host.slot, hids, wait=False)
        if new is not None:
            self.fleet.append(new)

    def tend(self, host: HostProcess, now: float) -> None:
        """Move one host along: started, continued after its pause, fenced, or closed."""
        code = host.proc.poll()
        if host.state == "closing":
            if code is not None:
                self.closed(host, code)
                self.died(host, time.time())
                self.replace(host)
            elif now - host.since > CLOSE_TIMEOUT_S:
                self.violation("close_hang: a host did not close within a minute")
                self.died(host, time.time())
                self.replace(host)
        elif code is not None and host.state != "paused":
            self.violation(f"host_died: a host exited by itself with {code} ({host.tail()})")
            self.died(host, time.time())
            self.replace(host)
        elif host.state == "starting":
            if host.ready(0):
                host.state, self.booted = "running", True
            elif now - host.since > READY_TIMEOUT_S:
                self.violation(f"host_start: a host never opened its engine: {host.tail()}")
                self.replace(host)
        elif host.state == "paused" and now >= host.resume_at:
            self.check(live=True, fleet=self.view())  # the takeover must show by now
            host.proc.send_signal(signal.SIGCONT)
            host.state, host.since = "fencing", now
        elif host.state == "fencing":
            self.read_journals()
            if host.paused in self.acks.fenced:
                host.state = "running"
            elif now - host.since > self.settle_s:
                self.violation("not_fenced: a host paused past its timeout was not fenced")
                host.state = "running"  # and alive again, as the instance it was
                self.dead.pop(host.paused, None)
                self.stopped.discard(host.paused)

    def close_all(self) -> None:
        """Every host closes gracefully, all at once."""
        self.read_journals()
        for host in self.fleet:
            self.stopped |= self.acks.instances_of(host.pid)
            host.proc.send_signal(signal.SIGTERM)
        for host in list(self.fleet):
            self.await_close(host)
            self.died(host, time.time())
            host.reap()
