"""The WebSocket upgrade on HTTP/1.1: a request checked and handed on as a tunnel (``_websocket``), the
client's bytes once it is accepted (:class:`H1TunnelBody`), and the ``101`` and the tunnel served
(``_serve_tunnel``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import h11
import trio

from blocks.errors import BadRequest, StreamReset
from blocks.http import HOP_BY_HOP, Body, Headers, Request, Response, Wire, abandon, strip_hop_by_hop
from blocks.transport._h1 import H1Stream
from blocks.transport._upgrade import KEY_FIELDS, WEBSOCKET_VERSION, accept_token, comma_tokens, valid_key
from blocks.transport._validate import upgrade_required

if TYPE_CHECKING:
    from blocks.transport.listener import ListenerConfig

log = logging.getLogger("blocks.listener")


class H1TunnelBody(Body):
    """The client's bytes once its WebSocket is accepted: h11's leftovers, then the socket.

    Nothing is read before :meth:`open` (the 101 is out), so a refused
    upgrade leaves the connection's input untouched. The socket is read only
    as the consumer asks: back-pressure is the socket's. The end of the
    client's input is the end of the body; a broken socket, or an
    :meth:`aclose` while a read waits, is a :class:`~blocks.errors.StreamReset`.
    """

    __slots__ = ("_broken", "_done", "_gate", "_initial", "_stream", "_wire", "accept", "on_eof")

    def __init__(self, stream: trio.abc.Stream, accept: bytes, wire: Wire) -> None:
        super().__init__(None)
        self._stream = stream
        self._wire = wire  # counts what was received
        self._gate = trio.Event()
        self._initial = b""
        self._done = False
        self._broken = False
        self.accept = accept
        self.on_eof: Callable[[], None] | None = None  # called once the client's input has ended

    @property
    def ended(self) -> bool:
        return self._done and not self._broken

    @property
    def untouched(self) -> bool:
        """Before :meth:`open` (no 101 went out), nothing of it was read: it can go elsewhere."""
        return not self._gate.is_set()

    def open(self, initial: bytes) -> None:
        """The 101 went out: the client's bytes may flow (``initial``: what h11 read past the head)."""
        self._initial = initial
        self._gate.set()

    async def receive(self) -> bytes:
        if not self._gate.is_set():
            await self._gate.wait()
        if self._done:
            if self._broken:
                raise StreamReset("the client's tunnel closed")
            return b""
        if self._initial:
            data, self._initial = self._initial, b""
            self._wire.received += len(data)
            return data
        try:
            data = bytes(await self._stream.receive_some(65536))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._done = self._broken = True
            raise StreamReset("the client's tunnel broke") from exc
        self._wire.received += len(data)
        if not data:
            self._done = True
            if self.on_eof is not None:
                self.on_eof()
        return data

    async def aclose(self) -> None:
        if not self._done:
            self._done = self._broken = True
        self._gate.set()


def _websocket(
    event: h11.Request, method: bytes, headers: Headers, reader: H1Stream, config: ListenerConfig, wire: Wire
) -> tuple[Headers, H1TunnelBody] | None:
    """A WebSocket upgrade as a tunnel's fields and body; None for another Upgrade (served as before)."""
    if b"websocket" not in comma_tokens(headers, b"upgrade"):
        return None  # h2c and the like: an ordinary request, the upgrade ignored
    if method != b"GET":
        raise BadRequest("a WebSocket upgrade on a method other than GET")
    if event.http_version != b"1.1":
        raise BadRequest("a WebSocket upgrade on HTTP/1.0")
    if b"upgrade" not in comma_tokens(headers, b"connection"):
        raise BadRequest("Upgrade: websocket without Connection: upgrade")
    versions = [value for name, value in headers if name == b"sec-websocket-version"]
    if versions != [WEBSOCKET_VERSION]:
        raise upgrade_required()
    keys = [value for name, value in headers if name == b"sec-websocket-key"]
    if len(keys) != 1 or not valid_key(keys[0]):
        raise BadRequest("a missing or malformed sec-websocket-key")
    fields = [
        (name, value)
        for name, value in strip_hop_by_hop(headers)
        if name not in KEY_FIELDS and name != b"content-length"
    ]
    return fields, H1TunnelBody(reader.stream, accept_token(keys[0]), wire)


_NOT_IN_101 = frozenset({b"content-length", *KEY_FIELDS})


async def _serve_tunnel(
    stream: trio.abc.Stream, conn: h11.Connection, request: Request, response: Response, config: ListenerConfig
) -> None:
    """The handler accepted a WebSocket: 101, then the response body to the client until it ends.

    The client's bytes flow meanwhile through ``request.body``, pulled by
    whoever the handler gave it to. A write to the client that makes no
    progress for ``stall_timeout`` ends the tunnel (a client that stopped
    reading); once the client's input has ended, the upstream has
    ``close_timeout`` to end its side too. Whichever way it ends, both
    bodies are closed and the connection with them.
    """
    body = request.body
    assert type(body) is H1TunnelBody
    out = response.body
    wire = body._wire
    try:
        head = [(b"upgrade", b"websocket"), (b"connection", b"Upgrade"), (b"sec-websocket-accept", body.accept)]
        head += [(n, v) for n, v in response.headers if n not in HOP_BY_HOP and n not in _NOT_IN_101]
        switch = h11.InformationalResponse(status_code=101, headers=head, reason=b"Switching Protocols")
        await stream.send_all(conn.send(switch))
        body.open(conn.trailing_data[0])
        with trio.CancelScope() as scope:

            def client_done() -> None:
                scope.deadline = min(scope.deadline, trio.current_time() + config.close_timeout)

            body.on_eof = client_done
            while chunk := await out.receive():
                with trio.move_on_after(config.stall_timeout) as stalled:
                    await stream.send_all(chunk)
                    wire.sent += len(chunk)
                if stalled.cancelled_caught:
                    log.debug("the WebSocket client %s stopped reading; closing", request.client)
                    return
            if isinstance(stream, trio.abc.HalfCloseableStream):
                await stream.send_eof()
    except (StreamReset, h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        if not out.ended:
            await abandon(out)
        response.closed()
        await body.aclose()
