"""WebSocket apps written with trio-websocket, served by a blocks listener.

One port then serves ordinary HTTP and WebSockets, whether they come as an
HTTP/1.1 ``Upgrade`` or as an HTTP/2 extended CONNECT (RFC 8441): both reach
a handler as a tunnel (``request.protocol == b"websocket"``, see
:class:`~blocks.http.Request`), and :class:`WebSocketApp` hands each tunnel
to trio-websocket's own server, whose handler sees a
:class:`trio_websocket.WebSocketRequest` as it would on a socket of its own::

    async def chat(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept(subprotocol="chat.v1")
        async for ...: await ws.send_message(...)

    async with open_websocket_app(chat, pages) as app:   # pages: an ordinary blocks handler
        await serve_http(app, port=8080)

Theory of operation. trio-websocket's server (``WebSocketServer``) takes any
``trio.abc.Listener``; ours yields one :class:`_Tunnel` stream per tunnel.
A tunnel replays an HTTP/1.1 upgrade request built from the blocks request
(h11 writes it, with a key of its own), then the client's bytes. What the
server writes first is its handshake answer, which h11 parses (never by
hand) into the blocks response: a 101 becomes a 200 with its
``sec-websocket-protocol``/``-extensions``, whose body is every byte the
server writes after it; a rejection becomes its status, headers and body.

Guarantees:

- Back-pressure both ways: the server reads the client's bytes only as it
  asks (an h2 stream's window returns as it does), and a server that writes
  faster than the client reads waits once ``send_buffer`` bytes are queued.
- A WebSocket handler that raises is logged; if it had not answered yet the
  client gets a 500. It never stops the server or other tunnels.
- Whichever side goes first ends the other: the server closing its stream
  ends the response; the client going away (its stream reset, its
  connection lost, the response abandoned) breaks the server's stream, so
  its ``get_message``/``send_message`` raise ``ConnectionClosed``.
- Leaving :func:`open_websocket_app` cancels every WebSocket it serves.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import trio
import trio_websocket

from blocks import http
from blocks._sync import Signal, one_error
from blocks.errors import StreamReset
from blocks.http import Body, BytesBody, Handler, Headers, Request, Response, error_response, text_response
from blocks.transport import streams
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http

log = logging.getLogger("blocks.websocket")

WebSocketHandler = Callable[[trio_websocket.WebSocketRequest], Awaitable[None]]
"""What trio-websocket's server runs per WebSocket: ``async def handler(request) -> None``."""

# The fields the replayed handshake writes itself, whatever came with the request.
_OWN_FIELDS = frozenset({*streams.KEY_FIELDS, b"sec-websocket-version", b"content-length", b"host"})


@attrs.frozen(kw_only=True)
class WebSocketConfig:
    """Knobs of :func:`open_websocket_app`. Durations in seconds.

    ``message_queue_size``, ``max_message_size`` and ``disconnect_timeout``
    are trio-websocket's own (its defaults, except a shorter close wait).
    ``send_buffer``: bytes the app may have written that the client has not
    taken yet, past which its ``send_message`` waits.
    """

    message_queue_size: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    max_message_size: int = attrs.field(default=2**20, validator=attrs.validators.ge(1))
    disconnect_timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    send_buffer: int = attrs.field(default=64 * 1024, validator=attrs.validators.ge(1))


@attrs.frozen
class WebSocketStatistics:
    """``open``: WebSockets accepted and not yet closed; ``accepted`` and
    ``refused``: handshakes answered since start (a refusal is any answer
    other than accepting it)."""

    open: int
    accepted: int
    refused: int


async def _not_found(request: Request) -> Response:
    return text_response(404, "not found\n")


@attrs.define(eq=False)
class WebSocketApp:
    """A blocks handler: WebSockets to a trio-websocket handler, anything else to ``http``.

    Obtain one from :func:`open_websocket_app`. Ordinary requests cost one
    attribute check on their way to ``http``.
    """

    http: Handler
    config: WebSocketConfig
    _tunnels: trio.MemorySendChannel[_Tunnel]
    _open: int = 0
    _accepted: int = 0
    _refused: int = 0

    def statistics(self) -> WebSocketStatistics:
        return WebSocketStatistics(self._open, self._accepted, self._refused)

    async def __call__(self, request: Request) -> Response:
        if request.protocol is None:
            return await self.http(request)
        if request.protocol != b"websocket":
            return error_response(501)
        try:
            tunnel = _Tunnel(request, self.config.send_buffer)
        except h11.LocalProtocolError:
            return error_response(400)  # a head h11 will not write as HTTP/1.1
        try:
            await self._tunnels.send(tunnel)
            await tunnel.answered.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return error_response(503)  # the app is closing
        except BaseException:
            tunnel.abort()
            raise
        response = tunnel.answer
        assert response is not None
        if response.status != 200:
            self._refused += 1
            tunnel.abort()  # nothing more crosses it: let the server's reader go
            return response
        self._accepted += 1
        self._open += 1
        tunnel.on_close = self._closed
        response.call_on_close(tunnel.abort)  # the client's side is done, however it ended
        return response

    def _closed(self) -> None:
        self._open -= 1


@asynccontextmanager
async def open_websocket_app(
    ws_handler: WebSocketHandler, http: Handler | None = None, *, config: WebSocketConfig | None = None
) -> AsyncIterator[WebSocketApp]:
    """A :class:`WebSocketApp` whose trio-websocket server runs for the ``async with`` block.

    ``ws_handler`` gets each WebSocket's :class:`trio_websocket.WebSocketRequest`
    and accepts or rejects it, as with ``trio_websocket.serve_websocket``;
    ``http`` serves every other request (404 without one). Serve the app
    with :func:`~blocks.serve_http`. Leaving the block cancels every
    WebSocket still open.
    """
    config = config or WebSocketConfig()
    send, receive = trio.open_memory_channel[_Tunnel](0)
    app = WebSocketApp(http or _not_found, config, send)

    async def guarded(request: trio_websocket.WebSocketRequest) -> None:
        # trio-websocket lets a handler's exception take its whole server down.
        try:
            await ws_handler(request)
        except trio_websocket.ConnectionClosed:
            pass
        except Exception:
            log.exception("WebSocket handler failed for %s", request.path)

    # WebSocketServer's annotation names socket listeners; any trio Listener serves.
    listeners: list[Any] = [_TunnelListener(receive)]
    server = trio_websocket.WebSocketServer(
        guarded,
        listeners,
        message_queue_size=config.message_queue_size,
        max_message_size=config.max_message_size,
        receive_buffer_size=None,  # take each chunk as it comes
        disconnect_timeout=config.disconnect_timeout,
    )
    with one_error():
        async with send, trio.open_nursery() as nursery:
            await nursery.start(server.run)
            try:
                yield app
            finally:
                nursery.cancel_scope.cancel()


async def serve_websocket_app(
    ws_handler: WebSocketHandler,
    http: Handler | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    listener: ListenerConfig | None = None,
    config: WebSocketConfig | None = None,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """:func:`open_websocket_app` on :func:`~blocks.serve_http`; ``task_status`` gets the ``HTTPServer``.

    ``listener`` is the :class:`~blocks.ListenerConfig` (None: the default,
    which advertises extended CONNECT).
    """
    async with open_websocket_app(ws_handler, http, config=config) as app:
        await serve_http(app, host=host, port=port, config=listener, task_status=task_status)


class _TunnelListener(trio.abc.Listener[trio.abc.Stream]):
    """What trio-websocket's server accepts from: the tunnels :class:`WebSocketApp` is handed."""

    def __init__(self, tunnels: trio.MemoryReceiveChannel[_Tunnel]) -> None:
        self._tunnels = tunnels

    async def accept(self) -> trio.abc.Stream:
        try:
            return await self._tunnels.receive()
        except trio.EndOfChannel as exc:
            raise trio.ClosedResourceError("the WebSocket app closed") from exc

    async def aclose(self) -> None:
        await self._tunnels.aclose()


class _Tunnel(trio.abc.Stream):
    """One tunnel, as trio-websocket's server reads and writes it (see the module docstring).

    ``answer`` is set (and ``answered``) once the server has answered the
    handshake, or closed the stream without answering (a 500).
    """

    def __init__(self, request: Request, send_buffer: int) -> None:
        self._inbound = request.body
        parser = h11.Connection(h11.CLIENT)
        fields: Headers = [(b"host", request.authority)]
        fields += [(n, v) for n, v in request.headers if n not in http.HOP_BY_HOP and n not in _OWN_FIELDS]
        fields += [
            (b"connection", b"Upgrade"),
            (b"upgrade", b"websocket"),
            (b"sec-websocket-key", streams.new_key()),
            (b"sec-websocket-version", streams.WEBSOCKET_VERSION),
        ]
        head = parser.send(h11.Request(method=b"GET", target=request.path, headers=fields))
        self._pending = head + parser.send(h11.EndOfMessage())  # what receive_some returns first
        self._parser = parser
        self._refusal: tuple[int, Headers] | None = None
        self._refusal_body = bytearray()
        self._out = _Outbound(send_buffer, self.abort)
        self._reading: trio.CancelScope | None = None
        self._aborted = False
        self._closed = False
        self.answer: Response | None = None
        self.answered = trio.Event()
        self.on_close: Callable[[], None] | None = None

    def _answer(self, response: Response) -> None:
        self.answer = response
        self.answered.set()

    # -- what the server reads -----------------------------------------------------------

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("the tunnel is closed")
        if not self._pending:
            with trio.CancelScope() as scope:
                self._reading = scope
                if self._aborted:
                    scope.cancel()
                try:
                    if self.answer is None:
                        # wsproto's server drops what comes with the handshake
                        # request: the client's bytes wait for the answer.
                        await self.answered.wait()
                    self._pending = await self._inbound.receive()
                except StreamReset as exc:
                    raise trio.BrokenResourceError("the client's side of the tunnel broke") from exc
                finally:
                    self._reading = None
            if scope.cancelled_caught:
                raise trio.BrokenResourceError("the client's side of the tunnel is gone")
        else:
            await trio.lowlevel.checkpoint()
        data = self._pending
        if max_bytes is not None and len(data) > max_bytes:
            data, self._pending = data[:max_bytes], data[max_bytes:]
        else:
            self._pending = b""
        return data

    # -- what the server writes ----------------------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the tunnel is closed")
        if self.answer is not None:
            if self._aborted:
                raise trio.BrokenResourceError("the client's side of the tunnel is gone")
            await self._out.send(bytes(data))
            return
        await trio.lowlevel.checkpoint()
        try:
            self._handshake(bytes(data))
        except h11.ProtocolError as exc:
            log.warning("a WebSocket server answered its handshake with something h11 cannot read: %s", exc)
            self._answer(error_response(502))
            raise trio.BrokenResourceError("bad handshake answer") from exc

    def _handshake(self, data: bytes) -> None:
        """Read the server's handshake answer; the answer is set once it is complete."""
        parser = self._parser
        parser.receive_data(data)
        while self.answer is None:
            event = parser.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.InformationalResponse):
                if event.status_code == 101:
                    fields = [(n, v) for n, v in event.headers if n not in http.HOP_BY_HOP and n not in _OWN_FIELDS]
                    self._answer(Response(200, fields, self._out))
                    early = parser.trailing_data[0]  # frames written with the answer
                    if early:
                        self._out.put(early)
            elif isinstance(event, h11.Response):
                self._refusal = (event.status_code, [(n, v) for n, v in event.headers if n not in http.HOP_BY_HOP])
            elif isinstance(event, h11.Data):
                self._refusal_body += event.data
            elif isinstance(event, h11.EndOfMessage) and self._refusal is not None:
                status, fields = self._refusal
                self._answer(Response(status, fields, BytesBody(bytes(self._refusal_body))))

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    # -- ends ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """The server is done with the tunnel: end the response (a 500 if it never answered)."""
        if not self._closed:
            self._closed = True
            if self.answer is None:
                log.warning("a WebSocket handler returned without accepting or rejecting")
                self._answer(error_response(500))
            self._out.end()
            if self._reading is not None:
                self._reading.cancel()
            callback, self.on_close = self.on_close, None
            if callback is not None:
                callback()
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        """The client's side is done (response sent or abandoned, handler cancelled): break the server's stream."""
        self._aborted = True
        if self._reading is not None:
            self._reading.cancel()
        self._out.fail()


class _Outbound(Body):
    """What the server writes after its 101, on its way to the client: a pipe of bounded size.

    ``send`` waits while ``limit`` bytes are queued; a consumer that
    abandons the body breaks the pipe (``on_abandon``).
    """

    __slots__ = ("_chunks", "_ended", "_failed", "_limit", "_readable", "_size", "_writable", "on_abandon")

    def __init__(self, limit: int, on_abandon: Callable[[], None]) -> None:
        super().__init__(None)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._limit = limit
        self._readable = Signal()
        self._writable = Signal()
        self._ended = False
        self._failed = False
        self.on_abandon = on_abandon

    @property
    def ended(self) -> bool:
        return self._ended and not self._chunks and not self._failed

    @property
    def buffered(self) -> int:
        return self._size

    def put(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self._readable.set()

    async def send(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        while self._size >= self._limit and not self._failed:
            await self._writable.wait()
        if self._failed or self._ended:
            raise trio.BrokenResourceError("the client's side of the tunnel is gone")
        self.put(data)

    def end(self) -> None:
        self._ended = True
        self._readable.set()

    def fail(self) -> None:
        if not self._failed:
            self._failed = True
            self._chunks.clear()
            self._size = 0
            self._readable.set()
            self._writable.set()

    async def receive(self) -> bytes:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._size -= len(chunk)
                self._writable.set()
                return chunk
            if self._failed:
                raise StreamReset("the WebSocket tunnel was abandoned")
            if self._ended:
                return b""
            await self._readable.wait()

    async def aclose(self) -> None:
        if not self.ended:
            self.fail()
            self.on_abandon()


__all__ = [
    "WebSocketApp",
    "WebSocketConfig",
    "WebSocketHandler",
    "WebSocketStatistics",
    "open_websocket_app",
    "serve_websocket_app",
]
