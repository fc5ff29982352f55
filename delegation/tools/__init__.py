"""Tools that measure and try the library from outside, never part of it: the benchmarks
(:mod:`~delegation.tools.bench`, ``python -m delegation.bench``), the soak
(:mod:`~delegation.tools.soak`, ``python -m delegation.soak``) and the flood of a serve
socket (:mod:`~delegation.tools.serve_flood`). They import the library; nothing of the
library imports them (import-linter checks it)."""
