"""JSON-RPC 2.0 framing: one message per line, the method table, errors to the wire.

The envelope is decoded with ``params`` kept raw; each method then decodes its own
params strictly. Every domain error becomes one error response with its
``rpc_code`` and ``data.reason``; anything else becomes -32603 with no detail, so no
stack trace ever reaches the wire.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec

from delegation import errors

log = logging.getLogger("delegation.rpc")

MAX_FRAME_BYTES = 4 * 1024 * 1024
Id = int | str | None
Handler = Callable[[bytes], Awaitable[Any]]


class Envelope(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    jsonrpc: str
    method: str
    id: int | str | msgspec.UnsetType | None = msgspec.UNSET
    params: msgspec.Raw = msgspec.Raw(b"{}")


class ErrorBody(msgspec.Struct, omit_defaults=True, frozen=True):
    code: int
    message: str
    data: dict[str, str] | None = None


class ErrorResponse(msgspec.Struct, frozen=True):
    error: ErrorBody
    id: Id
    jsonrpc: str = "2.0"


class Response(msgspec.Struct, frozen=True):
    result: Any
    id: Id
    jsonrpc: str = "2.0"


class Notification(msgspec.Struct, frozen=True):
    method: str
    params: Any
    jsonrpc: str = "2.0"


class _Head(msgspec.Struct):
    """A message's id, kept raw; everything else is only skipped (and so checked)."""

    id: msgspec.Raw = msgspec.Raw(b"null")


_envelope = msgspec.json.Decoder(Envelope)
# Any JSON text, with nothing materialized but an object's id.
_head = msgspec.json.Decoder(_Head | list[msgspec.Raw] | str | float | bool | None)
_id = msgspec.json.Decoder(int | str)
_encoder = msgspec.json.Encoder()


def error_frame(exc: BaseException, request_id: Id) -> bytes:
    """The wire form of a refusal or a fault."""
    if not isinstance(exc, errors.DelegationError):
        log.error("internal fault", extra={"action": "rpc_internal_error"}, exc_info=exc)
        exc = errors.InternalError()
    body = ErrorBody(exc.rpc_code, str(exc), {"reason": exc.reason})
    return _encoder.encode(ErrorResponse(body, request_id)) + b"\n"


def _every(kind: type[errors.DelegationError]) -> Iterator[type[errors.DelegationError]]:
    yield kind
    for sub in kind.__subclasses__():
        yield from _every(sub)


_BY_REASON = {kind.reason: kind for kind in _every(errors.DelegationError)}
# A reason this side does not know yet: the most general class of its code.
_BY_CODE: dict[int, type[errors.DelegationError]] = {
    kind.rpc_code: kind
    for kind in (errors.ParseError, errors.ProtocolError, errors.MethodNotFound, errors.StoreError)
}


def error_from_wire(code: int, message: str, reason: object = None) -> errors.DelegationError:
    """The inverse of :func:`error_frame`, for clients: the class named by ``reason``
    (else the most general class of ``code``), with ``message`` as ``str(error)``."""
    kind = _BY_REASON.get(reason) if isinstance(reason, str) else None
    if kind is None:
        kind = _BY_CODE.get(code, errors.DelegationError)
    error = kind()
    error.args = (message,)  # exactly the peer's words (no class prefixes them again)
    return error


def result_frame(result: Any, request_id: Id) -> bytes:
    return _encoder.encode(Response(result, request_id)) + b"\n"


def notification_frame(method: str, params: Any) -> bytes:
    """A message of the host's own (a follow's events): no id, never answered."""
    return _encoder.encode(Notification(method, params)) + b"\n"


def parse(line: bytes) -> tuple[Envelope | None, bytes | None]:
    """Decode one line into an envelope, or the error frame to answer instead.

    Returns ``(envelope, None)`` for a well-formed request or notification, and
    ``(None, frame)`` for a malformed one (``frame`` is None when nothing may be
    answered: never, since a malformed message always gets an error with id null).
    Only the id is read before the envelope: a value inside ``params`` that no
    decoder holds (``1e400``, an integer of 5000 digits) is the method's -32602,
    answered with the request's own id.
    """
    try:
        line.decode()  # JSON text is UTF-8, also where the decoders only skip
        head = _head.decode(line)
    except msgspec.ValidationError:  # well-formed: a lone number too large to hold
        head = None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        return None, error_frame(errors.ParseError(f"parse error: {exc}"), None)
    if not isinstance(head, _Head):
        return None, error_frame(errors.InvalidRpcRequest("invalid request: not an object"), None)
    request_id = _request_id(head.id)
    try:
        envelope = _envelope.decode(line)
    except (msgspec.MsgspecError, RecursionError, ValueError) as exc:
        return None, error_frame(errors.InvalidRpcRequest(f"invalid request: {exc}"), request_id)
    if envelope.jsonrpc != "2.0":
        failure = errors.InvalidRpcRequest('invalid request: jsonrpc must be "2.0"')
        return None, error_frame(failure, request_id)
    return envelope, None


def _request_id(raw: msgspec.Raw) -> Id:
    """The id to answer with: the request's, or null when it is not a valid id."""
    try:
        request_id: int | str = _id.decode(raw)
    except (msgspec.MsgspecError, ValueError):
        return None
    return request_id


async def dispatch(envelope: Envelope, handler: Handler | None) -> bytes | None:
    """Run one request with the ``handler`` of its method (None: no such method);
    return its response frame (None for a notification)."""
    notification = envelope.id is msgspec.UNSET
    request_id: Id = None if notification else envelope.id  # type: ignore[assignment]
    try:
        if handler is None:
            raise errors.MethodNotFound(f"method not found: {envelope.method}")
        result = await handler(envelope.params)
    except Exception as exc:
        return None if notification else error_frame(exc, request_id)
    return None if notification else result_frame(result, request_id)


def refusal(envelope: Envelope, exc: errors.DelegationError) -> bytes | None:
    """The error answer to a request that was not served (None for a notification)."""
    if envelope.id is msgspec.UNSET:
        return None
    return error_frame(exc, envelope.id)


def decode_params(raw: bytes, kind: type[Any]) -> Any:
    """Strictly decode a method's params; a malformed value is -32602 with a reason."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise errors.MalformedInput(f"malformed params: {exc}") from exc
