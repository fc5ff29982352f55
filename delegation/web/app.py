"""``delegation web``: a live, read-only page of a delegation database (design §13).

One small HTML page with plain JavaScript (``delegation/web/page/``, no build step,
nothing fetched from elsewhere) shows the children (state, profile, parent, age, a
badge on one pinned to a runner version; filters by state and lease), one child's
events streaming live over Server-Sent Events beside the steps it recorded (design §15:
name, size, when; never a value), and the leases. The server is a Starlette app run by
uvicorn; it reads through an :class:`Inspector`, the read API of ``delegation
children``/``events --follow``, so it is safe beside a live host and never writes.

* **Live, not polled by the page.** One watch on the database for the whole server
  (:func:`stores.open_watch`: SQLite's ``PRAGMA data_version``, PostgreSQL's
  ``LISTEN``) moves a version; each open stream follows its child with
  :mod:`delegation.usecases.follow` woken by it, as ``Inspector.follow`` does, and reads tables
  only after it moved.
* **Read-only.** GET (and HEAD) routes only: anything else is 405. With ``--a2a`` the
  A2A face (:mod:`delegation.web.a2a`, design §29) is the app's one writer: its POST
  endpoint gives operator controls only, as ``delegation cancel/input/steer`` do.
* **What a child wrote is text.** It reaches the page as JSON and is put in the page
  with ``textContent``, never as HTML; a Content-Security-Policy allows this server's
  own script only, so even a slip could not run a child's ``<script>``.
* **Bounded.** Each event stream holds at most ``MAX_UNSENT_BYTES`` its client has not
  taken, and one whose client stops taking what its child writes is dropped
  (:mod:`delegation.web.stream`); lists read the columns they show, never a child's
  stored request (:class:`~delegation.records.ChildSummary`).
* **Every answer is safe to show.** Errors too carry the Content-Security-Policy and
  ``nosniff``; a query value that is not a number in range is a one-line 400.
* **Localhost.** It binds 127.0.0.1 by default and answers only requests whose
  ``Host`` names the address it was bound to (a web page elsewhere cannot reach it
  through DNS rebinding).
* **A token.** Every request shows the random token the server printed, in its query
  or its cookie (:mod:`delegation.web.token`), or gets 401: another local user who
  reaches the port reads nothing. ``--no-token`` serves without, for a trusted machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import logging
import socket
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import fields
from importlib import resources
from typing import Any, TypeVar

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from delegation import errors
from delegation._struct import I64_MAX
from delegation.codec import encode
from delegation.engine.notices import keep_running
from delegation.machine import State
from delegation.records import ChildSummary, LeaseRecord
from delegation.store import migrate, passwords, stores
from delegation.usecases.follow import pages
from delegation.usecases.inspector import PAGE, WATCH_INTERVAL_S, ChildPage, Inspector
from delegation.usecases.views import camel, json_safe, lease_status, number, step_json
from delegation.web.stream import (
    MAX_STREAMS,
    MAX_UNSENT_BYTES,
    EventStream,
    Pace,
    StreamCount,
    Unsent,
)
from delegation.web.token import Token, TokenGate

T = TypeVar("T")
log = logging.getLogger(__name__)

PING_S = 15.0  # an idle stream says something this often (a gone client is noticed)
CHANGES_EVERY_S = 0.5  # the page refreshes its lists at most twice a second
MAX_LIST = 500  # children one list shows at most (?limit=, 200 unless said)
CLIP = 200  # characters of an error or output in the children list
STEPS_SHOWN = 200  # the last steps of a child the page lists (each name at most 1 KiB)
WILDCARDS = ("", "0.0.0.0", "::")
# This server's own files only; no inline script or style, no frames, no forms.
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
# What the page shows of a child, besides its error and output.
_CHILD_FIELDS = (
    *("conversation_id", "run_id", "state", "profile", "lease_id", "parent_conversation_id"),
    *("parent_run_id", "extension_id", "runner_id", "created_at", "finished_at"),
    *("cancel_reason", "recovery_attempts"),
)


class CommitVersion:
    """A version that moves whenever another connection committed to the database, and
    the streams waiting for it to move: the :class:`~delegation.usecases.follow.Wake` of every
    event stream."""

    def __init__(self) -> None:
        self.count = 0
        self.stopped = False
        self.stopping = asyncio.Event()
        self._moved = asyncio.Event()

    def bump(self) -> None:
        self.count += 1
        self._moved.set()
        self._moved = asyncio.Event()

    def stop(self) -> None:
        """The server is shutting down: every stream ends now (uvicorn's graceful
        shutdown would otherwise wait for open streams forever)."""
        self.stopped = True
        self.stopping.set()
        self._moved.set()

    async def wait(self, seen: int, timeout: float) -> bool:
        """Whether the version moved past ``seen`` within ``timeout`` (False at once
        when the server stops)."""
        if self.count == seen and not self.stopped:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._moved.wait()
        return self.count != seen and not self.stopped

    def version(self) -> int:
        return self.count

    async def moved(self, since: int) -> bool:
        """Wait for a commit or ``PING_S`` (a stream reads again even when the watch
        failed); False once the server stops."""
        await self.wait(since, PING_S)
        return not self.stopped

    async def watch(self, url: str, interval: float) -> None:
        """Move the version at every commit of another connection, until cancelled (a
        failure, say the server away as it opens, is the caller's to run it again)."""
        watch = await run_in_threadpool(stores.open_watch, url, interval)
        try:
            while True:
                await watch.wait()
                self.bump()
        finally:
            watch.close()


def child_json(record: ChildSummary) -> dict[str, Any]:
    """What the page shows of a child: camelCase names; error and output as read (cut
    to ``CLIP`` characters by the list's query, whole for one child); ``pinnedVersion``
    only for a child pinned to the runner version that ran it (design §34)."""
    values: dict[str, Any] = {camel(name): getattr(record, name) for name in _CHILD_FIELDS}
    if record.pinned_version is not None and record.state == "waiting":
        values["pinnedVersion"] = record.pinned_version
    values["error"] = record.error
    values["output"] = record.output
    return json_safe(values)  # a time stored unreadable (NaN) is null


def lease_json(record: LeaseRecord, now: float) -> dict[str, Any]:
    values = {camel(field.name): getattr(record, field.name) for field in fields(record)}
    values["status"] = lease_status(record, now)
    return json_safe(values)


def frame(data: str, kind: str | None = None, event_id: int | None = None) -> str:
    """One Server-Sent Event. ``data`` is JSON: it holds no line break of its own."""
    head = "" if kind is None else f"event: {kind}\n"
    head += "" if event_id is None else f"id: {event_id}\n"
    return f"{head}data: {data}\n\n"


def encode_json(value: Any) -> str:
    return encode(value).decode()


def _asset(name: str) -> bytes:
    return resources.files("delegation").joinpath("web", "page", name).read_bytes()


class Routes:
    """The app's routes over one :class:`Inspector` and one :class:`CommitVersion`."""

    def __init__(self, inspector: Inspector, interval: float = WATCH_INTERVAL_S) -> None:
        self.inspector = inspector
        self.commits = CommitVersion()
        self.streams = StreamCount(MAX_STREAMS)
        self._interval = interval
        database = html.escape(passwords.redacted(inspector.url), quote=True)
        self._index = _asset("index.html").replace(b"{database}", database.encode())

    def app(
        self,
        allowed_hosts: Sequence[str],
        token: Token | None,
        extra: Sequence[BaseRoute] = (),
        public: frozenset[str] = frozenset(),
        bearer_only: frozenset[str] = frozenset(),
    ) -> Starlette:
        """The app answering ``allowed_hosts`` only; with ``token`` (None: no token asked
        for), only requests that show it (as a bearer alone for a ``bearer_only`` path),
        or ask for a ``public`` path; ``extra``: more routes (the A2A face's)."""
        routes = [
            Route("/", self.index),
            Route("/page.js", self.asset),
            Route("/page.css", self.asset),
            Route("/favicon.ico", self.no_icon),
            Route("/api/children", self.children),
            Route("/api/children/{conversation_id}/events", self.events),
            Route("/api/children/{conversation_id}/steps", self.steps),
            Route("/api/children/{conversation_id}/inputs", self.inputs),
            Route("/api/leases", self.leases),
            Route("/api/changes", self.changes),
            *extra,
        ]
        middleware = [
            Middleware(SecurityHeaders),  # on every refusal too, the Host check's first
            Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)),
            *(
                []
                if token is None
                else [Middleware(TokenGate, token=token, public=public, bearer_only=bearer_only)]
            ),
        ]
        handlers = {
            errors.InputError: _refused,
            errors.StoreError: _unavailable,
            Exception: _failed,  # answered outside the middleware: its headers are its own
        }
        return Starlette(
            routes=routes,
            middleware=middleware,
            exception_handlers=handlers,
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        watch = functools.partial(self.commits.watch, self.inspector.url, self._interval)
        watcher = asyncio.create_task(keep_running("the web page's database watch", watch))
        try:
            yield
        finally:
            self.commits.stop()
            watcher.cancel()
            await asyncio.wait([watcher])

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread: the Inspector's reads are blocking."""
        return await run_in_threadpool(fn, *args)

    async def index(self, request: Request) -> Response:
        return Response(self._index, media_type="text/html; charset=utf-8")

    async def asset(self, request: Request) -> Response:
        name = request.url.path.lstrip("/")
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        return Response(_asset(name), media_type=f"{kind}; charset=utf-8")

    async def no_icon(self, request: Request) -> Response:
        return Response(status_code=204)  # a browser asks; nothing to show, nothing to log

    async def children(self, request: Request) -> Response:
        state = request.query_params.get("state") or None
        if state is not None and state not in set(State):
            return JSONResponse({"error": f"unknown state; use one of {', '.join(State)}"}, 400)
        lease_id = request.query_params.get("lease") or None
        limit = number(request.query_params.get("limit"), "?limit=", 1, MAX_LIST, 200)
        records = await self.read(
            lambda: self.inspector.summaries(state=state, lease_id=lease_id, limit=limit, clip=CLIP)
        )
        listed = [child_json(record) for record in records]
        if any(record.state == "queued" for record in records):  # their places (§22)
            places = await self.read(self.inspector.queue_positions)
            for record, values in zip(records, listed, strict=True):
                if record.id in places:
                    values["queuePosition"] = places[record.id]
        return JSONResponse({"now": time.time(), "children": listed})

    async def leases(self, request: Request) -> Response:
        records = await self.read(self.inspector.leases)
        now = time.time()
        return JSONResponse({"now": now, "leases": [lease_json(r, now) for r in records]})

    async def events(self, request: Request) -> Response:
        """The events of one execution (``?run=``, default the newest) after ``?after=``
        or the ``Last-Event-ID`` a reconnecting EventSource sends: ``child`` frames when
        the child changes, one unnamed frame per event (its id the sequence), and
        ``end`` once it is terminal."""
        conversation_id = request.path_params["conversation_id"]
        run_id = request.query_params.get("run") or None
        after = number(request.headers.get("last-event-id"), "Last-Event-ID", 0, I64_MAX, -1)
        if after < 0:
            after = number(request.query_params.get("after"), "?after=", 0, I64_MAX, 0)
        record = await self.read(self.inspector.summary, conversation_id, run_id)
        if record is None:
            return JSONResponse({"error": "no such child"}, 404)
        return self._stream(lambda outbox: self._follow(record, after, outbox))

    async def steps(self, request: Request) -> Response:
        """The steps one execution (``?run=``, default the newest) recorded: the last
        ``STEPS_SHOWN``, oldest first, and how many there are (``stepCount``); each one's
        name, place, size and time, never its value."""
        conversation_id = request.path_params["conversation_id"]
        run_id = request.query_params.get("run") or None
        found = await self.read(
            lambda: self.inspector.steps(conversation_id, run_id, STEPS_SHOWN, latest=True)
        )
        if found.child is None:
            return JSONResponse({"error": "no such child"}, 404)
        return JSONResponse(
            {
                "now": time.time(),
                "conversationId": found.child.conversation_id,
                "runId": found.child.run_id,
                "stepCount": found.count,
                "steps": [step_json(step) for step in found.steps],
            }
        )

    async def inputs(self, request: Request) -> Response:
        """What one execution (``?run=``, default the newest) asks and waits to be
        answered (design §21): its open input requests by inputId, as its Result carries
        them. The page shows them; answering is ``delegation input``'s (it is read-only)."""
        conversation_id = request.path_params["conversation_id"]
        run_id = request.query_params.get("run") or None
        record = await self.read(self.inspector.get_child, conversation_id, run_id)
        if record is None:
            return JSONResponse({"error": "no such child"}, 404)
        asks = await self.read(self.inspector.input_requests, record)
        return JSONResponse(
            {
                "conversationId": record.conversation_id,
                "runId": record.run_id,
                "state": record.state,
                "inputRequests": {key: msgspec.to_builtins(ask) for key, ask in asks.items()},
            }
        )

    async def changes(self, request: Request) -> Response:
        """A ``changed`` frame whenever the database moved (at most every
        ``CHANGES_EVERY_S``): the page then reads its lists again."""
        return self._stream(lambda _outbox: self._changes())

    def _stream(self, frames: Callable[[Unsent], AsyncGenerator[str, None]]) -> Response:
        if self.streams.full():
            return JSONResponse({"error": "too many open streams"}, 503)
        return EventStream(frames, self.streams, self.commits.stopping, MAX_UNSENT_BYTES)

    async def _follow(
        self, record: ChildSummary, after: int, outbox: Unsent
    ) -> AsyncGenerator[str, None]:
        conversation_id, run_id = record.conversation_id, record.run_id
        behind = False  # the last page was full: more is committed already

        async def sizes(after: int) -> list[tuple[int, int]]:
            return await self.read(self.inspector.event_sizes, record.id, after, PAGE)

        pace = Pace(outbox, self.commits, sizes, PING_S)

        async def read(after: int, limit: int) -> ChildPage:
            nonlocal behind
            if behind:
                await pace.room(after)  # raises Dropped: the client is not reading
            page = await self.read(self.inspector.page, conversation_id, run_id, after, limit)
            behind = len(page.events) >= limit or page.more
            pace.read(behind)
            return page

        shown: ChildSummary | None = None
        last: ChildPage | None = None
        async for last in pages(read, self.commits, after, PAGE):
            if last.child is None:  # purged meanwhile
                yield frame("null", "end")
                return
            if last.child != shown:
                yield frame(encode_json(child_json(last.child)), "child")
                shown = last.child
            for event in last.events:
                yield frame(encode_json(event), event_id=event.sequence)
        if last is not None and last.child is not None and last.done:
            yield frame(encode_json(child_json(last.child)), "end")

    async def _changes(self) -> AsyncGenerator[str, None]:
        seen = self.commits.count
        while await self.commits.moved(seen):
            if self.commits.count != seen:
                seen = self.commits.count
                yield frame(str(seen), "changed")
                await asyncio.sleep(CHANGES_EVERY_S)
            else:
                yield ": ping\n\n"


def _refused(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc)}, 400)


def _unavailable(request: Request, exc: Exception) -> Response:
    log.warning("a read failed: %s", exc, extra={"action": "web_read_failed"})
    return JSONResponse({"error": str(exc)}, 503)


def _failed(request: Request, exc: Exception) -> Response:
    """A fault of ours (uvicorn logs it with its traceback): a bare 500, with the
    headers every answer has."""
    return JSONResponse({"error": "internal error"}, 500, headers=HEADERS)


class SecurityHeaders:
    """Adds :data:`HEADERS` to every answer, refusals included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                extra = [
                    (name.lower().encode(), value.encode())
                    for name, value in HEADERS.items()
                    if name.lower().encode() not in names
                ]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _Server(uvicorn.Server):
    """uvicorn's server, ending every open stream as its shutdown begins: an open
    EventSource would otherwise hold Ctrl-C up until the graceful timeout."""

    def __init__(self, config: uvicorn.Config, commits: CommitVersion) -> None:
        super().__init__(config)
        self._commits = commits

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._commits.stop()
        await super().shutdown(sockets)


def serve(
    url: str, host: str = "127.0.0.1", port: int = 8765, *, token: bool = True, a2a: bool = False
) -> int:
    """Serve the page of the database at ``url`` until Ctrl-C or SIGTERM; the exit code.
    It prints the page's address first (``--port 0``: a free port), with a new token
    that every request must show (``token=False``: none asked for); ``a2a``: with the A2A
    face (:mod:`delegation.web.a2a_routes`, the ``a2a`` extra).

    Raises:
        errors.StoreError: no database there, or not one of delegation's.
        KeyboardInterrupt: after Ctrl-C, once the server has stopped.
    """
    with Inspector(url) as inspector:
        problem = schema_problem(inspector)
        if problem is not None:
            print(f"delegation: {problem}", file=sys.stderr)
            return 1
        try:
            listener = bind(host, port)
        except OSError as exc:
            print(f"delegation: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
            return 1
        page = Routes(inspector)
        gate = Token.new(listener.getsockname()[1]) if token else None
        face = None
        if a2a:  # the a2a extra's, imported only when asked for
            from delegation.web.a2a_routes import Served

            face = Served(inspector, page.commits, address(listener), page.streams)
        extra, public, bearer_only = (
            (face.routes, face.public, face.bearer_only) if face else ((), frozenset(), frozenset())
        )
        config = uvicorn.Config(
            page.app(allowed_hosts(host), gate, extra, public, bearer_only),
            log_config=None,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            timeout_graceful_shutdown=2,
        )
        print(announcement(address(listener), gate), flush=True)
        try:
            _Server(config, page.commits).run(sockets=[listener])
        finally:
            if face is not None:
                face.close()
    return 0


def announcement(where: str, token: Token | None) -> str:
    """The line ``delegation web`` prints first: the page's address, with its token."""
    if token is None:
        said = "read-only; no token: whoever reaches the port reads every child"
        return f"delegation web: {where} ({said}; Ctrl-C stops)"
    return f"delegation web: {where}?token={token.value} (read-only; Ctrl-C stops)"


def schema_problem(inspector: Inspector) -> str | None:
    """Why this database cannot be shown (an older schema), or None.

    Raises:
        errors.SchemaMismatch: not a delegation database this code knows.
    """
    inspector.check()
    revision, head = inspector.revision(), migrate.head()
    if revision == head:
        return None
    found = f"schema {revision}" if revision else "no schema"
    return f"{found}, this delegation reads {head}: run `delegation db upgrade`"


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host`` (an address or a name) and ``port``: from
    here on a browser's connection waits for the server instead of being refused."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    return listener


def address(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def allowed_hosts(host: str) -> list[str]:
    """The ``Host`` a request may name: the address bound and localhost's names; any,
    when bound to every address (then nothing stops DNS rebinding either)."""
    if host in WILDCARDS:
        return ["*"]
    return sorted({f"[{host}]" if ":" in host else host, "127.0.0.1", "localhost", "[::1]"})
