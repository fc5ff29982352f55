"""``delegation web`` (``delegation.web``): the live page in a real browser, its bounds,
pinned children, and the A2A face.
"""
