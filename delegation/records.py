"""Plain records of what the store holds: what authority checks and read models return.

They carry no behaviour and import no persistence, so pure code (authority, the state
machine) can be tested over them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from delegation.options import ExecutionOptions
from delegation.wire import Preset

# The event kinds the engine writes into a child's stream on its behalf (design §26): a
# resume's ``recovery``, an input request's ``input-required``, a rewind's ``rewind``. A
# run may not emit them, and a resumed run's emits are matched with the others only.
RECOVERY_KIND = "recovery"
INPUT_REQUIRED_KIND = "input-required"
REWIND_KIND = "rewind"
ENGINE_KINDS = frozenset({RECOVERY_KIND, INPUT_REQUIRED_KIND, REWIND_KIND})


@dataclass(frozen=True, slots=True)
class RunnerConnection:
    """One live registration of a runner, as returned by ``Engine.connect``."""

    id: str
    runner_id: str
    host_instance_id: str
    generation: int


@dataclass(frozen=True, slots=True)
class RunnerRecord:
    runner_id: str
    host_instance_id: str
    generation: int
    connection_id: str | None


@dataclass(frozen=True, slots=True)
class GrantRecord:
    """A tool grant (one tool call) or a lease grant (retained authority)."""

    id: str
    kind: str  # "tool" | "lease"
    runner_id: str
    connection_id: str | None
    run_id: str | None
    conversation_id: str | None
    tool_call_id: str | None
    extension_id: str
    lease_id: str | None
    origin_grant_id: str | None
    workspace: str | None
    presets: tuple[Preset, ...]
    generations: frozenset[int]
    depth: int
    created_at: float
    expires_at: float | None
    closed_at: float | None
    activated_at: float | None
    revoked_at: float | None
    revoke_reason: str | None
    # The parent run's effective ExecutionOptions: the ceiling of every child (design §9).
    policy: ExecutionOptions | None = None

    @property
    def is_lease(self) -> bool:
        return self.kind == "lease"


@dataclass(frozen=True, slots=True)
class ToolHandle:
    """An open tool call, as returned by ``Engine.open_tool``."""

    grant_id: str
    runner_id: str
    connection_id: str
    run_id: str
    conversation_id: str
    tool_call_id: str
    extension_id: str


@dataclass(frozen=True, slots=True)
class ChildRecord:
    """One execution of a child conversation: the engine's read model."""

    id: int
    conversation_id: str
    run_id: str
    grant_id: str | None
    lease_id: str | None
    request_id: str
    runner_id: str
    runner_host_instance_id: str
    parent_conversation_id: str
    parent_run_id: str
    extension_id: str
    profile: str
    generation: int
    request: bytes
    preset: bytes
    cwd: str
    depth: int
    followup: bool
    state: str
    engine_instance_id: str | None
    cancel_requested_at: float | None
    cancel_reason: str | None
    error: str
    output: str
    recovery_attempts: int
    created_at: float
    updated_at: float
    admitted_at: float | None
    finished_at: float | None
    origin_grant_id: str | None = None
    trace_context: str | None = None  # the W3C traceparent it was started in, if traced
    # Its effective options as they were at its start (JSON; design §14): a follow-up
    # narrows the first execution's, never the preset as registered since. None: a child
    # reserved before they were stored (its request and preset give them, as then).
    options: bytes | None = None
    # Input requests of the execution still open (design §21): its Result lists them.
    inputs_open: int = 0
    # Admission (design §22): its priority; when it entered admission (None: no policy
    # admitted it); when it must have ended (None: no deadline, or not admitted yet).
    priority: int = 5
    queued_at: float | None = None
    deadline_at: float | None = None
    # Versions (design §34): the runner version that prepared it, its newest attempt's,
    # the version it is pinned to (None: not pinned), when an operator unpinned it.
    version: str | None = None
    attempt_version: str | None = None
    pinned_version: str | None = None
    unpinned_at: float | None = None
    # Rewind (design §35): the run id of the execution it was seeded from, and the step
    # it was rewound to (None: every step of it). None: not a rewind.
    rewound_from: str | None = None
    rewound_step: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in ("done", "cancelled")

    def identity_fields(self) -> dict[str, str]:
        """The fields of the child's wire ``Identity`` (also flattened into ``Result``)."""
        return {
            "runner_id": self.runner_id,
            "host_instance_id": self.runner_host_instance_id,
            "conversation_id": self.conversation_id,
            "run_id": self.run_id,
            "parent_conversation_id": self.parent_conversation_id,
            "parent_run_id": self.parent_run_id,
            "extension_id": self.extension_id,
            "profile": self.profile,
        }


@dataclass(frozen=True, slots=True)
class ChildSummary:
    """An execution as a list or a page shows it: the columns of its row that people
    read, never its stored request, preset or options (a request alone may be close to
    a MiB); ``error`` and ``output`` as the query cut them, when it did."""

    id: int
    conversation_id: str
    run_id: str
    state: str
    profile: str
    lease_id: str | None
    parent_conversation_id: str
    parent_run_id: str
    extension_id: str
    runner_id: str
    created_at: float
    finished_at: float | None
    cancel_reason: str | None
    recovery_attempts: int
    pinned_version: str | None  # pinned to the runner version that ran it (design §34)
    admitted_at: float | None  # None: never admitted (an A2A face's REJECTED, design §29)
    inputs_open: int  # input requests still open (design §21)
    error: str
    output: str

    @property
    def terminal(self) -> bool:
        return self.state in ("done", "cancelled")


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """A lease as the read models show it (live or a revoked tombstone)."""

    lease_id: str
    runner_id: str
    extension_id: str
    run_id: str | None
    conversation_id: str | None
    created_at: float
    expires_at: float | None
    activated_at: float | None
    revoked_at: float | None
    revoke_reason: str | None
    children: int


@dataclass(frozen=True, slots=True)
class Resumable:
    """A child of a live lease to run again: its recovery event is committed and it is
    ``running`` under the new host instance; ``steers`` were queued and not delivered."""

    child: ChildRecord
    attempt: int
    last_sequence: int
    steers: tuple[tuple[int, str], ...] = ()
    policy: bytes | None = None  # its grant's, as stored: the ceiling of its options
    delivered: tuple[str, ...] = ()  # steers handed to earlier attempts, oldest first
    steps: int = 0  # steps its execution recorded (design §15)
    reason: str = "restart"  # why it resumes (design §34: Recovery.reason)


class RecordedStep(NamedTuple):
    """A step an execution recorded (design §15): its result as stored."""

    raw: bool  # the step returned bytes, stored as they were
    value: bytes  # else the JSON of its result


class StepRow(NamedTuple):
    """A recorded step as operators see it: never its value."""

    name: str
    ordinal: int  # its place among the execution's steps, from 1
    size: int  # bytes of the stored value
    recorded_at: float


@dataclass(frozen=True, slots=True)
class ChildFilter:
    """Which children a list holds, newest first: one input carried whole from the API
    (``Engine.list_children``, ``Inspector.list_children``) to the store's query."""

    state: str | None = None
    lease_id: str | None = None
    parent_run_id: str | None = None
    parent_conversation_id: str | None = None
    limit: int = 100
