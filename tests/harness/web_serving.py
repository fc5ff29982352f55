"""What other tests use of web/test_web_bounds.py, kept here so that no test module imports
another: serving."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from delegation.web import app as web


@contextlib.asynccontextmanager
async def serving(page: web.Routes, app: Any, listener: socket.socket) -> AsyncIterator[None]:
    """``app`` (of ``page``) served by uvicorn on ``listener``, on this test's loop."""
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning"))
    running = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        while not server.started:
            assert not running.done(), running.exception()
            await asyncio.sleep(0.01)
        yield
    finally:
        page.commits.stop()
        server.should_exit = True
        await running
