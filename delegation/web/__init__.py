"""``delegation web``: a live, read-only page of a database (the ``web`` extra).

* :mod:`~delegation.web.app` - the Starlette app and its routes, served by uvicorn;
* :mod:`~delegation.web.stream` - the page's event streams, bounded per client;
* :mod:`~delegation.web.token` - its token: 401 without it, then a cookie (or a bearer);
* :mod:`~delegation.web.a2a` - ``--a2a``: an A2A face over children (the ``a2a`` extra);
* :mod:`~delegation.web.a2a_routes` - its agent card and endpoint, on the SDK's routes;
* ``page/`` - the HTML, CSS and JavaScript (no build step).
"""
