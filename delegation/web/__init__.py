"""``delegation web``: a live, read-only page of a database (the ``web`` extra).

* :mod:`~delegation.web.app` - the Starlette app and its routes, served by uvicorn;
* :mod:`~delegation.web.stream` - the page's event streams, bounded per client;
* :mod:`~delegation.web.token` - its token: 401 without it, then a cookie;
* ``page/`` - the HTML, CSS and JavaScript (no build step).
"""
