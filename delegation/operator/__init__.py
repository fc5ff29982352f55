"""The operator's room (design §33): a Python door to children from another process.

* :mod:`~delegation.operator.api` - :class:`Operator`: controls judged when given and
  waited for (cancel, steer, answer an input, send an event), every control listed with
  its outcome, and the reads an operator needs (children, show, events, follow).

The CLI's ``cancel``, ``steer``, ``input``, ``send`` and ``controls`` are built on it. It
imports the use cases and the store; never the engine (it runs beside one, or none).
"""

from __future__ import annotations

from delegation.operator.api import APPLY_WAIT_S, Operator
from delegation.usecases.operating import Outcome

__all__ = ["APPLY_WAIT_S", "Operator", "Outcome"]
