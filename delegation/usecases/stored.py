"""A child's snapshot read back from its row: the request, preset and effective options
its start stored (design §4, §14), and what it runs with again after a restart.

They were validated when the child was reserved and are read back without validating.
A row that no longer decodes (bytes changed under the engine: a hand edit, a tool, a
damaged restore) is that one child's fault, never its host's: every reader of a stored
snapshot goes through here, and is refused with :class:`errors.ChildUnreadable` ("stored
child record is unreadable"), never with a msgspec error (design §18).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from delegation import errors
from delegation.options import ExecutionOptions, effective_options
from delegation.records import ChildRecord
from delegation.wire import Preset, Request

_request = msgspec.json.Decoder(Request)
_preset = msgspec.json.Decoder(Preset)
_options = msgspec.json.Decoder(ExecutionOptions)
# What a decoder raises for bytes that are not the stored shape (see codec.decode).
_UNDECODABLE = (msgspec.MsgspecError, ValueError, TypeError, RecursionError)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a child's start stored, decoded."""

    request: Request  # as it was sent
    preset: Preset  # as it was registered then
    options: ExecutionOptions | None  # effective at its start; None: before revision 0011


def of(child: ChildRecord) -> Snapshot:
    """The snapshot ``child``'s row stores.

    Raises:
        errors.ChildUnreadable: its request, preset or options no longer decode.
    """
    return snapshot(child.request, child.preset, child.options)


def snapshot(request: bytes, preset: bytes, options: bytes | None) -> Snapshot:
    """The snapshot stored as these bytes (see :func:`of`)."""
    try:
        stored = Snapshot(
            _request.decode(request),
            _preset.decode(preset),
            None if options is None else _options.decode(options),
        )
    except _UNDECODABLE as exc:
        raise errors.ChildUnreadable() from exc
    if not _whole(stored.request, stored.preset):
        raise errors.ChildUnreadable()
    return stored


def _whole(request: Request, preset: Preset) -> bool:
    """Whether what every start stores is there: the fields a start requires (it was
    validated then), which decoding alone fills with defaults when they are missing."""
    needed = (request.request_id, request.profile, request.message, preset.name)
    return all(text.strip() for text in needed) and bool(preset.extension_id and preset.generation)


def for_run(
    request: bytes, preset: bytes, options: bytes | None, policy: bytes | None
) -> tuple[Request, Preset, ExecutionOptions]:
    """What a stored child runs with again (after a restart): its request and preset,
    and its effective options: those stored at its start, or for a child reserved
    before they were stored, its preset's and request's under its grant's ``policy``.

    Raises:
        errors.ChildUnreadable: one of them no longer decodes, or they no longer fit
            together (they did when the child was reserved).
    """
    stored = snapshot(request, preset, options)
    if stored.options is not None:
        return stored.request, stored.preset, stored.options
    try:
        ceiling = None if policy is None else _options.decode(policy)
        effective = effective_options(ceiling, stored.preset, stored.request)
    except (*_UNDECODABLE, errors.InputError) as exc:
        raise errors.ChildUnreadable() from exc
    return stored.request, stored.preset, effective
