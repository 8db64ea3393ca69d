"""Just enough of an HTTP/1.1 client (h11 on trio) for etcd's JSON gateway.

Why not httpx: a watch is a response that never ends, abandoned when the
reconciler moves on. httpx reads a streamed body through a chain of async
generators (httpx and httpcore, one per layer) that nothing closes when the
reader stops early, and trio rightly warns about each of them (open in
httpx as encode/httpx#3686). Here a watch is one object on one connection,
every read is a plain ``await`` under a cancel scope the caller sets, and
closing it closes the socket. etcd's client port needs HTTP/1.1 for the
gateway anyway (it hands every HTTP/2 connection to gRPC).

Every failure to reach or understand the server is :class:`SourceUnavailable`.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs
import h11
import trio

from blocks.errors import SourceUnavailable
from blocks.transport.streams import H1Stream

_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError)


def describe(exc: BaseException) -> str:
    """``Type: message``, and the first underlying error (trio's connect failures wrap theirs)."""
    text = str(exc)
    described = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    cause = exc.__cause__
    while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[0]
    if cause is not None:
        described += f" ({describe(cause)})"
    return described


@attrs.frozen
class Endpoint:
    """Where an HTTP server is: ``http://host:port`` or ``https://host:port``, with an optional base path."""

    scheme: str
    host: str
    port: int
    base_path: str
    ssl_context: ssl.SSLContext | None = attrs.field(default=None, eq=False)
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(
        cls, url: str, *, ssl_context: ssl.SSLContext | None = None, headers: Sequence[tuple[str, str]] = ()
    ) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if parts.scheme == "https" and ssl_context is None:
            ssl_context = ssl.create_default_context()
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), ssl_context, tuple(headers))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.base_path}"

    async def connect(self) -> trio.abc.Stream:
        """A connection (TLS done, for https), or :class:`SourceUnavailable`. Cancel-safe."""
        try:
            tcp = await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise SourceUnavailable(f"{self.url}: {describe(exc)}") from exc
        if self.ssl_context is None:
            return tcp
        tls = trio.SSLStream(tcp, self.ssl_context, server_hostname=self.host)
        try:
            await tls.do_handshake()
        except BaseException as exc:
            await trio.aclose_forcefully(tls)
            if isinstance(exc, _ERRORS):
                raise SourceUnavailable(f"{self.url}: TLS: {describe(exc)}") from exc
            raise
        return tls


class Exchange:
    """One request on its own connection, and its response read as it comes.

    ``async with Exchange(endpoint, path, body, timeout=...) as exchange``:
    connects and sends the request within ``timeout`` seconds (or raises
    :class:`SourceUnavailable`), then :meth:`status`, :meth:`read_all` or
    :meth:`next_line`, each bounded by the caller. Leaving the block closes
    the connection, whatever was read. Nothing here holds a cancel scope
    open between calls, so an async generator may yield inside the block.
    """

    def __init__(self, endpoint: Endpoint, path: str, body: Any, *, timeout: float) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.path = endpoint.base_path + path
        self.where = endpoint.url + path
        self.payload = json.dumps(body, separators=(",", ":")).encode()
        self._h1: H1Stream | None = None
        self._buffer = bytearray()
        self._ended = False

    async def __aenter__(self) -> Exchange:
        try:
            with trio.move_on_after(self.timeout) as scope:
                await self._send()
            if scope.cancelled_caught:
                raise SourceUnavailable(f"{self.where}: could not connect and send within {self.timeout:g}s")
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _send(self) -> None:
        stream = await self.endpoint.connect()
        self._h1 = h1 = H1Stream(stream, h11.Connection(h11.CLIENT))
        headers = [
            ("host", f"{self.endpoint.host}:{self.endpoint.port}"),
            ("content-type", "application/json"),
            ("content-length", str(len(self.payload))),
            ("connection", "close"),
            *self.endpoint.headers,
        ]
        try:
            data = h1.conn.send(h11.Request(method="POST", target=self.path, headers=headers))
            data += h1.conn.send(h11.Data(data=self.payload)) + h1.conn.send(h11.EndOfMessage())
            await stream.send_all(data)
        except _ERRORS as exc:
            raise SourceUnavailable(f"{self.where}: {describe(exc)}") from exc

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection at once (no TLS goodbye): a checkpoint, never blocks."""
        if self._h1 is not None:
            await trio.aclose_forcefully(self._h1.stream)

    async def _event(self) -> Any:
        assert self._h1 is not None
        try:
            return await self._h1.next_event()
        except _ERRORS as exc:
            raise SourceUnavailable(f"{self.where}: {describe(exc)}") from exc

    async def status(self) -> int:
        """The response's status code (after any 1xx)."""
        while True:
            event = await self._event()
            if isinstance(event, h11.Response):
                return int(event.status_code)
            if isinstance(event, h11.ConnectionClosed):
                raise SourceUnavailable(f"{self.where}: closed before a response")

    async def _more(self) -> bool:
        """Read the next piece of the body into the buffer; False once the body is over."""
        while not self._ended:
            event = await self._event()
            if isinstance(event, h11.Data):
                self._buffer += event.data
                return True
            if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                self._ended = True
        return False

    async def read_all(self) -> bytes:
        while await self._more():
            pass
        return bytes(self._buffer)

    async def next_line(self) -> bytes | None:
        """The next newline-terminated line of the body (without the newline); ``None`` when it is over."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            if not await self._more():
                return None


async def post_json(endpoint: Endpoint, path: str, body: Any, *, timeout: float) -> dict[str, Any]:
    """POST ``body`` as JSON and return the JSON object answered with 200; otherwise SourceUnavailable."""
    where = endpoint.url + path
    with trio.move_on_after(timeout) as scope:
        async with Exchange(endpoint, path, body, timeout=timeout) as exchange:
            status = await exchange.status()
            data = await exchange.read_all()
    if scope.cancelled_caught:
        raise SourceUnavailable(f"{where}: no answer within {timeout:g}s")
    if status != 200:
        raise SourceUnavailable(f"{where}: HTTP {status}: {data[:200].decode(errors='replace')}")
    try:
        answer = json.loads(data)
    except ValueError as exc:
        raise SourceUnavailable(f"{where}: not JSON: {data[:200]!r}") from exc
    if not isinstance(answer, dict):
        raise SourceUnavailable(f"{where}: not a JSON object: {data[:200]!r}")
    return answer
