"""Errors of the tree (see :mod:`delegation.errors`): JSON-RPC framing and faults."""

from __future__ import annotations

from delegation.errors.base import DelegationError


class ProtocolError(DelegationError):
    """invalid JSON-RPC message"""

    reason = "protocol_error"
    rpc_code = -32600


class ParseError(ProtocolError):
    """parse error"""

    reason = "parse_error"
    rpc_code = -32700


class InvalidRpcRequest(ProtocolError):
    """invalid request"""

    reason = "invalid_request"
    rpc_code = -32600


class MethodNotFound(ProtocolError):
    """method not found"""

    reason = "method_not_found"
    rpc_code = -32601


class StoreError(DelegationError):
    """child store failed"""

    reason = "store_error"
    rpc_code = -32603


class DatabaseBusy(StoreError):
    """child store is busy; retry"""

    reason = "database_busy"


class StoreUnavailable(StoreError):
    """database is unavailable; try again"""

    reason = "store_unavailable"


class HostClosing(StoreError):
    """the host closed before the child was admitted; replay the requestId"""

    reason = "host_closing"


class SchemaMismatch(StoreError):
    """the file is not a delegation database this version can open"""

    reason = "schema_mismatch"


class HostConflict(StoreError):
    """database is in use by another live host"""

    reason = "host_conflict"


class HostFenced(HostConflict):
    """host instance was taken over by another host; its writes are refused"""

    reason = "host_fenced"


class DatabaseReplaced(StoreError):
    """database file was replaced while in use"""

    reason = "database_replaced"


class DatabaseReadOnly(StoreError):
    """database file is read-only"""

    reason = "database_read_only"


class ChildPurged(StoreError):
    """child record was purged after its retention period"""

    reason = "child_purged"
    rpc_code = -32602


class ChildUnreadable(StoreError):
    """stored child record is unreadable"""

    reason = "child_unreadable"
    rpc_code = -32602


class InternalError(DelegationError):
    """internal error"""

    reason = "internal_error"
    rpc_code = -32603
