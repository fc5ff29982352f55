"""The runtime wing (``delegation.engine``): the happy path, lifecycles, the five child
methods, restarts and recovery, deadlines, admission, follow-ups, versions, rewind,
telemetry, push control, follow's ends and a start replayed on another host.
"""
