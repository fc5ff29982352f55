"""What other tests use of host/test_serve.py, kept here so that no test module imports
another: Client, OWNER, PRESET, ROOT, host, socket_client, start_params."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[2]
PRESET = {"name": "scripted", "extensionId": "ext", "generation": 3}
OWNER = {"runId": "run-1", "toolCallId": "call-1", "extensionId": "ext", "generation": 3}


class Client:
    """A line-delimited JSON-RPC peer; a reader task matches answers to ids."""

    def __init__(self, reader: asyncio.StreamReader, writer: Any) -> None:
        self.reader = reader
        self.writer = writer
        self.next_id = 0
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.waiting: dict[Any, asyncio.Future[Any]] = {}
        self.unmatched: list[Any] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while line := await self.reader.readline():
            message = msgspec.json.decode(line)
            future = self.waiting.pop(message.get("id"), None)
            if future is not None:
                future.set_result(message)
            else:
                self.unmatched.append(message)
                await self.inbox.put(message)
        await self.inbox.put(None)

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def receive(self) -> Any:
        """The next message that answers no request sent with call()."""
        message = await asyncio.wait_for(self.inbox.get(), 20)
        assert message is not None, "the server closed the stream"
        self.unmatched.remove(message)
        return message

    async def closed(self) -> bool:
        return await asyncio.wait_for(self.inbox.get(), 20) is None

    async def close(self) -> None:
        self.writer.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def call(self, method: str, params: Any = None, **extra: Any) -> Any:
        self.next_id += 1
        frame: dict[str, Any] = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if params is not None:
            frame["params"] = params
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = future
        await self.send_raw(msgspec.json.encode({**frame, **extra}) + b"\n")
        return await asyncio.wait_for(future, 20)

    async def ok(self, method: str, params: Any) -> Any:
        answer = await self.call(method, params)
        assert "error" not in answer, answer
        return answer["result"]

    async def setup(self, workspace: Path) -> None:
        await self.ok("runner.register", {"runnerId": "r1", "hostInstanceId": "h1"})
        tool = {
            "runId": "run-1", "conversationId": "conv-1", "toolCallId": "call-1",
            "extensionId": "ext", "presets": [PRESET], "workspace": str(workspace),
        }  # fmt: skip
        assert await self.ok("tool.begin", tool) == {}

    async def read_until_done(self, params: dict[str, Any]) -> tuple[Any, list[Any]]:
        events: list[Any] = []
        while True:
            result = await self.ok("child.read", {**params, "after": len(events)})
            events += result.get("events", [])
            if result["done"]:
                return result, events
            await asyncio.sleep(0.05)


def start_params(request_id: str, message: str = "work in 3 steps", **extra: Any) -> Any:
    request = {"requestId": request_id, "profile": "scripted", "message": message}
    if "leaseId" in extra:
        request["leaseId"] = extra["leaseId"]
    return {**OWNER, **extra, "request": request}


async def host(*args: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "DELEGATION_SCRIPTED_DELAY": "0.05"}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "delegation.cli", "serve", *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env,
    )  # fmt: skip


async def socket_client(path: Path) -> Client:
    reader, writer = await asyncio.open_unix_connection(str(path), limit=8 * 1024 * 1024)
    return Client(reader, writer)
