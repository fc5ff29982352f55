"""What other tests use of contract/test_properties.py, kept here so that no test module
imports another: WIRE_TYPES."""

from __future__ import annotations

from delegation import (
    Event,
    ExecutionOptions,
    Identity,
    Params,
    Preset,
    Profile,
    Request,
    Result,
    SteerResult,
)
from delegation._struct import WireStruct

WIRE_TYPES: tuple[type[WireStruct], ...] = (
    ExecutionOptions,
    Profile,
    Preset,
    Request,
    Params,
    Identity,
    Event,
    Result,
    SteerResult,
)
