"""HeaderDeadlineH11: uvicorn's HTTP/1.1 protocol that drops clients too slow to send their request headers.

uvicorn bounds idle keep-alive connections but not a request whose headers trickle in (slow-loris):
such a connection stayed open forever. Here each connection must deliver a request's headers within
``HEADER_TIMEOUT_S`` of connecting or of its previous response, or it is closed.
"""

from __future__ import annotations

import asyncio
import contextlib

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class HeaderDeadlineH11(H11Protocol):
    """Pass as ``uvicorn.Config(http=HeaderDeadlineH11)``."""

    _deadline: asyncio.TimerHandle | None = None
    _waiting_for: object = None  # the cycle that was current when the deadline was armed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's headers on this keep-alive connection

    def handle_events(self) -> None:
        super().handle_events()
        if self._deadline is not None and self.cycle is not self._waiting_for:
            self._disarm()  # a new request's headers arrived

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._waiting_for = self.cycle
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.warning(
                "closing a connection whose request headers took over %.0f s", HEADER_TIMEOUT_S
            )
            if self.conn.our_state != h11.ERROR:
                with contextlib.suppress(h11.LocalProtocolError):
                    self.conn.send(h11.ConnectionClosed())
            self.transport.close()
