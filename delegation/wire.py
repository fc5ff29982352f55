"""The wire contract of design §2: method names, message types and their validation.

JSON names are camelCase and exact; Python attributes are their snake_case forms.
Fields the spec marks optional are omitted on output when empty or false; the
others are always written. Wire types never import persistence.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from delegation import errors
from delegation._struct import Int64, Uint64, WireStruct, always, blank, has_nul, utf8_len
from delegation.options import PROVIDERS, ExecutionOptions

START_METHOD = "child.start"
READ_METHOD = "child.read"
CANCEL_METHOD = "child.cancel"
STEER_METHOD = "child.steer"
RELEASE_METHOD = "child.lease.release"
# design §21: the answer to a child's input request (a person's, an approval's).
INPUT_METHOD = "child.input"
# design §33: an event for a child's conversation, from the extension that holds it.
SEND_METHOD = "child.send"
# The five child methods' wire names (design §2), in the seed's order.
CHILD_METHODS: tuple[str, ...] = (
    START_METHOD,
    READ_METHOD,
    CANCEL_METHOD,
    STEER_METHOD,
    RELEASE_METHOD,
)

MAX_ID_BYTES = 128
MAX_MESSAGE_BYTES = 512 * 1024
MAX_SYSTEM_PROMPT_BYTES = 256 * 1024
MAX_PATH_BYTES = 8192
CONTEXT_MODES = frozenset({"", "fresh", "fork"})


def valid_id(value: str) -> bool:
    """An opaque conversation, run or request identifier, never a path.

    Non-empty, not ``.`` or ``..``, at most 128 bytes, no ``/`` or ``\\``, and no
    character at or below U+0020 nor U+007F.
    """
    if not isinstance(value, str) or value in ("", ".", ".."):
        return False
    # At most 4 bytes a character: a short id needs no encoding to be measured.
    if len(value) * 4 > MAX_ID_BYTES and utf8_len(value) > MAX_ID_BYTES:
        return False
    return _ID_FORBIDDEN.search(value) is None


# Separators, controls and space, DEL: what an id may not hold (every call checks ids).
_ID_FORBIDDEN = re.compile(r"[\x00-\x20\x7f/\\]")


def _validate_priority(priority: int | UnsetType) -> None:
    if priority is not UNSET and not 0 <= priority <= 9:
        raise errors.BadPriority()


def priority_of(request: Request, preset: Profile) -> int:
    """A child's admission priority (design §22): its request's, else its preset's, else 5."""
    if request.priority is not UNSET:
        return request.priority
    return preset.priority if preset.priority is not UNSET else 5


def _validate_options(options: ExecutionOptions | UnsetType, providers: Iterable[str]) -> None:
    if options is not UNSET:
        options.validate(providers)


class Profile(WireStruct, frozen=True):
    """A named execution profile owned by one extension process."""

    name: str = always(str)
    options: ExecutionOptions | UnsetType = UNSET
    system_prompt_path: str = ""
    system_prompt: str = ""
    # The priority of its children when a request gives none (design §22).
    priority: Int64 | UnsetType = UNSET

    def validate(self, providers: Iterable[str] = PROVIDERS) -> None:
        """Raise the first :class:`errors.InputError` that applies (design §2.2)."""
        name = self.name
        if (
            blank(name)
            or utf8_len(name) > MAX_ID_BYTES
            or "/" in name
            or "\\" in name
            or has_nul(name)
        ):
            raise errors.BadPresetName()
        if (
            utf8_len(self.system_prompt) > MAX_SYSTEM_PROMPT_BYTES
            or utf8_len(self.system_prompt_path) > MAX_PATH_BYTES
        ):
            raise errors.PresetPromptTooLarge()
        if self.system_prompt and self.system_prompt_path:
            raise errors.PresetPromptConflict()
        _validate_priority(self.priority)
        _validate_options(self.options, providers)


class Preset(Profile, frozen=True):
    """A Profile stamped with the extension and the process generation that own it."""

    extension_id: str = always(str)
    generation: Uint64 = always(int)


# A step name's bound (the journal's, design §15): a longer one was never recorded.
MAX_STEP_NAME_BYTES = 1024


class Rewind(WireStruct, frozen=True):
    """A follow-up's rewind (design §35): seed the new execution from the ended execution
    ``run_id`` of the conversation: the steps it recorded before ``step`` (every step
    when omitted) and the events committed with them."""

    run_id: str = always(str)
    step: str | UnsetType = UNSET

    def validate(self) -> None:
        """A run id that can name no execution is unknown here; a step name is judged
        against the source's steps, after the source (design §35's order)."""
        if not valid_id(self.run_id):
            raise errors.RewindRunUnknown()


class Request(WireStruct, frozen=True):
    """What a caller asks a child to do. It never carries credentials or endpoints."""

    context_mode: str = ""
    resume: str = ""
    request_id: str = always(str)
    profile: str = always(str)
    message: str = always(str)
    options: ExecutionOptions | UnsetType = UNSET
    system_prompt: str = ""
    cwd: str = ""
    lease_id: str = ""
    # Admission order (design §22): 0-9, higher first; omitted: the preset's, else 5.
    priority: Int64 | UnsetType = UNSET
    # A follow-up seeded from a recorded step of an ended execution (design §35).
    rewind: Rewind | UnsetType = UNSET

    def validate(self, providers: Iterable[str] = PROVIDERS) -> None:
        """Raise the first :class:`errors.InputError` that applies (design §2.2)."""
        if (
            blank(self.request_id)
            or utf8_len(self.request_id) > MAX_ID_BYTES
            or blank(self.profile)
            or blank(self.message)
        ):
            raise errors.RequestIncomplete()
        if (
            utf8_len(self.message) > MAX_MESSAGE_BYTES
            or utf8_len(self.system_prompt) > MAX_SYSTEM_PROMPT_BYTES
            or utf8_len(self.cwd) > MAX_PATH_BYTES
        ):
            raise errors.InputTooLarge()
        if self.context_mode not in CONTEXT_MODES:
            raise errors.BadContextMode()
        if self.resume and (not valid_id(self.resume) or self.context_mode == "fork"):
            raise errors.BadResume()
        if self.rewind is not UNSET:
            if not self.resume:
                raise errors.RewindRequiresResume()
            self.rewind.validate()
        _validate_priority(self.priority)
        _validate_options(self.options, providers)


class Params(WireStruct, frozen=True):
    """The params of every child method; sent only on an authenticated connection."""

    run_id: str = always(str)
    tool_call_id: str = ""
    extension_id: str = always(str)
    generation: Uint64 = always(int)
    request: Request | UnsetType = UNSET
    child_id: str = ""
    child_run_id: str = ""
    message: str = ""
    request_id: str = ""
    lease_id: str = ""
    after: Uint64 = 0
    # child.input (design §21): which input request, and the option chosen (an
    # approval's ``approve`` or ``deny``); ``message`` is a text answer.
    input_id: str = ""
    decision: str = ""
    # child.send (design §33): the event's key and its payload (any JSON).
    key: str = ""
    data: Any = None


class Identity(WireStruct, frozen=True):
    """Who a child is: its own ids, its parent's, its owner and its profile."""

    runner_id: str = ""
    host_instance_id: str = ""
    conversation_id: str = always(str)
    run_id: str = always(str)
    parent_conversation_id: str = always(str)
    parent_run_id: str = always(str)
    extension_id: str = always(str)
    profile: str = always(str)


class Event(WireStruct, frozen=True, kw_only=True):
    """One thing a child did. ``sequence`` is assigned by the engine, from 1."""

    sequence: Uint64 = always(int)
    kind: str
    text: str = ""
    tool_name: str = ""
    tool_call_id: str = ""
    input: str = ""
    tool_output: str = ""
    success: bool | None = None  # absent means unknown
    error: str = ""


class InputRequest(WireStruct, frozen=True):
    """What a waiting child asks (design §21): an ``input`` (text, or one of
    ``options``) or an ``approval`` (of a tool call: ``approve`` or ``deny``)."""

    kind: str
    prompt: str = ""
    tool_name: str = ""
    tool_call_id: str = ""
    input: str = ""
    options: list[str] = msgspec.field(default_factory=list)
    expires_at: str = ""  # RFC 3339, UTC; empty: no timeout


class Result(Identity, frozen=True):
    """A child's identity, its state, and one page of its events. A child that asks
    carries its open ``inputRequests`` by inputId (absent otherwise, as in the seed)."""

    done: bool = always(bool)
    cancelled: bool = False
    error: str = ""
    output: str = ""
    events: list[Event] = msgspec.field(default_factory=list)
    input_requests: dict[str, InputRequest] = msgspec.field(default_factory=dict)
    # Waiting its turn (design §22): ``queuePosition`` 1 is next. Absent otherwise.
    queued: bool = False
    queue_position: Uint64 = 0
    # Pinned to the runner version that ran it (design §34): no host of another version
    # runs it. Absent otherwise.
    pinned_version: str = ""


STEER_INJECTED = "injected"
STEER_PROMPT_REQUIRED = "promptRequired"
STEER_NO_RUNNING_TURN = "noRunningTurn"


class SteerResult(WireStruct, frozen=True):
    """The outcome of a steer: ``injected``, or ``promptRequired`` with a reason."""

    outcome: str
    reason: str = ""


# What the child methods take (Engine's and Client's): Params, the JSON of them, or a
# mapping of wire (camelCase) names.
ParamsLike = Params | bytes | bytearray | memoryview | str | Mapping[str, Any]
