"""The host protocol over sockets: ``delegation serve``.

* :mod:`~delegation.host.serve` - one runner connection per stream (stdio or a Unix
  socket), the lifecycle methods and the five child methods, bounded in flight;
* :mod:`~delegation.host.serve_io` - framing, outboxes that count unread answers in
  bytes, the socket and its peer check;
* :mod:`~delegation.host.serve_follow` - ``child.follow``: pages of ``child.read``
  pushed to the runner as they commit.
"""
