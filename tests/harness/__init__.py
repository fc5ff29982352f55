"""The test harness: what the tests share, and nothing that pytest collects.

- :mod:`~tests.harness.support`: the engine, runner and connection helpers most tests use;
  :mod:`~tests.harness.rows`: a read-only view of either store's rows;
  :mod:`~tests.harness.trees`: process trees;
- the servers a test stands up: :mod:`~tests.harness.postgres` (a temporary PostgreSQL),
  :mod:`~tests.harness.pgbouncer`, :mod:`~tests.harness.failover` (pg_auto_failover),
  :mod:`~tests.harness.patroni`, with :mod:`~tests.harness.reaper`,
  :mod:`~tests.harness.netcut` and :mod:`~tests.harness.pgproxy` to cut and break them;
- the faces a test drives: :mod:`~tests.harness.browser` (headless Chromium),
  :mod:`~tests.harness.terminal`, :mod:`~tests.harness.serve_runners` (runners a
  ``delegation serve`` loads by name), :mod:`~tests.harness.pydantic_ai_support`;
- what test modules share with one another, so that none imports another: a
  ``delegation serve`` host and its client (:mod:`~tests.harness.serving`,
  :mod:`~tests.harness.client_hosts`), restarts and waits
  (:mod:`~tests.harness.restarts`, :mod:`~tests.harness.waits`), the killed step hosts
  (:mod:`~tests.harness.step_hosts`), rewinds, versions, command children, the page, the
  CLI on PostgreSQL, the failover checks, and the like, each module named for what it
  holds and saying which test module it came from;
- the host processes the kill tests start by path (``*_host.py``, sharing
  :mod:`~tests.harness.hosting`), the children they run (``attack_child.py``,
  ``uring_socket.py``), :mod:`~tests.harness.resume_times`, and ``vectors/``, the golden
  wire vectors shared with clients in other languages.
"""
