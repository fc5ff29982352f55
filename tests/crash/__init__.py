"""Kill tests: real host processes (``tests/harness/*_host.py``) killed with SIGKILL,
stopped with SIGSTOP or left mid-write, and what the next host finds: durability
(``test_crash``), steps, emits, waits, versions, patches, rewinds and pydantic-ai runs
through crashes, takeovers among several hosts, admission slots a killed host held, the
temp dirs it left, and the soak.
"""
