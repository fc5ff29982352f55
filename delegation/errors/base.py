"""The root of the tree (see :mod:`delegation.errors`): its reason, code and message."""

from __future__ import annotations

from typing import ClassVar


class DelegationError(Exception):
    """delegation error"""

    reason: ClassVar[str] = "delegation_error"
    rpc_code: ClassVar[int] = -32602

    def __init__(self, message: str | None = None, *, detail: str = "") -> None:
        super().__init__(message if message is not None else self.default_message())
        self.detail = ""
        if detail:
            self.explain(detail)

    def explain(self, detail: str) -> DelegationError:
        """Say what exactly was missing or wrong, beside the message the contract fixes:
        a note on the traceback and ``detail`` on the error, in this process only: the
        wire's ``data`` stays ``{"reason": ...}`` (design §2.3)."""
        self.detail = detail
        self.add_note(detail)
        return self

    @classmethod
    def default_message(cls) -> str:
        return (cls.__doc__ or cls.reason).strip().splitlines()[0]

    @property
    def message(self) -> str:
        return str(self)
