"""The client (``delegation.client``) against a real ``delegation serve``: calls and
``follow``.
"""
