"""delegation: durable, credential-free child runs for agent hosts.

The root holds what a newcomer needs (``delegation.__all__``): the engine and its
config, the operator's door, the runner's side, the wire types of a child, its record
and the root of the error tree. The rest lives where it belongs: every refusal's class
in :mod:`delegation.errors` (``delegation.errors.HostConflict``), the wire contract in
:mod:`delegation.wire`, :mod:`delegation.options` and :mod:`delegation.codec`, the
records in :mod:`delegation.records`. Every name the root exported before stays
importable from here (``from delegation import ResumeMismatch, START_METHOD``),
forwarded when first used, but is not listed: the root's face stays about twenty names.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

# Loaded with the package (it imports nothing heavy), so that `import delegation` is enough
# for `delegation.errors.HostConflict`.
from delegation import errors

if TYPE_CHECKING:
    # The face, the names of __all__.
    from delegation.config import AdmissionPolicy, EngineConfig
    from delegation.engine import Engine
    from delegation.errors import DelegationError
    from delegation.host.local import LocalHost
    from delegation.operator import Operator
    from delegation.options import ExecutionOptions
    from delegation.records import ChildRecord
    from delegation.run.context import ChildContext, NotResumable, Recovery, Run, Runner, admit
    from delegation.wire import Event, Identity, Params, Preset, Request, Result

if TYPE_CHECKING:
    # Exported by the root before it kept to a face: forwarded, not listed. `X as X` is
    # the explicit re-export a strict type checker honours for a name outside __all__,
    # and `import *` re-exports every name of delegation.errors.__all__.
    from delegation.codec import decode as decode
    from delegation.codec import encode as encode
    from delegation.errors import *  # noqa: F403
    from delegation.options import effective_options as effective_options
    from delegation.records import LeaseRecord as LeaseRecord
    from delegation.records import RunnerConnection as RunnerConnection
    from delegation.records import ToolHandle as ToolHandle
    from delegation.wire import CANCEL_METHOD as CANCEL_METHOD
    from delegation.wire import READ_METHOD as READ_METHOD
    from delegation.wire import RELEASE_METHOD as RELEASE_METHOD
    from delegation.wire import START_METHOD as START_METHOD
    from delegation.wire import STEER_METHOD as STEER_METHOD
    from delegation.wire import Profile as Profile
    from delegation.wire import Rewind as Rewind
    from delegation.wire import SteerResult as SteerResult
    from delegation.wire import valid_id as valid_id

# Where each name is, imported when first used (PEP 562): the engine brings SQLAlchemy,
# Alembic and APScheduler, the wire types msgspec and asyncio; `delegation --version`
# and `delegation --help` need none of them. The error classes are found by
# errors.__all__.
_LAZY: dict[str, str] = {
    # The face.
    "EngineConfig": "delegation.config",
    "AdmissionPolicy": "delegation.config",
    "Engine": "delegation.engine",
    "DelegationError": "delegation.errors",
    "LocalHost": "delegation.host.local",
    "Operator": "delegation.operator",
    "ExecutionOptions": "delegation.options",
    "ChildRecord": "delegation.records",
    "ChildContext": "delegation.run.context",
    "NotResumable": "delegation.run.context",
    "Recovery": "delegation.run.context",
    "Run": "delegation.run.context",
    "Runner": "delegation.run.context",
    "admit": "delegation.run.context",
    "Event": "delegation.wire",
    "Identity": "delegation.wire",
    "Params": "delegation.wire",
    "Preset": "delegation.wire",
    "Request": "delegation.wire",
    "Result": "delegation.wire",
    # Forwarded for compatibility, documented in their modules.
    "decode": "delegation.codec",
    "encode": "delegation.codec",
    "effective_options": "delegation.options",
    "LeaseRecord": "delegation.records",
    "RunnerConnection": "delegation.records",
    "ToolHandle": "delegation.records",
    "CANCEL_METHOD": "delegation.wire",
    "READ_METHOD": "delegation.wire",
    "RELEASE_METHOD": "delegation.wire",
    "START_METHOD": "delegation.wire",
    "STEER_METHOD": "delegation.wire",
    "Profile": "delegation.wire",
    "Rewind": "delegation.wire",
    "SteerResult": "delegation.wire",
    "valid_id": "delegation.wire",
}


if not TYPE_CHECKING:  # a type checker sees the names imported above, and no others

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif name in errors.__all__:
            value = getattr(errors, name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value  # found once: the next use is a plain lookup
        return value


def __dir__() -> list[str]:
    # The face (and where the errors are), not every name forwarded for compatibility.
    return sorted({*__all__, "errors", *(name for name in globals() if name.startswith("__"))})


# A library prints nothing unless its host set up logging (the logging HOWTO's rule):
# without this, Python's last-resort handler wrote the engine's warnings to stderr.
logging.getLogger("delegation").addHandler(logging.NullHandler())

__all__ = [
    "AdmissionPolicy",
    "ChildContext",
    "ChildRecord",
    "DelegationError",
    "Engine",
    "EngineConfig",
    "Event",
    "ExecutionOptions",
    "Identity",
    "LocalHost",
    "NotResumable",
    "Operator",
    "Params",
    "Preset",
    "Recovery",
    "Request",
    "Result",
    "Run",
    "Runner",
    "admit",
]
