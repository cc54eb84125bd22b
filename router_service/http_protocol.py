"""uvicorn's httptools protocol with limits on what a client may do before its request is in.

uvicorn reads a request head of any size, for as long as the client takes, and keeps an
opened connection that never sends a byte. Against one client sending a 200 MiB header the
event loop stalled for seconds; against slowloris clients connections piled up. This
protocol answers, and closes:

- **431** when a request head grows past ``max_header_bytes`` before it is complete (it is
  not read further), or holds more than ``max_headers`` fields;
- **408** when a request head has not arrived within ``header_timeout_s`` of the
  connection's opening or of the first byte of a request on a kept-alive connection.

The body's timeout and budget are the app's (``proxy.read_body``); idle kept-alive
connections close after uvicorn's ``timeout_keep_alive``, and uvicorn's
``limit_concurrency`` caps the connections (503 past it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["guarded_protocol"]

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _GuardedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 * 1024
    max_headers = 100
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._awaiting_head = True
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(
            self.header_timeout_s, self._head_timed_out
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._awaiting_head:
            self._head_bytes += len(data)
            if self._head_timer is None:  # the first byte of a request on a kept-alive one
                self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)
        super().data_received(data)
        if self._awaiting_head and self._head_bytes > self.max_header_bytes:
            self._refuse(431, f"request head over {self.max_header_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        if len(self.headers) > self.max_headers:
            self._refuse(431, f"more than {self.max_headers} header fields")
            raise _Refused

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._awaiting_head, self._head_bytes = True, 0  # the next request on this connection

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # a parser error of our own making: the refusal is sent
            super().send_400_response(msg)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head and not self.transport.is_closing():
            self._refuse(408, f"request head not received within {self.header_timeout_s:g} s")

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, message: str) -> None:
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self._stop_head_timer()
        body = (
            b'{"error": {"message": "' + message.encode() + b'", "type": "request_refused", '
            b'"param": null, "code": ' + str(status).encode() + b"}}"
        )
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body)) + body
        )
        self.transport.close()


class _Refused(Exception):
    """Stops the parser inside a callback once the request is refused."""


def guarded_protocol(settings: Any) -> type[HttpToolsProtocol]:
    """The protocol class with ``settings``' limits (uvicorn's ``Config(http=...)``)."""
    return type(
        "GuardedHttpToolsProtocol",
        (_GuardedHttpToolsProtocol,),
        {
            "max_header_bytes": settings.max_header_bytes,
            "max_headers": settings.max_headers,
            "header_timeout_s": settings.header_timeout_s,
        },
    )
