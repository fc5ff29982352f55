"""The read models for people and scripts: a child, a step, a lease as JSON (the wire's
camelCase names; a time stored unreadable as null), and a lease's status and a span of
time as text. What ``delegation … --json`` prints and the web page serves alike; and
:func:`number`, a number a query gives (the page's, the A2A face's page token)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, TypeVar, cast

from delegation import errors
from delegation.records import ChildRecord, LeaseRecord, StepRow
from delegation.store.steps import PATCH_PREFIX

T = TypeVar("T")

UNREADABLE = "unreadable"  # what a table shows for a time stored as no number


def child_json(record: ChildRecord) -> dict[str, Any]:
    """A child record for scripts, named as the wire names it (camelCase: the runner's
    ``runner_host_instance_id`` is the wire's ``hostInstanceId``), request, preset and
    options decoded."""
    values = wire_names(dataclasses.asdict(record))
    # Versions (design §34) only when set: an unversioned child shows what it always did.
    for name in _VERSION_FIELDS:
        if values.get(name) is None:
            values.pop(name, None)
    if record.rewound_from is None:  # a rewind's lineage (design §35), only for one
        values.pop("rewoundFrom", None)
        values.pop("rewoundStep", None)
    values["request"] = _decoded(record.request)
    values["preset"] = _decoded(record.preset)
    # The effective options at its start (design §14); None for a child from before them.
    values["options"] = None if record.options is None else _decoded(record.options)
    return values


_VERSION_FIELDS = ("version", "attemptVersion", "pinnedVersion", "unpinnedAt")
# A record's field whose wire name is not its camelCase form.
_WIRE_NAMES = {"runner_host_instance_id": "hostInstanceId"}


def wire_names(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the wire's camelCase names: ``conversation_id`` is
    ``conversationId``, as in ``Result``; a field only the database has is named the same
    way (``created_at``: ``createdAt``)."""
    return {_WIRE_NAMES.get(key) or camel(key): value for key, value in values.items()}


def camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


def _decoded(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def step_json(step: StepRow, version: str | None = None) -> dict[str, Any]:
    """A recorded step for scripts: name, place, size in bytes and time, never its value;
    the runner ``version`` that recorded it when known, and a patch marker's ``patch``
    (its name in ``ctx.patched``: design §34)."""
    shown: dict[str, Any] = {
        "name": step.name,
        "ordinal": step.ordinal,
        "size": step.size,
        "recordedAt": json_safe(step.recorded_at),
    }
    if version is not None:
        shown["version"] = version
    patch = patch_name(step.name)
    if patch is not None:
        shown["patch"] = patch
    return shown


def patch_name(name: str) -> str | None:
    """The patch a step's name marks (``ctx.patched``), or None for a step."""
    return name.removeprefix(PATCH_PREFIX) if name.startswith(PATCH_PREFIX) else None


def lease_status(lease: LeaseRecord, now: float) -> str:
    """``revoked (reason)``, ``live``, ``overdue`` or ``expires in 59m 12s``."""
    if lease.revoked_at is not None:
        return f"revoked ({lease.revoke_reason})" if lease.revoke_reason else "revoked"
    if lease.expires_at is None:
        return "live"
    if not math.isfinite(lease.expires_at):
        return f"expiry {UNREADABLE}"
    left = lease.expires_at - now
    return "overdue" if left <= 0 else f"expires in {duration(left)}"


def duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return UNREADABLE
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    units = ((days, "d"), (hours, "h"), (minutes, "m"), (secs, "s"))
    shown = [f"{n}{unit}" for n, unit in units if n][:2]
    return " ".join(shown) or "0s"


def json_safe(value: T) -> T:
    """``value`` with every float JSON has no number for (NaN: a time stored unreadable;
    infinities) as null: ``json.dumps`` would write ``NaN``, which no JSON parser reads."""
    safe: Any = value
    if isinstance(value, float) and not math.isfinite(value):
        safe = None
    elif isinstance(value, dict):
        safe = {key: json_safe(item) for key, item in value.items()}
    elif isinstance(value, list):
        safe = [json_safe(item) for item in value]
    return cast(T, safe)


def number(text: str | None, name: str, least: int, most: int, default: int) -> int:
    """``text`` as a whole number from ``least`` to ``most``; ``default`` when absent
    or empty. Only ASCII digits count (``"²".isdigit()`` is true), and no more of them
    than ``most`` has, so nothing long is ever converted.

    Raises:
        errors.InputError: anything else, in one line naming ``name``.
    """
    if not text:
        return default
    if len(text) <= len(str(most)) and text.isascii() and text.isdigit():
        value = int(text)
        if least <= value <= most:
            return value
    raise errors.InputError(f"{name} must be a whole number from {least} to {most}")
