"""A TCP proxy on loopback that can be partitioned: a network cut between a client and a
server (RELIABILITY.md F12, F13) without iptables.

``partition()`` stops moving bytes both ways on every connection and holds new ones
unanswered — what a dropped link does to a TCP stream: nothing arrives, nothing is lost
(the kernel buffers, the sender's writes back up), no connection is reset. ``heal()`` lets
everything flow again. The proxy runs its own event loop in a thread, so a test driving
subprocesses (no loop of its own) uses it the same way as an async test.
"""

from __future__ import annotations

import asyncio
import threading

from asyncrl.launch import free_port

CHUNK = 64 * 1024


class PartitionableTcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)

    @classmethod
    def for_url(cls, url: str) -> PartitionableTcpProxy:
        """A proxy in front of ``nats://host:port`` (or any ``scheme://host:port``)."""
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        return cls(host, int(port))

    def url(self, scheme: str = "nats") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self) -> PartitionableTcpProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    def partition(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def stop(self) -> None:
        async def close() -> None:
            self._open.set()
            self._server.close()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._open.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.connections += 1
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await self._open.wait()
            data = await reader.read(CHUNK)
            if not data:
                break
            await self._open.wait()  # a cut while this chunk was in flight holds it until heal
            writer.write(data)
            await writer.drain()
        writer.close()
