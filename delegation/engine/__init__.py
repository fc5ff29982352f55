"""The runtime wing: the public :class:`Engine` and what runs under it.

- :mod:`~delegation.engine.api`: ``Engine``, the embedding API (design §6), its read
  models in :mod:`~delegation.engine.reads` and the host's own controls (cancel, steer,
  answer, send, admission policies, rewind) in :mod:`~delegation.engine.controlling`;
- :mod:`~delegation.engine.methods`: the five child methods (design §5) it serves, and
  :mod:`~delegation.engine.answers`: what their callers are answered, and when (an ok
  start is an admitted child on every host, design §32);
- :mod:`~delegation.engine.runtime`: what the parts share, and the one write entry;
- :mod:`~delegation.engine.starting`: ``child.start``, reserved, spawned and answered;
- :mod:`~delegation.engine.supervisor` and :mod:`~delegation.engine.local_run`: the
  runs this process executes, from their spawn to their end, and
  :mod:`~delegation.engine.ends`: their ends, written together;
- :mod:`~delegation.engine.resuming`: the children run again from where they stopped,
  a takeover's (resumed) and a wake-up's or the pump's (woken);
- :mod:`~delegation.engine.membership`: this host among the hosts of its database (§12),
  and :mod:`~delegation.engine.adoption`: what a lost commit answer left unrun here,
  run once the database is back (§32);
- :mod:`~delegation.engine.operators`: operators' control requests (§11);
- :mod:`~delegation.engine.timers` and :mod:`~delegation.engine.upkeep`: the lease and
  retention wake-ups, and what they do;
- :mod:`~delegation.engine.waking`: waiting children woken (design §21) by their time,
  their answer or an event, and the operators' answers and events;
- :mod:`~delegation.engine.versions`: the runner version this host runs, resolved at
  open, and what a resumed run is told of it (design §34);
- :mod:`~delegation.engine.rewinding`: a rewound execution's first run, resumed from
  its seed (design §35);
- :mod:`~delegation.engine.admitting`: admission's pump (design §22), the queue admitted
  in order as slots free;
- :mod:`~delegation.engine.notices`: commit notices (what wakes a follow, a wait and
  the control watcher), and :mod:`~delegation.engine.following`: ``follow`` and
  ``follow_read``;
- :mod:`~delegation.engine.telemetry`: OpenTelemetry's spans and metrics (its extra).

Nothing below the engine (the use cases, the store, the runners) imports this package.
"""

from delegation.engine.api import Engine
from delegation.wire import ParamsLike

__all__ = ["Engine", "ParamsLike"]
