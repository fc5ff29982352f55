"""The runtime wing: the public :class:`Engine` and what runs under it.

- :mod:`~delegation.engine.api`: ``Engine``, the embedding API (SPEC §6);
- :mod:`~delegation.engine.methods`: the five child methods (SPEC §5) it serves;
- :mod:`~delegation.engine.runtime`: what the parts share, and the one write entry;
- :mod:`~delegation.engine.supervisor` and :mod:`~delegation.engine.local_run`: the
  runs this process executes, from their start to their end;
- :mod:`~delegation.engine.membership`: this host among the hosts of its database (§12);
- :mod:`~delegation.engine.operators`: operators' control requests (§11);
- :mod:`~delegation.engine.timers`: the lease and retention wake-ups.

Nothing below the engine (the use cases, the store, the runners) imports this package.
"""

from delegation.engine.api import Engine
from delegation.engine.methods import ParamsLike

__all__ = ["Engine", "ParamsLike"]
