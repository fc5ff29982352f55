"""The pydantic-ai tests need the ``pydantic-ai`` extra: they skip without it, unless
``DELEGATION_REQUIRE_PYDANTIC_AI=1`` (CI's ``.ci/run`` sets it): then its absence fails."""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ENV = "DELEGATION_REQUIRE_PYDANTIC_AI"


def require_pydantic_ai() -> None:
    """Skip the calling test module without pydantic-ai (fail under ``REQUIRE_ENV``)."""
    if importlib.util.find_spec("pydantic_ai") is not None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 requires pydantic-ai: pip install -e '.[pydantic-ai]'")
    pytest.skip("pydantic-ai is not installed (the pydantic-ai extra)", allow_module_level=True)
