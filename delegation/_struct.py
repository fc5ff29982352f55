"""The one msgspec base of every wire type, and the small facts they share."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1

# msgspec cannot express a bound above int64, so the upper uint64 bound is checked
# once after decoding (see codec); ``ge=0`` already refuses negatives.
Uint64 = Annotated[int, msgspec.Meta(ge=0)]
Int64 = Annotated[int, msgspec.Meta(ge=I64_MIN, le=I64_MAX)]

UINT64_FIELDS = frozenset({"generation", "after", "sequence"})


class WireStruct(
    msgspec.Struct,
    forbid_unknown_fields=True,
    omit_defaults=True,
    frozen=True,
    rename="camel",
):
    """Strict, frozen base: unknown fields are refused, empty optional fields omitted."""


def always(factory: type) -> Any:
    """A default for a field that is always written, even when empty or false.

    ``omit_defaults`` omits a value identical to its default; a factory default
    (other than an empty collection) never counts as the default, so the field
    stays on the wire. That is how unmarked fields of design §2 are kept present.
    """
    return msgspec.field(default_factory=factory)


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


# Unicode white space as Go's strings.TrimSpace sees it: Python's str.isspace() also
# counts the separators U+001C..U+001F, which the Go contract keeps as content.
_SPACE = "".join(
    ch for ch in map(chr, range(0x3001)) if ch.isspace() and not "\x1c" <= ch <= "\x1f"
)


def blank(text: str) -> bool:
    """True when ``text`` is empty after trimming white space (as the Go original trims)."""
    return not text.strip(_SPACE)


def has_nul(text: str) -> bool:
    return "\x00" in text
