"""The runner version a host runs, resolved once at open, and what a resumed run is
told of it (design §34; the policy itself is :mod:`delegation.usecases.versions`)."""

from __future__ import annotations

import dataclasses

from delegation.config import EngineConfig
from delegation.records import Resumable
from delegation.run.context import Recovery, Runner
from delegation.usecases import versions


def configured(config: EngineConfig, runner: Runner) -> EngineConfig:
    """``config`` with the version this host runs and those it resumes resolved:
    ``runner_version``, else ``$DELEGATION_RUNNER_VERSION``, else the runner's ``version``;
    ``runner_resumes``, else the runner's ``resumes``.

    Raises:
        ValueError: a version that may not name one (1 to 128 printable bytes).
    """
    version, resumes = versions.resolved(
        config, getattr(runner, "version", None), getattr(runner, "resumes", ())
    )
    return dataclasses.replace(config, runner_version=version, runner_resumes=resumes)


def recovery_of(item: Resumable, config: EngineConfig) -> Recovery:
    """What ``prepare`` is given for a resumed child: where it stopped, the version
    this host runs, whether another one ran it last, and why it resumes."""
    host = versions.HostVersion.of(config)
    return Recovery(
        item.attempt,
        item.last_sequence,
        item.delivered,
        item.steps,
        runner_version=host.version,
        version_changed=versions.changed(item.child, host),
        reason=item.reason,
        previous_version=versions.ran(item.child),
    )
