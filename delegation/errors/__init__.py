"""The one exception tree of delegation.

Every refusal the library makes is a :class:`DelegationError`. Each class carries
a stable machine ``reason`` (snake_case, never renamed once shipped) and the
JSON-RPC ``rpc_code`` it maps to; ``str(error)`` is the human message, and a
class's docstring is its default message. Messages quoted in docs/design.md are matched
by clients: keep them exactly as written. Every class is importable from here; each
family lives in its module: :mod:`~delegation.errors.base` (the root),
:mod:`~delegation.errors.input`, :mod:`~delegation.errors.authority`,
:mod:`~delegation.errors.conflict`, :mod:`~delegation.errors.limits`,
:mod:`~delegation.errors.waits` (a child that waits, design §21),
:mod:`~delegation.errors.rewind` (a rewind, design §35) and
:mod:`~delegation.errors.faults` (framing, the store, our own faults).

::

    DelegationError                          (-32602 unless noted)
    ├── InputError                           malformed or invalid input
    │   ├── MalformedInput                   not the wire shape (decode)
    │   ├── RequestIncomplete
    │   ├── InputTooLarge
    │   ├── BadContextMode
    │   ├── BadResume
    │   ├── BadPresetName
    │   ├── PresetPromptTooLarge
    │   ├── PresetPromptConflict
    │   ├── InvalidOptions                   an ExecutionOptions value
    │   ├── OptionsWidened                   a child widens its parent's policy
    │   │   ├── NoToolsRelaxed
    │   │   ├── NoSkillsRelaxed
    │   │   ├── NoExtensionsRelaxed
    │   │   ├── ToolsWidened
    │   │   ├── CommandsWidened
    │   │   ├── FsSearchEnabled
    │   │   ├── TokenLimitRaised
    │   │   ├── DeadlineWidened              deadlineSeconds (design §22)
    │   │   └── TurnLimitWidened
    │   ├── BadPriority                      request.priority not 0-9 (design §22)
    │   ├── PriorityAboveCap                 above its scope's max_priority (SPEC §31)
    │   ├── BadSteer
    │   ├── BadLeaseId
    │   ├── InvalidId                        an id that is not a valid ID
    │   ├── ChildNotFound                    no child by that id (host and operator calls)
    │   ├── RewindRequiresResume             a rewind outside a follow-up (design §35)
    │   ├── RewindRunUnknown
    │   ├── RewindStepUnknown
    │   └── ReleaseOwnerRequired
    ├── AuthorityError                       the caller lacks authority
    │   ├── RunnerNotFound
    │   ├── StaleConnection
    │   ├── NotOwned
    │   ├── SteerNotOwned
    │   ├── PresetStale
    │   ├── LeaseMismatch
    │   ├── LeaseOwnerMismatch
    │   ├── InvalidCwd
    │   ├── CwdOutsideWorkspace
    │   ├── LeaseNotActivated
    │   ├── ForkRequiresTool
    │   ├── ResumeMismatch
    │   ├── ChildNotOwned
    │   ├── AmbiguousChild
    │   ├── FollowupRequiresRunId
    │   └── RewindNoAuthority                an operator's rewind with no live lease (§35)
    ├── ConflictError                        the request collides with stored state
    │   ├── ActiveSubmission
    │   ├── RequestIdReused
    │   ├── SteerRequestIdReused
    │   ├── ChildEnded                       an operator's control to an ended child
    │   ├── NotPinned                        unpin of a child not pinned (§34)
    │   ├── AdmissionFailed
    │   ├── AdmissionPending                 not decided yet on another host; retry (§32)
    │   ├── ReleaseUnconfirmed
    │   ├── CancelUnconfirmed
    │   ├── ToolAlreadyOpen
    │   ├── IllegalTransition
    │   ├── InputUnknown                     child.input (design §21)
    │   ├── InputAnswered
    │   ├── InputInvalid
    │   ├── InputClosed
    │   ├── EventClosed                      an event to an ended conversation (§33)
    │   ├── InputTimeout                     raised at a resumed ctx.ask
    │   ├── EventTimeout                     raised at a resumed ctx.wait_event
    │   └── StepTimeout                      ctx.step(..., timeout=) (design §22)
    ├── LimitError                           a cap of design §3.8
    │   ├── SubmissionLimit
    │   ├── LeaseCapacity
    │   ├── SteerLimit
    │   ├── PresetLimit
    │   ├── NestingLimit
    │   ├── FollowLimit                      follows of one serve connection
    │   ├── StepTooLarge                     a step's result (design §15)
    │   ├── StepLimit                        steps per execution (design §15)
    │   ├── ConnectionLimit                  serve's streams at once (design §18)
    │   ├── InputLimit                       open input requests of an execution (§21)
    │   ├── EventBufferFull                  events buffered for a conversation (§21)
    │   ├── EventTooLarge                    an event's payload (§21)
    │   └── QueueFull                        an admission queue (design §22)
    ├── ProtocolError                        JSON-RPC framing
    │   ├── ParseError                       (-32700)
    │   ├── InvalidRpcRequest                (-32600)
    │   └── MethodNotFound                   (-32601)
    ├── StoreError                           (-32603) the database refused or failed
    │   ├── DatabaseBusy                     another writer held the lock too long; retry
    │   ├── StoreUnavailable                 the database cannot be reached now; retry
    │   ├── HostClosing                      the host closed before the answer; retry
    │   ├── SchemaMismatch                   not a delegation database, or a newer one
    │   ├── HostConflict                     another live host holds the SQLite file
    │   │   └── HostFenced                   this host was declared dead and taken over
    │   ├── DatabaseReplaced                 the SQLite file was replaced under a live host
    │   ├── DatabaseReadOnly                 the SQLite file may not be written
    │   ├── ChildPurged                      (-32602) the record is past retention
    │   └── ChildUnreadable                  (-32602) its stored record no longer decodes
    └── InternalError                        (-32603) a fault of ours, no detail on the wire
"""

from __future__ import annotations

from delegation.errors.authority import (
    AmbiguousChild,
    AuthorityError,
    ChildNotOwned,
    CwdOutsideWorkspace,
    FollowupRequiresRunId,
    ForkRequiresTool,
    InvalidCwd,
    LeaseMismatch,
    LeaseNotActivated,
    LeaseOwnerMismatch,
    NotOwned,
    PresetStale,
    ResumeMismatch,
    RunnerNotFound,
    StaleConnection,
    SteerNotOwned,
)
from delegation.errors.base import DelegationError
from delegation.errors.conflict import (
    ActiveSubmission,
    AdmissionFailed,
    AdmissionPending,
    CancelUnconfirmed,
    ChildEnded,
    ConflictError,
    IllegalTransition,
    NotPinned,
    ReleaseUnconfirmed,
    RequestIdReused,
    SteerRequestIdReused,
    ToolAlreadyOpen,
)
from delegation.errors.faults import (
    ChildPurged,
    ChildUnreadable,
    DatabaseBusy,
    DatabaseReadOnly,
    DatabaseReplaced,
    HostClosing,
    HostConflict,
    HostFenced,
    InternalError,
    InvalidRpcRequest,
    MethodNotFound,
    ParseError,
    ProtocolError,
    SchemaMismatch,
    StoreError,
    StoreUnavailable,
)
from delegation.errors.input import (
    BadContextMode,
    BadLeaseId,
    BadPresetName,
    BadPriority,
    BadResume,
    BadSteer,
    ChildNotFound,
    CommandsWidened,
    DeadlineWidened,
    FsSearchEnabled,
    InputError,
    InputTooLarge,
    InvalidId,
    InvalidOptions,
    MalformedInput,
    NoExtensionsRelaxed,
    NoSkillsRelaxed,
    NoToolsRelaxed,
    OptionsWidened,
    PresetPromptConflict,
    PresetPromptTooLarge,
    PriorityAboveCap,
    ReleaseOwnerRequired,
    RequestIncomplete,
    TokenLimitRaised,
    ToolsWidened,
    TurnLimitWidened,
)
from delegation.errors.limits import (
    ConnectionLimit,
    FollowLimit,
    LeaseCapacity,
    LimitError,
    NestingLimit,
    PresetLimit,
    QueueFull,
    SteerLimit,
    StepLimit,
    StepTooLarge,
    SubmissionLimit,
)
from delegation.errors.rewind import (
    RewindNoAuthority,
    RewindRequiresResume,
    RewindRunUnknown,
    RewindStepUnknown,
)
from delegation.errors.waits import (
    EventBufferFull,
    EventClosed,
    EventTimeout,
    EventTooLarge,
    InputAnswered,
    InputClosed,
    InputInvalid,
    InputLimit,
    InputTimeout,
    InputUnknown,
    StepTimeout,
)

__all__ = [
    "ActiveSubmission",
    "AdmissionFailed",
    "AdmissionPending",
    "AmbiguousChild",
    "AuthorityError",
    "BadContextMode",
    "BadLeaseId",
    "BadPresetName",
    "BadPriority",
    "BadResume",
    "BadSteer",
    "CancelUnconfirmed",
    "ChildEnded",
    "ChildNotFound",
    "ChildNotOwned",
    "ChildPurged",
    "ChildUnreadable",
    "CommandsWidened",
    "ConflictError",
    "ConnectionLimit",
    "CwdOutsideWorkspace",
    "DatabaseBusy",
    "DatabaseReadOnly",
    "DatabaseReplaced",
    "DeadlineWidened",
    "DelegationError",
    "EventBufferFull",
    "EventClosed",
    "EventTimeout",
    "EventTooLarge",
    "FollowLimit",
    "FollowupRequiresRunId",
    "ForkRequiresTool",
    "FsSearchEnabled",
    "HostClosing",
    "HostConflict",
    "HostFenced",
    "IllegalTransition",
    "InputAnswered",
    "InputClosed",
    "InputError",
    "InputInvalid",
    "InputLimit",
    "InputTimeout",
    "InputTooLarge",
    "InputUnknown",
    "InternalError",
    "InvalidCwd",
    "InvalidId",
    "InvalidOptions",
    "InvalidRpcRequest",
    "LeaseCapacity",
    "LeaseMismatch",
    "LeaseNotActivated",
    "LeaseOwnerMismatch",
    "LimitError",
    "MalformedInput",
    "MethodNotFound",
    "NestingLimit",
    "NoExtensionsRelaxed",
    "NoSkillsRelaxed",
    "NoToolsRelaxed",
    "NotOwned",
    "NotPinned",
    "OptionsWidened",
    "ParseError",
    "PresetLimit",
    "PresetPromptConflict",
    "PresetPromptTooLarge",
    "PresetStale",
    "PriorityAboveCap",
    "ProtocolError",
    "QueueFull",
    "ReleaseOwnerRequired",
    "ReleaseUnconfirmed",
    "RequestIdReused",
    "RequestIncomplete",
    "ResumeMismatch",
    "RewindNoAuthority",
    "RewindRequiresResume",
    "RewindRunUnknown",
    "RewindStepUnknown",
    "RunnerNotFound",
    "SchemaMismatch",
    "StaleConnection",
    "SteerLimit",
    "SteerNotOwned",
    "SteerRequestIdReused",
    "StepLimit",
    "StepTimeout",
    "StepTooLarge",
    "StoreError",
    "StoreUnavailable",
    "SubmissionLimit",
    "TokenLimitRaised",
    "ToolAlreadyOpen",
    "ToolsWidened",
    "TurnLimitWidened",
]
