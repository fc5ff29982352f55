"""A single-process host in one line: :class:`LocalHost` (design §30).

Everything a host sets up before its first child (a runner connection, an open tool
call with a workspace and a preset, a lease) made through the engine's public calls,
as a real host makes them, so that a newcomer's first child needs a name and nothing
else invented.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from types import TracebackType

from delegation.config import EngineConfig
from delegation.engine import Engine
from delegation.records import RunnerConnection, ToolHandle
from delegation.run.context import Recovery, Run
from delegation.wire import Event, Identity, Params, Preset, Request, Result, valid_id

# The ids one local host always uses: a restarted script must present the same ones
# (the same host instance keeps its leases; a new one would cancel their children).
RUNNER_ID = "local"
HOST_INSTANCE_ID = "local"
EXTENSION_ID = "local"
GENERATION = 1
PRESET = "default"
RUN_ID = "local-run"
CONVERSATION_ID = "local-conversation"
TOOL_CALL_ID = "local-call"


class _OneRun:
    """The runner of a local host: every child runs the same ``run``."""

    def __init__(self, run: Run) -> None:
        self._run = run

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        return self._run


class LocalHost:
    """One process, one database, one function: the smallest host there is.

    ``async with LocalHost("first.db", run) as host`` opens an :class:`Engine` on
    ``url`` (a SQLite path or URL, or a PostgreSQL URL) whose runner runs ``run(ctx)``
    for every child, then, through the engine's public calls and its authority checks:

    1. ``engine.connect(runner_id="local", host_instance_id="local")``: a runner
       connection, always the same host instance, so a restarted script keeps its
       leases and their children;
    2. ``engine.open_tool(...)``: the tool call ``local-run``/``local-call`` of the
       extension ``local`` (process generation 1), its workspace ``workspace`` (the
       current directory by default), with one preset, ``default``.

    :meth:`start` then starts a child under a lease of its own: ``name`` is both the
    lease id (``lease-<name>``) and the start's request id, so the same name again
    (this run or after a restart) is the same child, never a second one. A leased child
    outlives its tool call and its process: kill the script and run it again, and the
    engine resumes the child on opening (its recorded ``ctx.step`` results come back
    without running again). Leaving the ``async with`` closes the tool call (a leased
    child is not cancelled by it) and the connection, then the engine.

    ``host.engine``, ``host.conn`` and ``host.tool`` are the engine, connection and
    tool call, for everything else (``engine.read``, ``steer``, ``cancel`` and
    ``release`` with ``run_id="local-run"``, ``extension_id="local"``,
    ``generation=1`` and the child's lease id). Refusals are the engine's :class:`DelegationError`.
    """

    def __init__(
        self,
        url: str,
        run: Run,
        *,
        workspace: str = ".",
        config: EngineConfig | None = None,
    ) -> None:
        self.engine = Engine(url, runner=_OneRun(run), config=config)
        self.workspace = os.path.abspath(workspace)
        self._conn: RunnerConnection | None = None
        self._tool: ToolHandle | None = None

    @property
    def conn(self) -> RunnerConnection:
        """The runner connection (``RuntimeError`` before :meth:`open`)."""
        if self._conn is None:
            raise RuntimeError("the local host is not open")
        return self._conn

    @property
    def tool(self) -> ToolHandle:
        """The open tool call (``RuntimeError`` before :meth:`open`)."""
        if self._tool is None:
            raise RuntimeError("the local host is not open")
        return self._tool

    async def __aenter__(self) -> LocalHost:
        await self.open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Open the engine (resuming this database's leased children), connect the
        runner and open the tool call."""
        await self.engine.open()
        try:
            self._conn = await self.engine.connect(RUNNER_ID, HOST_INSTANCE_ID)
            preset = Preset(name=PRESET, extension_id=EXTENSION_ID, generation=GENERATION)
            self._tool = await self.engine.open_tool(
                self._conn,
                run_id=RUN_ID,
                conversation_id=CONVERSATION_ID,
                tool_call_id=TOOL_CALL_ID,
                extension_id=EXTENSION_ID,
                presets=[preset],
                workspace=self.workspace,
            )
        except BaseException:
            await self.engine.close()
            raise

    async def close(self) -> None:
        """Close the tool call and the connection (leases and their children stay),
        then the engine."""
        try:
            if self._tool is not None:
                await self.engine.close_tool(self._tool)
            if self._conn is not None:
                await self.engine.disconnect(self._conn)
        finally:
            self._tool = self._conn = None
            await self.engine.close()

    async def start(self, name: str, message: str = "") -> Result:
        """Start the child ``name`` (an id: no space or ``/``, at most 122 bytes) with
        ``message`` as its request's message, under the lease ``lease-<name>``; its
        Result once admitted. The same name and message again is the same child (done
        or still running); the same name with another message is ``RequestIdReused``.
        """
        if not valid_id(f"lease-{name}"):
            raise ValueError(f"a child's name is an id (no space, '/' or control): {name!r}")
        lease = f"lease-{name}"
        request = Request(request_id=name, profile=PRESET, message=message, lease_id=lease)
        return await self.engine.start(self.conn, self._params(lease, request))

    def follow(self, child: Result, after: int = 0) -> AsyncIterator[Event]:
        """Every event of ``child`` after ``after``, as each commits; ends with the
        child (see :meth:`Engine.follow`)."""
        return self.engine.follow(child.conversation_id, after=after)

    def _params(self, lease_id: str, request: Request) -> Params:
        return Params(
            run_id=RUN_ID,
            tool_call_id=TOOL_CALL_ID,
            extension_id=EXTENSION_ID,
            generation=GENERATION,
            lease_id=lease_id,
            request=request,
        )
