"""The pydantic-ai runner carries a version (SPEC §27, issue 48): ``version=`` and
``resumes=`` of its constructor and of ``from_module``, checked when it is made, recorded
by the engine on every child it runs. On pydantic-ai's test model only (no network)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.pydantic_ai_support import require_pydantic_ai

require_pydantic_ai()

from pydantic_ai import Agent, models  # noqa: E402
from pydantic_ai.models.test import TestModel  # noqa: E402

from delegation import Engine, EngineConfig  # noqa: E402
from delegation.runners.pydantic_ai import PydanticAIRunner, from_module  # noqa: E402
from tests.harness.support import PRESET, open_harness  # noqa: E402


@pytest.fixture(autouse=True)
def no_model_requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("DELEGATION_RUNNER_VERSION", raising=False)
    with models.override_allow_model_requests(False):
        yield


def agent() -> Agent[None, str]:
    return Agent(TestModel(custom_output_text="reviewed"))


def test_by_default_it_is_unversioned() -> None:
    runner = PydanticAIRunner({"worker": agent()})
    assert (runner.version, runner.resumes) == (None, ())


@pytest.mark.parametrize(
    ("version", "resumes"),
    [("", ()), ("v" * 129, ()), (" v1", ()), ("v1", "v0"), ("v1", ["v0", ""]), (3, ())],
)
def test_a_bad_version_or_resumes_is_refused_when_it_is_made(
    version: object, resumes: object
) -> None:
    with pytest.raises(ValueError, match="runner version"):
        PydanticAIRunner({"worker": agent()}, version=version, resumes=resumes)  # type: ignore[arg-type]


def test_from_module_takes_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("agents_for_version_test")
    module.AGENTS = {"worker": agent()}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    runner = from_module(f"{module.__name__}:AGENTS", version="v2", resumes=["v1"])
    assert (runner.version, runner.resumes) == ("v2", ("v1",))
    assert from_module(f"{module.__name__}:AGENTS").version is None


async def test_a_child_it_runs_records_its_version(db_url: str, workspace: Path) -> None:
    runner = PydanticAIRunner({PRESET.name: agent()}, version="2026.12.1", resumes=("2026.11",))
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        assert engine.config.runner_resumes == ("2026.11",)
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        record = await h.wait_done(started.conversation_id, timeout=20)
    assert (record.state, record.error, record.output) == ("done", "", "reviewed")
    assert (record.version, record.attempt_version) == ("2026.12.1", "2026.12.1")
