"""The command line: ``delegation`` (parsing and printing only; it calls the API users
call).

* :mod:`~delegation.cli.commands` - the parser, and each command run;
* :mod:`~delegation.cli.show` - ``children``, ``show``, ``events``, ``leases``, ``steps``;
* :mod:`~delegation.cli.arguments` - the arguments several commands share;
* :mod:`~delegation.cli.operate` - ``cancel``, ``steer``, ``input``, ``send`` and
  ``controls``: an operator's controls (on :class:`delegation.operator.Operator`);
* :mod:`~delegation.cli.demo` - ``demo``, the guided tour;
* :mod:`~delegation.cli.completion` - ``completion SHELL``;
* :mod:`~delegation.cli.listing`, :mod:`~delegation.cli.terminal`,
  :mod:`~delegation.cli.progress` - tables that fit a terminal, escaped text, progress.
"""

from delegation.cli.commands import main

__all__ = ["main"]
