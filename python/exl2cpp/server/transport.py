"""The server's transport: what uvicorn does not bound by itself.

* :class:`Admission` (ASGI middleware): no new requests while the server drains (503, ``/health`` and ``/metrics``
  still answer); request bodies up to ``max_body_size`` bytes (413, from the Content-Length header or counted as a
  chunked body arrives) that must arrive within ``timeout_body`` seconds (408). Bodies are read here, before any
  endpoint parses JSON, so an oversized one never reaches memory whole.
* :func:`protocol`: uvicorn's h11 protocol with a deadline for a request's line and headers (``timeout_header``,
  from the connection or from the first byte of the next request on a keep-alive one) and a cap on open
  connections (``max_connections``; one more is answered 503 and closed). Idle keep-alive connections close after
  uvicorn's ``timeout_keep_alive``.
* :class:`RedactCredentials`: query parameters that look like credentials (``?api_key=...``) are logged as ``***``.
* :class:`Server`: uvicorn's server whose first SIGTERM drains (the app's ``drain`` coroutine) and then exits 0,
  and which stops with an error (:meth:`Server.fail`) when the app cannot start serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
from collections.abc import Awaitable, Callable
from urllib.parse import unquote_plus

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .schemas import error_body

log = logging.getLogger("exl2cpp.server")

OPEN_DURING_DRAIN = ("/health", "/metrics")


def _error_response(status: int, message: str, code: str, type_: str) -> tuple[list, bytes]:
    body = json.dumps(error_body(message, type_, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return headers, body


async def _refuse(send, status: int, message: str, code: str, type_: str = "invalid_request_error"):
    headers, body = _error_response(status, message, code, type_)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Admission:
    """ASGI middleware: refuses new requests while ``draining()``, reads each body (at most ``max_body_size`` bytes,
    within ``timeout_body`` seconds) and hands it to the app whole; after that, ``receive`` is the server's again
    (so the app still sees a client that disconnects)."""

    def __init__(self, app, max_body_size: int, timeout_body: float, draining: Callable[[], bool]):
        self.app = app
        self.max_body_size = max_body_size
        self.timeout_body = timeout_body
        self.draining = draining

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining() and scope["path"] not in OPEN_DURING_DRAIN:
            await _refuse(
                send,
                503,
                "the server is shutting down and takes no new requests; retry on another replica",
                "server_shutting_down",
                "server_error",
            )
            return
        limit = self.max_body_size
        for name, value in scope["headers"]:
            if name == b"content-length" and value.strip().isdigit() and int(value) > limit:
                await self._too_large(send, f"{int(value)} bytes")
                return
        chunks: list[bytes] = []

        async def read() -> str | None:
            """None when the body is complete, else why not ("large", "gone")."""
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return "gone"
                part = message.get("body", b"")
                size += len(part)
                if size > limit:
                    return "large"
                if part:
                    chunks.append(part)
                if not message.get("more_body", False):
                    return None

        try:
            problem = await asyncio.wait_for(read(), self.timeout_body)
        except asyncio.TimeoutError:
            await _refuse(
                send,
                408,
                f"the request body did not arrive within {self.timeout_body:g} s "
                "(this server's timeout_body)",
                "request_timeout",
            )
            return
        if problem == "gone":
            return
        if problem == "large":
            await self._too_large(send, "more")
            return
        body = b"".join(chunks)
        chunks.clear()
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send, size: str) -> None:
        await _refuse(
            send,
            413,
            f"the request body ({size}) is larger than this server's max_body_size of "
            f"{self.max_body_size} bytes",
            "request_too_large",
        )


def protocol(timeout_header: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header deadline and a connection cap (uvicorn's ``http=`` setting)."""

    class BoundedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                self._refused = True
                headers, body = _error_response(
                    503,
                    f"this server has {max_connections} connections open (its max_connections); "
                    "retry later",
                    "too_many_connections",
                    "server_error",
                )
                head = b"HTTP/1.1 503 Service Unavailable\r\n" + b"".join(
                    k + b": " + v + b"\r\n" for k, v in headers
                )
                transport.write(head + b"\r\n" + body)
                transport.close()
                return
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            self._cancel_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if (
                self.conn.their_state is h11.IDLE
            ):  # the next request's first bytes: its headers are due
                self._arm_header_timer()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # its line and headers are in
                self._cancel_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_header, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol


_CREDENTIAL = re.compile(r"key|token|secret|passw|auth|signature|credential|session", re.IGNORECASE)


def redact_query(target: str) -> str:
    """``/path?api_key=sk-x&n=1`` -> ``/path?api_key=***&n=1``: values of credential-like parameters hidden."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    parts = []
    for part in re.split(r"([&;])", query):
        name, eq, _value = part.partition("=")
        parts.append(f"{name}=***" if eq and _CREDENTIAL.search(unquote_plus(name)) else part)
    return path + sep + "".join(parts)


class RedactCredentials(logging.Filter):
    """For uvicorn's access log, whose record args are (client, method, path with query, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


class Server(uvicorn.Server):
    """A uvicorn server whose first SIGTERM runs ``drain()`` before the usual shutdown and then exits 0 (a second
    SIGTERM stops at once; Ctrl-C is uvicorn's shutdown); :meth:`fail` stops it with an error for :attr:`error`."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self._drain = drain
        self._drain_asked = False
        self._drain_task: asyncio.Task | None = None
        self.error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and self.started and not self.should_exit:
            if not self._drain_asked:
                self._drain_asked = True  # picked up by the next tick, on the event loop
                return
            self.force_exit = True  # the second one: no more waiting
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_asked and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:  # shut down all the same
            log.exception("draining failed")
        self.should_exit = True
