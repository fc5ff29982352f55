"""``delegation web``'s token (design §17): every request shows it, as Jupyter's do.

At start the server makes a random token and prints its address with it
(``http://127.0.0.1:8765/?token=…``). A request gets in with the token in its query or in
the cookie a first request with it set; any other answer is 401, before a route or a
stream is reached. The cookie is ``HttpOnly`` (no script reads it), ``SameSite=Strict``
(a page of another site cannot send it) and ``Path=/``; its name carries the port,
because cookies are kept per host, not per port, and two servers on one machine must not
overwrite each other's. The page drops ``token`` from its own address once loaded.
An A2A client (design §29) shows it as ``Authorization: Bearer``; the gate reads that too,
before any route, so a request without it is a 401 whatever it asks. Paths the app
names ``public`` (the A2A agent card) pass without it; paths it names ``bearer_only``
(the A2A endpoint, the one that writes) take the bearer or the query's token, never the
cookie: a browser sends the cookie with a page's cross-site POST (another port of
127.0.0.1 is the same site), never a header or a token it was not given.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REFUSED = "delegation web: open the address it printed (with ?token=…)\n"


@dataclass(frozen=True)
class Token:
    """The token of one server and the name of its cookie."""

    value: str
    cookie: str

    @classmethod
    def new(cls, port: int) -> Token:
        """A random token (256 bits) for the server on ``port``."""
        return cls(secrets.token_urlsafe(32), f"delegation-token-{port}")

    def matches(self, given: str | None) -> bool:
        """Whether ``given`` is the token, compared in constant time (as bytes: a
        string with non-ASCII characters is an answer too, not an error)."""
        return given is not None and secrets.compare_digest(
            given.encode("utf-8", "surrogatepass"), self.value.encode()
        )

    def set_cookie(self) -> str:
        return f"{self.cookie}={self.value}; Path=/; HttpOnly; SameSite=Strict"


class TokenGate:
    """ASGI middleware: a request whose query, cookie or bearer holds the token reaches
    the app (a query's token also sets the cookie), as does one for a ``public`` path,
    and one for a ``bearer_only`` path only with the bearer; every other one is answered
    401."""

    def __init__(
        self,
        app: ASGIApp,
        token: Token,
        public: frozenset[str] = frozenset(),
        bearer_only: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.token = token
        self.public = public
        self.bearer_only = bearer_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the lifespan
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if scope["path"] in self.bearer_only:
            given = bearer(request) or request.query_params.get("token")  # never the cookie
            if self.token.matches(given):
                await self.app(scope, receive, send)
            else:
                await _refuse(scope, receive, send)
        elif self.token.matches(request.query_params.get("token")):
            await self.app(scope, receive, self._with_cookie(send))
        elif (
            self.token.matches(request.cookies.get(self.token.cookie))
            or self.token.matches(bearer(request))
            or scope["path"] in self.public
        ):
            await self.app(scope, receive, send)
        else:
            await _refuse(scope, receive, send)

    def _with_cookie(self, send: Send) -> Send:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                cookie = (b"set-cookie", self.token.set_cookie().encode())
                message = {**message, "headers": [*message.get("headers", []), cookie]}
            await send(message)

        return sending


async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse(REFUSED, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)


def bearer(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer …`` header (None without one)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None
