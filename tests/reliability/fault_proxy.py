"""FaultProxy: a loopback TCP forwarder, on its own thread, that stalls or resets the answers to POSTs.

Between the router and an engine: the router's polls (GETs) pass untouched, while the next ``times``
``POST /v1/...`` requests see the armed ``Fault`` on their answer: after ``after_bytes`` bytes of it,
the connection is reset (RST, both sides) or stalled (the connection stays open, nothing more is
forwarded). A stalled connection is released when the router gives up on it, so the engine sees its
client disconnect as it would behind a real stalled network.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Fault:
    """What happens to an answer: ``action`` once ``after_bytes`` of it have been forwarded."""

    action: Literal["reset", "stall"]
    after_bytes: int = 0


class _Connection:
    """One proxied connection; the fault (if any) is taken when a POST starts on it."""

    def __init__(
        self, proxy: FaultProxy, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter
    ) -> None:
        self.proxy, self.client, self.upstream = proxy, client, upstream
        self.fault: Fault | None = None
        self.forwarded = 0  # answer bytes forwarded since the fault was taken

    async def requests(self, reader: asyncio.StreamReader) -> None:
        while data := await reader.read(65536):
            if data.startswith(b"POST /v1/") and self.fault is None:
                self.fault = self.proxy.take()
                self.forwarded = 0
            self.upstream.write(data)
            await self.upstream.drain()

    async def answers(self, reader: asyncio.StreamReader) -> None:
        while data := await reader.read(65536):
            if self.fault is not None:
                room = max(self.fault.after_bytes - self.forwarded, 0)
                if len(data) > room:
                    self.client.write(data[:room])
                    await self.client.drain()
                    await self._apply(self.fault)
                    return
                self.forwarded += len(data)
            self.client.write(data)
            await self.client.drain()

    async def _apply(self, fault: Fault) -> None:
        if fault.action == "reset":
            self.close()
            return
        await asyncio.Event().wait()  # stalled until the client leaves (cancelled with the connection)

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            _reset(writer)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN (SO_LINGER 0), as a crashed peer or a middlebox does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.transport.abort()


class FaultProxy:
    """``127.0.0.1:port`` -> ``127.0.0.1:target_port``; ``arm`` a fault for the next POSTs, read ``faulted``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.faulted = 0  # POSTs that met a fault
        self._armed: Fault | None = None
        self._times = 0
        self._queued: list[Fault | None] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, fault: Fault | None, times: int = 1) -> None:
        """The next ``times`` POSTs meet ``fault`` (None: disarm)."""
        with self._lock:
            self._armed, self._times = fault, times if fault else 0
            self._queued = []

    def queue(self, faults: list[Fault | None]) -> None:
        """The next POSTs meet these faults in order (None: that POST passes), then none; one list given to
        several proxies is shared: each fault goes to whichever proxy's POST comes first."""
        with self._lock:
            self._queued = faults
            self._armed, self._times = None, 0

    def take(self) -> Fault | None:
        with self._lock:
            if self._queued:
                try:
                    fault = self._queued.pop(0)  # atomic: the list may be shared with other proxies' threads
                except IndexError:
                    return None
                self.faulted += fault is not None
                return fault
            if self._times <= 0:
                return None
            self._times -= 1
            self.faulted += 1
            return self._armed

    def close(self) -> None:
        self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            _reset(writer)
            return
        conn = _Connection(self, writer, up_writer)
        pumps = [asyncio.ensure_future(conn.requests(reader)), asyncio.ensure_future(conn.answers(up_reader))]
        with contextlib.suppress(Exception):  # either side ending (or failing) ends the connection
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        conn.close()
