"""The use cases (``delegation.usecases``): the one follow loop, pages bounded in bytes,
a start under a tool call found open, tombstones.
"""
