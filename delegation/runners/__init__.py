"""Built-in runners, and loading a runner named on the command line.

``scripted`` is a deterministic demo agent; ``command`` runs each profile as a
subprocess. Any other ``module:attr`` names an object with ``prepare`` or a
zero-argument factory of one.

* :mod:`~delegation.runners.scripted` - the demo's agent;
* :mod:`~delegation.runners.pydantic_ai` - a pydantic-ai ``Agent`` per preset (its extra),
  and :mod:`~delegation.runners.pydantic_ai_demo`, the demo's agent of it;
* :mod:`~delegation.runners.command` - a subprocess per child, speaking in lines:
  :mod:`~delegation.runners.command_config` (its settings, checked once),
  :mod:`~delegation.runners.command_process` (the process: spawn, converse, stop);
* its containment, decided on the host's side: :mod:`~delegation.runners.containment`
  (the launcher's spec), :mod:`~delegation.runners.child_view` (what a child may read,
  and how a root host's child user reaches it), :mod:`~delegation.runners.seccomp_filter`
  (its system call filter), :mod:`~delegation.runners.limits` (its processes and
  memory), :mod:`~delegation.runners.tmpdirs` (its private temp dir); and carried out in
  the child by :mod:`~delegation.runners.child_launcher`;
* :mod:`~delegation.runners.check` - ``delegation containment``: what a child gets here.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from delegation.run.context import Runner

BUILT_IN = {
    "scripted": "delegation.runners.scripted:ScriptedRunner",
    "command": "delegation.runners.command:CommandRunner",
}


def load_runner(spec: str, config: Path | None = None) -> Runner:
    """The runner ``spec`` names (``scripted``, ``command`` or ``module:attr``).

    ``config`` is handed to a built-in runner's ``from_file``.
    """
    target = BUILT_IN.get(spec, spec)
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"runner must be scripted, command or module:attr, not {spec!r}")
    found: Any = getattr(importlib.import_module(module_name), attr)
    if config is not None:
        try:
            return found.from_file(config)  # type: ignore[no-any-return]
        except TypeError as exc:  # an unknown or misspelt setting
            raise ValueError(f"{config}: {exc}") from exc
    is_runner = hasattr(found, "prepare") and not isinstance(found, type)
    if not is_runner and (not callable(found) or inspect.isbuiltin(found)):
        raise ValueError(f"{spec!r} is not a runner: it has no prepare()")
    try:
        runner = found if is_runner else found()
    except TypeError as exc:
        raise ValueError(f"runner {spec!r} needs settings: give --runner-config ({exc})") from exc
    except SystemExit:
        raise ValueError(f"{spec!r} is not a runner factory: calling it exited") from None
    if not callable(getattr(runner, "prepare", None)):
        raise ValueError(f"{spec!r} is not a runner: it has no prepare()")
    return runner  # type: ignore[no-any-return]
