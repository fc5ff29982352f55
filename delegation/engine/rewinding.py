"""A rewound execution's first run (design §35): resumed from its seed, admitted anew.

A rewound execution is reserved with its seed (:mod:`delegation.usecases.rewinding`)
and spawned as every fresh child is, by whichever path runs it first (the start's
commit, the admission pump, an adoption). Its first run is then given the ``Recovery``
a crash would give it — the steps and events copied, the ``rewind`` event as its last
sequence, reason ``rewind`` — so that it replays through the one path every resume
takes; only its admission, its deadline and its attempt (0) are a first run's.
"""

from __future__ import annotations

from delegation.config import EngineConfig
from delegation.engine.local_run import LocalRun
from delegation.records import ChildRecord
from delegation.run.context import Recovery
from delegation.usecases import rewinding

REASON = rewinding.REASON


async def recovery(local: LocalRun, child: ChildRecord, config: EngineConfig) -> Recovery | None:
    """The ``Recovery`` of a rewound execution's first run; None for any other child."""
    if child.rewound_from is None:
        return None
    seeded = await local.rt.owed_read(local.stopped, lambda c: rewinding.seeded(c, child, config))
    if seeded is None:
        return None
    local.emitted = True  # its first page holds the events it was seeded with
    return Recovery(
        0,
        seeded.last_sequence,
        steps=seeded.steps,
        runner_version=config.runner_version,
        version_changed=seeded.version_changed,
        reason=REASON,
        previous_version=seeded.previous_version,
    )


def first_run(recovery: Recovery | None) -> bool:
    """Whether a run is its execution's first: admitted by it, its deadline counted from
    its admission (a fresh child's, or a rewound execution's)."""
    return recovery is None or recovery.reason == REASON
