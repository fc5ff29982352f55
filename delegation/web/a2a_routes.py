"""Where ``delegation web --a2a`` serves its A2A face (design §29): the agent card and the
JSON-RPC endpoint (A2A v1.0, and v0.3 on the same endpoint), built by the SDK's own
routes around :class:`~delegation.web.a2a.Face`.

* The card is at ``/.well-known/agent-card.json``, readable without the token (a client
  finds the endpoint there) and declaring the bearer scheme; its URL is the address the
  server bound (``--port 0`` included), so it is built after the port is.
* The endpoint takes the web token as ``Authorization: Bearer`` only (as A2A clients send
  it), never the page's cookie or ``?token=``, or answers 401 before any route: a page of
  another site (another port of 127.0.0.1 is the same site, so its POSTs carry the
  cookie) cannot write a control. It also refuses what no A2A client sends and a browser's
  cross-site form may: a body that is not ``application/json`` (415) and a foreign
  ``Origin`` (403); and a body over ``MAX_BODY`` (413, the JSON-RPC InvalidRequest), read
  no further, before the SDK parses it on the event loop.
* Its streams count against the page's (``MAX_STREAMS``, :class:`Streams`).
* One skill, streaming on, push notifications off.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed

from a2a.server.context import ServerCallContext
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.routes.common import DefaultServerCallContextBuilder
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    HTTPAuthSecurityScheme,
    SecurityRequirement,
    SecurityScheme,
    StringList,
)
from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from delegation.operator import Operator
from delegation.usecases.follow import Wake
from delegation.usecases.inspector import Inspector
from delegation.web.a2a import SLOT, Face, Slot
from delegation.web.stream import StreamCount

ENDPOINT = "/a2a"  # the JSON-RPC endpoint (POST)
CARD = AGENT_CARD_WELL_KNOWN_PATH  # public: it says where the endpoint is, and how to log in
SHUTDOWN_GRACE_S = 0.5  # open streams end this soon once the server stops
MAX_BODY = 1024 * 1024  # bytes of one request's body, at most
TOO_LARGE = {  # the JSON-RPC InvalidRequest, as the SDK answers its own 413
    "jsonrpc": "2.0",
    "id": None,
    "error": {"code": -32600, "message": f"Payload too large (at most {MAX_BODY} bytes)"},
}


def card(base: str, version: str) -> AgentCard:
    """The agent card of the server at ``base`` (``http://host:port/``)."""
    url = base.rstrip("/") + ENDPOINT
    bearer = SecurityScheme(
        http_auth_security_scheme=HTTPAuthSecurityScheme(
            scheme="bearer", description="the token `delegation web` printed"
        )
    )
    return AgentCard(
        name="delegation",
        description="Durable child runs of agent hosts: follow, answer, steer and cancel them.",
        version=version,
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0"),
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="0.3"),
        ],
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        security_schemes={"bearer": bearer},
        security_requirements=[SecurityRequirement(schemes={"bearer": StringList()})],
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[
            AgentSkill(
                id="children",
                name="Child runs",
                description=(
                    "Tasks are child executions started by their extension: list and follow"
                    " them, answer one that needs input, steer or cancel one."
                ),
                tags=["delegation", "durable", "children"],
            )
        ],
    )


def routes(face: Face, streams: StreamCount) -> list[BaseRoute]:
    """The card's route and the endpoint's (behind a :class:`Guard`), over ``face``."""
    (endpoint,) = create_jsonrpc_routes(
        face,
        ENDPOINT,
        context_builder=WithSlot(),
        enable_v0_3_compat=True,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
    )
    assert isinstance(endpoint, Route)
    guarded = Route(ENDPOINT, Guard(endpoint.app, streams), methods=["POST"])
    return [*create_agent_card_routes(face.card, card_url=CARD), guarded]


class Guard:
    """The endpoint's door (ASGI): refuses a body that is not JSON (415), a foreign
    ``Origin`` (403) and a body over ``max_body`` bytes (413; read no further), then
    hands the request on with the body it read and a :class:`Slot` among ``streams``
    that a stream takes (given back once the answer ended)."""

    def __init__(self, app: ASGIApp, streams: StreamCount, max_body: int = MAX_BODY) -> None:
        self.app, self.streams, self.max_body = app, streams, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = self._refused(Request(scope))
        if refused is None:
            body = await _body(receive, self.max_body)
            if body is None:
                refused = JSONResponse(TOO_LARGE, 413, {"Connection": "close"})
        if refused is not None:
            await refused(scope, receive, send)
            return
        given = False

        async def replay() -> Message:
            nonlocal given
            if given:
                return await receive()  # the client's disconnect, which a stream waits for
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        slot = Slot(self.streams)
        try:
            await self.app({**scope, SLOT: slot}, replay, send)
        finally:
            slot.release()

    def _refused(self, request: Request) -> Response | None:
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "application/json":
            return PlainTextResponse("the A2A endpoint takes application/json\n", 415)
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return PlainTextResponse("the A2A endpoint takes no cross-origin request\n", 403)
        length = request.headers.get("content-length", "")  # digits: uvicorn checked
        if length.isdigit() and (len(length) > 9 or int(length) > self.max_body):
            return JSONResponse(TOO_LARGE, 413, {"Connection": "close"})
        return None


async def _body(receive: Receive, limit: int) -> bytes | None:
    """The request's body, or None once it passes ``limit`` bytes (the rest unread)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: nothing to answer
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class WithSlot(DefaultServerCallContextBuilder):
    """The SDK's call context, with the request's :class:`Slot` in its ``state``."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state[SLOT] = request.scope.get(SLOT)
        return context


class Served:
    """The face of the database ``inspector`` reads, for the server bound at ``base``:
    its ``routes``, the paths it serves without the token (``public``) and with the
    bearer alone (``bearer_only``), and the :class:`Operator` its controls go through
    (:meth:`close` it after). Its streams count among ``streams``."""

    def __init__(self, inspector: Inspector, wake: Wake, base: str, streams: StreamCount) -> None:
        self.operator = Operator(inspector.url)
        self.face = Face(inspector, self.operator, wake, card(base, _version()))
        self.card = self.face.card
        self.routes = routes(self.face, streams)
        self.public = frozenset({CARD})
        self.bearer_only = frozenset({ENDPOINT})

    def close(self) -> None:
        self.face.close()
        self.operator.close()


def _version() -> str:
    try:
        return installed("durable-delegation")
    except PackageNotFoundError:  # a source tree never installed
        return "unknown"
