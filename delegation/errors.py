"""The one exception tree of delegation.

Every refusal the library makes is a :class:`DelegationError`. Each class carries
a stable machine ``reason`` (snake_case, never renamed once shipped) and the
JSON-RPC ``rpc_code`` it maps to; ``str(error)`` is the human message, and a
class's docstring is its default message. Messages quoted in docs/design.md are matched
by clients: keep them exactly as written.

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
    │   │   └── TurnLimitWidened
    │   ├── BadSteer
    │   ├── BadLeaseId
    │   ├── InvalidId                        an id that is not a valid ID
    │   ├── ChildNotFound                    no child by that id (host and operator calls)
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
    │   └── FollowupRequiresRunId
    ├── ConflictError                        the request collides with stored state
    │   ├── ActiveSubmission
    │   ├── RequestIdReused
    │   ├── SteerRequestIdReused
    │   ├── AdmissionFailed
    │   ├── ReleaseUnconfirmed
    │   ├── CancelUnconfirmed
    │   ├── ToolAlreadyOpen
    │   └── IllegalTransition
    ├── LimitError                           a cap of design §3.8
    │   ├── SubmissionLimit
    │   ├── LeaseCapacity
    │   ├── SteerLimit
    │   ├── PresetLimit
    │   ├── NestingLimit
    │   ├── FollowLimit                      follows of one serve connection
    │   ├── StepTooLarge                     a step's result (design §15)
    │   ├── StepLimit                        steps per execution (design §15)
    │   └── ConnectionLimit                  serve's streams at once (design §18)
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

from typing import ClassVar


class DelegationError(Exception):
    """delegation error"""

    reason: ClassVar[str] = "delegation_error"
    rpc_code: ClassVar[int] = -32602

    def __init__(self, message: str | None = None, *, detail: str = "") -> None:
        super().__init__(message if message is not None else self.default_message())
        self.detail = ""
        if detail:
            self.explain(detail)

    def explain(self, detail: str) -> DelegationError:
        """Say what exactly was missing or wrong, beside the message the contract fixes:
        a note on the traceback and ``detail`` on the error, in this process only: the
        wire's ``data`` stays ``{"reason": ...}`` (design §2.3)."""
        self.detail = detail
        self.add_note(detail)
        return self

    @classmethod
    def default_message(cls) -> str:
        return (cls.__doc__ or cls.reason).strip().splitlines()[0]

    @property
    def message(self) -> str:
        return str(self)


# --- input: decode and validation -------------------------------------------------


class InputError(DelegationError):
    """invalid child input"""

    reason = "invalid_input"


class MalformedInput(InputError):
    """malformed child input"""

    reason = "malformed_input"


class RequestIncomplete(InputError):
    """child requestId, profile and message are required"""

    reason = "request_incomplete"


class InputTooLarge(InputError):
    """child input exceeds limit"""

    reason = "input_exceeds_limit"


class BadContextMode(InputError):
    """child contextMode must be fresh or fork"""

    reason = "invalid_context_mode"


class BadResume(InputError):
    """child resume requires a valid owned conversation ID and cannot be combined with fork"""

    reason = "invalid_resume"


class BadPresetName(InputError):
    """execution preset requires a simple nonempty name"""

    reason = "invalid_preset_name"


class PresetPromptTooLarge(InputError):
    """execution preset prompt exceeds limit"""

    reason = "preset_prompt_exceeds_limit"


class PresetPromptConflict(InputError):
    """execution preset must use prompt content or a prompt path, not both"""

    reason = "preset_prompt_conflict"


class InvalidOptions(InputError):
    """invalid execution options"""

    reason = "invalid_options"


class OptionsWidened(InputError):
    """child execution options widen the parent's policy"""

    reason = "options_widened"


class NoToolsRelaxed(OptionsWidened):
    """child execution options cannot relax the parent's noTools"""

    reason = "no_tools_relaxed"


class NoSkillsRelaxed(OptionsWidened):
    """child execution options cannot relax the parent's noSkills"""

    reason = "no_skills_relaxed"


class NoExtensionsRelaxed(OptionsWidened):
    """child execution options cannot relax the parent's noExtensions"""

    reason = "no_extensions_relaxed"


class ToolsWidened(OptionsWidened):
    """child allowedTools must stay within the parent's allowedTools"""

    reason = "tools_widened"


class CommandsWidened(OptionsWidened):
    """child allowedCommands must stay within the parent's allowedCommands"""

    reason = "commands_widened"


class FsSearchEnabled(OptionsWidened):
    """child execution options cannot enable filesystem search the parent disabled"""

    reason = "fs_search_enabled"


class TokenLimitRaised(OptionsWidened):
    """child token limit exceeds the parent's"""

    reason = "token_limit_raised"


class TurnLimitWidened(OptionsWidened):
    """child maxTurns must be between 1 and the parent's maxTurns"""

    reason = "turn_limit_widened"


class BadSteer(InputError):
    """child steer requires requestId and a nonempty bounded message"""

    reason = "invalid_steer"


class BadLeaseId(InputError):
    """child leaseId must be a valid ID"""

    reason = "invalid_lease_id"


class InvalidId(InputError):
    """child handle must be a valid ID"""

    reason = "invalid_id"


class ChildNotFound(InputError):
    """child not found"""

    reason = "child_not_found"


class ReleaseOwnerRequired(InputError):
    """child lease release requires its exact owner"""

    reason = "release_owner_required"


# --- authority ----------------------------------------------------------------------


class AuthorityError(DelegationError):
    """child requires active tool ownership or an unexpired retained lease"""

    reason = "not_authorized"


class RunnerNotFound(AuthorityError):
    """runner not found"""

    reason = "runner_not_found"


class StaleConnection(AuthorityError):
    """runner connection generation is stale"""

    reason = "stale_connection"


class NotOwned(AuthorityError):
    """child requires active tool ownership or an unexpired retained lease"""

    reason = "not_owned"


class SteerNotOwned(AuthorityError):
    """child steering requires current owned authority"""

    reason = "steer_not_owned"


class PresetStale(AuthorityError):
    """execution preset absent or stale"""

    reason = "preset_absent_or_stale"


class LeaseMismatch(AuthorityError):
    """child lease mismatch"""

    reason = "lease_mismatch"


class LeaseOwnerMismatch(AuthorityError):
    """child lease owner mismatch"""

    reason = "lease_owner_mismatch"


class InvalidCwd(AuthorityError):
    """invalid child working directory"""

    reason = "invalid_cwd"


class CwdOutsideWorkspace(AuthorityError):
    """child working directory exceeds parent workspace"""

    reason = "cwd_outside_workspace"


class LeaseNotActivated(AuthorityError):
    """child retained authority requires successful initial admission from an active tool"""

    reason = "lease_not_activated"


class ForkRequiresTool(AuthorityError):
    """child fork requires the current active parent tool"""

    reason = "fork_requires_tool"


class ResumeMismatch(AuthorityError):
    """the child task cannot resume with a different parent, host or execution preset"""

    reason = "resume_mismatch"


class ChildNotOwned(AuthorityError):
    """child run is not owned by this capability"""

    reason = "child_not_owned"


class AmbiguousChild(AuthorityError):
    """childRunId is required for an ambiguous child handle"""

    reason = "ambiguous_child"


class FollowupRequiresRunId(AuthorityError):
    """childRunId is required after a child followup"""

    reason = "followup_requires_run_id"


# --- conflicts with stored state --------------------------------------------------


class ConflictError(DelegationError):
    """child request conflicts with stored state"""

    reason = "conflict"


class ActiveSubmission(ConflictError):
    """child conversation already has an active submission"""

    reason = "active_submission"


class RequestIdReused(ConflictError):
    """requestId was already used with different child input"""

    reason = "request_id_reused"


class SteerRequestIdReused(ConflictError):
    """steer requestId already used with different input"""

    reason = "steer_request_id_reused"


class AdmissionFailed(ConflictError):
    """child admission failed"""

    reason = "admission_failed"

    def __init__(self, error: str | None = None) -> None:
        base = self.default_message()
        super().__init__(f"{base}: {error}" if error else base)


class ReleaseUnconfirmed(ConflictError):
    """child lease revoked but cleanup is not yet confirmed; retry release"""

    reason = "release_unconfirmed"


class CancelUnconfirmed(ConflictError):
    """child cancellation cleanup is unconfirmed"""

    reason = "cancel_unconfirmed"


class ToolAlreadyOpen(ConflictError):
    """tool call is already open"""

    reason = "tool_already_open"


class IllegalTransition(ConflictError):
    """child state transition is not allowed"""

    reason = "illegal_transition"


# --- caps ---------------------------------------------------------------------------


class LimitError(DelegationError):
    """child limit exceeded"""

    reason = "limit_exceeded"


class StepTooLarge(LimitError):
    """child step result exceeds its limit"""

    reason = "step_too_large"


class StepLimit(LimitError):
    """child step limit exceeded"""

    reason = "step_limit"


class ConnectionLimit(LimitError):
    """too many connections: the host serves no more at once; try again later"""

    reason = "connection_limit"


class SubmissionLimit(LimitError):
    """child submission limit exceeded"""

    reason = "submission_limit"


class LeaseCapacity(LimitError):
    """child lease capacity exceeded"""

    reason = "lease_capacity"


class SteerLimit(LimitError):
    """child steer request limit exceeded"""

    reason = "steer_limit"


class PresetLimit(LimitError):
    """execution preset limit exceeded"""

    reason = "preset_limit"


class NestingLimit(LimitError):
    """child nesting limit exceeded"""

    reason = "nesting_limit"


class FollowLimit(LimitError):
    """too many follows on this connection"""

    reason = "follow_limit"


# --- JSON-RPC framing and faults --------------------------------------------------


class ProtocolError(DelegationError):
    """invalid JSON-RPC message"""

    reason = "protocol_error"
    rpc_code = -32600


class ParseError(ProtocolError):
    """parse error"""

    reason = "parse_error"
    rpc_code = -32700


class InvalidRpcRequest(ProtocolError):
    """invalid request"""

    reason = "invalid_request"
    rpc_code = -32600


class MethodNotFound(ProtocolError):
    """method not found"""

    reason = "method_not_found"
    rpc_code = -32601


class StoreError(DelegationError):
    """child store failed"""

    reason = "store_error"
    rpc_code = -32603


class DatabaseBusy(StoreError):
    """child store is busy; retry"""

    reason = "database_busy"


class StoreUnavailable(StoreError):
    """database is unavailable; try again"""

    reason = "store_unavailable"


class HostClosing(StoreError):
    """the host closed before the child was admitted; replay the requestId"""

    reason = "host_closing"


class SchemaMismatch(StoreError):
    """the file is not a delegation database this version can open"""

    reason = "schema_mismatch"


class HostConflict(StoreError):
    """database is in use by another live host"""

    reason = "host_conflict"


class HostFenced(HostConflict):
    """host instance was taken over by another host; its writes are refused"""

    reason = "host_fenced"


class DatabaseReplaced(StoreError):
    """database file was replaced while in use"""

    reason = "database_replaced"


class DatabaseReadOnly(StoreError):
    """database file is read-only"""

    reason = "database_read_only"


class ChildPurged(StoreError):
    """child record was purged after its retention period"""

    reason = "child_purged"
    rpc_code = -32602


class ChildUnreadable(StoreError):
    """stored child record is unreadable"""

    reason = "child_unreadable"
    rpc_code = -32602


class InternalError(DelegationError):
    """internal error"""

    reason = "internal_error"
    rpc_code = -32603
