"""A client for ``delegation serve`` (design §11): :class:`Client` (async) and
:class:`SyncClient`, over a Unix socket (``connect``) or a spawned ``serve --stdio``
(``spawn``).

* :mod:`~delegation.client.api` - the clients: registration, tool calls, the five child
  methods, follows with a bounded buffer;
* :mod:`~delegation.client.wire` - the lines they read, the params they send, a
  follow's pages.
"""

from delegation.client.api import Client, ParamsLike, Registration, SyncClient

__all__ = ["Client", "ParamsLike", "Registration", "SyncClient"]
