"""The hosts: ``delegation serve`` over sockets, and one in a single process.

* :mod:`~delegation.host.serve` - one runner connection per stream (stdio or a Unix
  socket), the lifecycle methods and the five child methods, bounded in flight;
* :mod:`~delegation.host.serve_io` - framing, outboxes that count unread answers in
  bytes, the socket and its peer check;
* :mod:`~delegation.host.serve_streams` - the streams a socket serves, stopped together
  at shutdown, and the connections each runner holds of them;
* :mod:`~delegation.host.serve_follow` - ``child.follow``: pages of ``child.read``
  pushed to the runner as they commit;
* :mod:`~delegation.host.local` - ``LocalHost``: a single-process host's runner
  connection, tool call, preset and leases, made through the engine's public calls
  (design §30).
"""
