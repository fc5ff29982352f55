"""Strict decoding and encoding of wire values (design §2.1).

``decode`` is the only way wire bytes become values. It refuses anything that is
not exactly one JSON object of the expected shape, and raises only
:class:`errors.DelegationError`: never a msgspec, JSON or Unicode error. Decoding
builds a new value, so a failed decode leaves every earlier value untouched.
"""

from __future__ import annotations

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
    _check(value, "$", tuple(providers))
    return value


def encode(value: WireStruct) -> bytes:
    """The JSON bytes of a wire value, with optional empty fields omitted."""
    return _encoder.encode(value)


def _check(value: WireStruct, path: str, providers: tuple[str, ...]) -> None:
    """What msgspec cannot say in a type: uint64's upper bound, options validity."""
    if isinstance(value, ExecutionOptions):
        value.validate(providers)
        return
    for name, encode_name in _fields(type(value)):
        item = getattr(value, name)
        if name in UINT64_FIELDS and isinstance(item, int) and item > U64_MAX:
            where = f"{path}.{encode_name}"
            raise errors.MalformedInput(f"malformed child input: {where} exceeds uint64")
        if isinstance(item, WireStruct):
            _check(item, f"{path}.{encode_name}", providers)
        elif isinstance(item, list):
            for index, element in enumerate(item):
                if isinstance(element, WireStruct):
                    _check(element, f"{path}.{encode_name}[{index}]", providers)


@cache
def _fields(kind: type[WireStruct]) -> tuple[tuple[str, str], ...]:
    """(attribute, JSON name) of a wire type; msgspec re-reads annotations on every call."""
    return tuple((f.name, f.encode_name) for f in msgspec.structs.fields(kind))
