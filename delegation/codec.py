"""Strict decoding and encoding of wire values (design §2.1).

``decode`` is the only way wire bytes become values. It refuses anything that is
not exactly one JSON object of the expected shape, and raises only
:class:`errors.DelegationError`: never a msgspec, JSON or Unicode error. Decoding
builds a new value, so a failed decode leaves every earlier value untouched.
"""

from __future__ import annotations

import datetime
import decimal
import uuid
from collections.abc import Iterable
from functools import cache
from typing import Any, TypeVar

import msgspec

from delegation import errors
from delegation._struct import U64_MAX, UINT64_FIELDS, WireStruct
from delegation.options import PROVIDERS, ExecutionOptions

T = TypeVar("T", bound=WireStruct)

_encoder = msgspec.json.Encoder()


@cache
def _decoder(kind: type[Any]) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


def decode(
    data: bytes | bytearray | memoryview | str,
    type: type[T],  # noqa: A002 - the name msgspec uses
    *,
    providers: Iterable[str] = PROVIDERS,
) -> T:
    """Decode one JSON object of type ``type``, strictly.

    Refuses trailing data, non-objects, unknown fields at every level, ``null``
    where a value is required, wrong types, integers out of range, and invalid
    ExecutionOptions (which are validated as part of decoding).

    Raises:
        errors.MalformedInput: the bytes are not the wire shape of ``type``.
        errors.InvalidOptions: a nested ExecutionOptions value is invalid.
    """
    try:
        value: T = _decoder(type).decode(data)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise errors.MalformedInput(f"malformed child input: {exc}") from exc
    _check(value, "$", tuple(providers), "malformed child input")
    return value


# What ``to_builtins`` would turn into text (bytes into base64, a UUID into its string):
# kept as they are, so a field typed ``str`` refuses them as no JSON could carry them.
_AS_IS = (
    bytes,
    bytearray,
    memoryview,
    datetime.datetime,
    datetime.date,
    datetime.time,
    datetime.timedelta,
    uuid.UUID,
    decimal.Decimal,
)


def checked(
    value: object,
    kind: type[T],
    *,
    providers: Iterable[str] | None = PROVIDERS,
    label: str = "malformed child input",
) -> T:
    """``value``, a wire value built in Python, checked as :func:`decode` checks its JSON.

    msgspec checks no type when a Struct is constructed (``Request(message=123)`` is
    built), so a typed value is converted once more into ``kind``, field by field: the
    same refusal as on the wire, with the same words (``Expected `str`, got `int` - at
    `$.request.message```). Returns the value as decoding would have built it. With
    ``providers`` None, nested ExecutionOptions are checked for their types only (a
    client does not know its host's providers).

    Raises:
        errors.MalformedInput: ``value`` is not a ``kind`` of the wire's shape; its
            message starts with ``label``.
        errors.InvalidOptions: a nested ExecutionOptions value is invalid.
    """
    try:
        built: T = msgspec.convert(msgspec.to_builtins(value, builtin_types=_AS_IS), kind)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise errors.MalformedInput(f"{label}: {exc}") from exc
    _check(built, "$", None if providers is None else tuple(providers), label)
    return built


def encode(value: WireStruct) -> bytes:
    """The JSON bytes of a wire value, with optional empty fields omitted."""
    return _encoder.encode(value)


def _check(value: WireStruct, path: str, providers: tuple[str, ...] | None, label: str) -> None:
    """What msgspec cannot say in a type: uint64's upper bound, options validity."""
    if isinstance(value, ExecutionOptions):
        if providers is not None:
            value.validate(providers)
        return
    for name, encode_name, uint64 in _plan(type(value)):
        item = getattr(value, name)
        if uint64:
            if isinstance(item, int) and item > U64_MAX:
                where = f"{path}.{encode_name}"
                raise errors.MalformedInput(f"{label}: {where} exceeds uint64")
        elif isinstance(item, WireStruct):
            _check(item, f"{path}.{encode_name}", providers, label)
        elif isinstance(item, list):
            for index, element in enumerate(item):
                if isinstance(element, WireStruct):
                    _check(element, f"{path}.{encode_name}[{index}]", providers, label)


@cache
def _plan(kind: type[WireStruct]) -> tuple[tuple[str, str, bool], ...]:
    """(attribute, JSON name, uint64?) of the fields of a wire type :func:`_check` looks
    at: the uint64s and those that may hold wire values (every call checks a start's)."""
    info = msgspec.inspect.type_info(kind)
    assert isinstance(info, msgspec.inspect.StructType)
    return tuple(
        (f.name, f.encode_name, f.name in UINT64_FIELDS)
        for f in info.fields
        if f.name in UINT64_FIELDS or _nests(f.type)
    )


def _nests(kind: msgspec.inspect.Type) -> bool:
    """Whether a value of this type may be, or be a list of, wire values."""
    if isinstance(kind, msgspec.inspect.StructType):
        return True
    if isinstance(kind, msgspec.inspect.UnionType):
        return any(_nests(member) for member in kind.types)
    if isinstance(kind, msgspec.inspect.ListType):
        return _nests(kind.item_type)
    return False
