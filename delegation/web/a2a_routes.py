"""Where ``delegation web --a2a`` serves its A2A face (design §29): the agent card and the
JSON-RPC endpoint (A2A v1.0, and v0.3 on the same endpoint), built by the SDK's own
routes around :class:`~delegation.web.a2a.Face`.

* The card is at ``/.well-known/agent-card.json``, readable without the token (a client
  finds the endpoint there) and declaring the bearer scheme; its URL is the address the
  server bound (``--port 0`` included), so it is built after the port is.
* Every other request shows the web token (``Authorization: Bearer``, as A2A clients send
  it, besides the page's cookie and ``?token=``), or gets 401 before any route.
* One skill, streaming on, push notifications off.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed

from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
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
from starlette.routing import BaseRoute

from delegation.operator import Operator
from delegation.usecases.follow import Wake
from delegation.usecases.inspector import Inspector
from delegation.web.a2a import Face

ENDPOINT = "/a2a"  # the JSON-RPC endpoint (POST)
CARD = AGENT_CARD_WELL_KNOWN_PATH  # public: it says where the endpoint is, and how to log in
SHUTDOWN_GRACE_S = 0.5  # open streams end this soon once the server stops


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


def routes(
    inspector: Inspector, operator: Operator, wake: Wake, agent: AgentCard
) -> list[BaseRoute]:
    """The card's route and the endpoint's, over one :class:`Face`."""
    face = Face(inspector, operator, wake, agent)
    endpoint = create_jsonrpc_routes(
        face, ENDPOINT, enable_v0_3_compat=True, shutdown_grace_period=SHUTDOWN_GRACE_S
    )
    return [*create_agent_card_routes(agent, card_url=CARD), *endpoint]


class Served:
    """The face of the database ``inspector`` reads, for the server bound at ``base``:
    its ``routes``, the paths it serves without the token (``public``), and the
    :class:`Operator` its controls go through (:meth:`close` it after)."""

    def __init__(self, inspector: Inspector, wake: Wake, base: str) -> None:
        self.operator = Operator(inspector.url)
        self.card = card(base, _version())
        self.routes = routes(inspector, self.operator, wake, self.card)
        self.public = frozenset({CARD})

    def close(self) -> None:
        self.operator.close()


def _version() -> str:
    try:
        return installed("durable-delegation")
    except PackageNotFoundError:  # a source tree never installed
        return "unknown"
