"""The HTTP/1.1 pool: kept-alive connections to one upstream address (see the package docstring).

A WebSocket (a request with ``protocol = b"websocket"``) takes a connection
of its own, never pooled: ``GET`` with ``Upgrade: websocket`` and a fresh
key, the 101 awaited within the request's timeout (504 past it), its
``Sec-WebSocket-Accept`` checked (502 if wrong, or if a 2xx comes instead);
any other status is relayed as the answer. After the 101 the connection is
two pipes, :class:`_H1Tunnel`: the response body is what the upstream sends,
and a task in the pool's nursery writes the request body to it, each write
bounded by ``stall_timeout``. Whichever side ends or fails first closes the
connection, which ends the other.
"""

from __future__ import annotations

import functools
import logging
import math

import h11
import trio

from blocks.errors import StreamReset, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from blocks.http import HOP_BY_HOP, Body, Headers, Request, Response, abandon, empty_body
from blocks.transport import Address
from blocks.transport._h1 import H1Body, H1Stream
from blocks.transport._upgrade import KEY_FIELDS, WEBSOCKET_VERSION, accept_token, comma_tokens, new_key
from blocks.transport.multiplexer._config import Dial, PoolStatistics, UpstreamConfig

log = logging.getLogger("blocks.multiplexer")

# Retried once when a kept-alive h1 connection turns out to be closed.
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})
# What a WebSocket's h1 leg writes for itself, whatever came from downstream.
_OWN_FIELDS = frozenset({*KEY_FIELDS, b"sec-websocket-version", b"content-length", b"host"})


class _H1Connection(H1Stream):
    __slots__ = ("pumping", "tcp")

    def __init__(self, stream: trio.abc.Stream) -> None:
        super().__init__(stream, h11.Connection(h11.CLIENT))
        # The socket under it (under TLS too): a connection we drop is closed at once, without a flush.
        tcp = stream.transport_stream if type(stream) is trio.SSLStream else stream
        assert type(tcp) is trio.SocketStream
        self.tcp = tcp
        self.pumping = False

    def close(self) -> None:
        self.tcp.socket.close()

    @property
    def h11(self) -> h11.Connection:
        return self.conn


class H1ResponseBody(H1Body):
    """A response body read from a pooled h1 connection, which it returns when done.

    With ``reuse=False`` (the body of a refused upgrade) the connection is
    closed when the body is over instead.
    """

    __slots__ = ("_conn", "_pool", "_reuse")

    peer = "upstream"

    def __init__(self, conn: _H1Connection, pool: _H1Pool, length: int | None, *, reuse: bool = True) -> None:
        super().__init__(conn, length)
        self._conn = conn
        self._pool = pool
        self._reuse = reuse

    def finished(self, complete: bool) -> None:
        if not self._done:
            super().finished(complete)
            if self._reuse:
                self._pool.release(self._conn, complete)
            else:
                self._pool._drop(self._conn)


class _H1Pool:
    def __init__(
        self,
        address: Address,
        config: UpstreamConfig,
        nursery: trio.Nursery,
        *,
        dial: Dial | None = None,
        protocol: str = "h1",
    ) -> None:
        self.address = address
        self.config = config
        self.nursery = nursery
        self.protocol = protocol  # as the statistics name it: "h1", or "https" over TLS
        self._dial: Dial = dial or functools.partial(trio.open_tcp_stream, *address)
        self.idle: list[_H1Connection] = []
        self.active = 0
        self.tunnels: set[_H1Tunnel] = set()

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self.address, self.protocol, len(self.idle) + self.active, self.active)

    def splice(self, *args: object) -> bool:
        return False  # (an https upstream that negotiated HTTP/1.1: no stream to splice to)

    def sink(self, *args: object) -> bool:
        return False

    def adopt(self, stream: trio.abc.Stream) -> None:
        """Keep ``stream`` (just opened) as an idle connection: the next request takes it."""
        self.idle.append(_H1Connection(stream))

    def release(self, conn: _H1Connection, reuse: bool) -> None:
        self.active -= 1
        h = conn.h11
        if (
            reuse
            and not conn.pumping
            and h.our_state is h11.DONE
            and h.their_state is h11.DONE
            and len(self.idle) < self.config.max_idle_h1
        ):
            h.start_next_cycle()
            self.idle.append(conn)
        else:
            conn.close()  # synchronous: nothing to flush on a connection we drop

    def close_idle(self) -> None:
        """Close the idle connections, and every tunnel (the pool is closing)."""
        for conn in self.idle:
            conn.close()
        self.idle.clear()
        for tunnel in list(self.tunnels):
            tunnel.close()

    async def _connect(self) -> _H1Connection:
        try:
            with trio.fail_after(self.config.connect_timeout):
                return _H1Connection(await self._dial())
        except (OSError, trio.TooSlowError) as exc:
            raise UpstreamConnectError(f"cannot connect to {self.address[0]}:{self.address[1]}: {exc}") from exc

    async def request(self, request: Request, headers: Headers, timeout: float) -> Response:
        if request.protocol is not None:
            return await self._tunnel(request, headers, timeout)
        body = request.body
        for attempt in (0, 1):
            reused = bool(self.idle)
            conn = self.idle.pop() if reused else await self._connect()
            self.active += 1
            try:
                return await self._exchange(conn, request, headers, body, timeout, reused)
            except _StaleConnection:
                # A kept-alive connection the upstream had closed; nothing was processed.
                self.active -= 1
                await trio.aclose_forcefully(conn.stream)
                if attempt or not reused:
                    raise UpstreamConnectError(f"{self.address} closed the connection") from None
            except BaseException:
                self.active -= 1
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(conn.stream)
                raise
        raise AssertionError("unreachable")

    def _drop(self, conn: _H1Connection) -> None:
        """A connection that will never be reused: close it (no flush needed) and stop counting it."""
        self.active -= 1
        conn.close()

    async def _tunnel(self, request: Request, headers: Headers, timeout: float) -> Response:
        """A WebSocket to this upstream: the upgrade on a connection of its own (see the module docstring)."""
        if request.protocol != b"websocket":
            raise UpstreamProtocolError(f"no {request.protocol!r} tunnel over HTTP/1.1", status=501)
        key = new_key()
        fields: Headers = [(b"host", request.authority)]
        fields += [(n, v) for n, v in headers if n not in HOP_BY_HOP and n not in _OWN_FIELDS]
        fields += [
            (b"connection", b"Upgrade"),
            (b"upgrade", b"websocket"),
            (b"sec-websocket-key", key),
            (b"sec-websocket-version", WEBSOCKET_VERSION),
        ]
        conn = await self._connect()
        self.active += 1
        h = conn.h11
        try:
            with trio.move_on_after(timeout) as waited:
                head = h.send(h11.Request(method=b"GET", target=request.path, headers=fields))
                await conn.stream.send_all(head + h.send(h11.EndOfMessage()))
                event = await conn.next_event()
                while type(event) is h11.InformationalResponse and event.status_code != 101:
                    event = await conn.next_event()  # 100 Continue and the like
            if waited.cancelled_caught:
                raise UpstreamTimeout(f"no answer to a WebSocket upgrade from {self.address} within {timeout}s")
            if type(event) is h11.InformationalResponse:
                return self._switched(conn, event, key, request.body)
            if type(event) is not h11.Response:
                raise UpstreamProtocolError(f"{self.address} closed the connection instead of answering an upgrade")
            if event.status_code < 300:
                raise UpstreamProtocolError(f"{self.address} answered a WebSocket upgrade with {event.status_code}")
            # A refusal: relayed as it is, its body read from this connection, which then closes.
            answer = [(n, v) for n, v in event.headers if n not in HOP_BY_HOP]
            length = next((int(v) for n, v in answer if n == b"content-length"), None)
            return Response(event.status_code, answer, H1ResponseBody(conn, self, length, reuse=False))
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            self._drop(conn)
            raise UpstreamProtocolError(f"a broken answer to a WebSocket upgrade from {self.address}: {exc}") from exc
        except BaseException:
            self._drop(conn)
            raise

    def _switched(self, conn: _H1Connection, event: h11.InformationalResponse, key: bytes, body: Body) -> Response:
        """The upstream switched protocols: check it really accepted this key, then start the pipes."""
        answer = list(event.headers)
        accepts = [v for n, v in answer if n == b"sec-websocket-accept"]
        if accepts != [accept_token(key)] or b"websocket" not in comma_tokens(answer, b"upgrade"):
            raise UpstreamProtocolError(f"{self.address} switched protocols without accepting the WebSocket key")
        tunnel = _H1Tunnel(self, conn, conn.h11.trailing_data[0])
        body.claim()  # the pump reads it to the end or discards what it leaves
        self.nursery.start_soon(tunnel.pump, body)
        fields = [(n, v) for n, v in answer if n not in HOP_BY_HOP and n not in _OWN_FIELDS]
        return Response(200, fields, tunnel.body)

    async def _exchange(
        self, conn: _H1Connection, request: Request, headers: Headers, body: Body, timeout: float, reused: bool
    ) -> Response:
        h = conn.h11
        out_headers = [(b"host", request.authority)]
        out_headers += [(n, v) for n, v in headers if n not in HOP_BY_HOP]
        if len(out_headers) <= len(headers) and (b"te", b"trailers") in headers:
            # The one TE an h2 request carries (gRPC's); on h1 it is named in Connection (RFC 9110 10.1.4).
            out_headers += [(b"te", b"trailers"), (b"connection", b"te")]
        if not body.ended and body.length is None:
            out_headers.append((b"transfer-encoding", b"chunked"))
        elif body.ended and request.method in (b"POST", b"PUT", b"PATCH"):
            out_headers = [(n, v) for n, v in out_headers if n != b"content-length"]
            out_headers.append((b"content-length", b"0"))
        data = h.send(h11.Request(method=request.method, target=request.path, headers=out_headers))
        # The response clock starts when the request has gone whole (the pump starts it after an upload).
        scope = trio.CancelScope()
        try:
            if body.ended:
                data += h.send(h11.EndOfMessage())
                await conn.stream.send_all(data)
                scope.deadline = trio.current_time() + timeout
            else:
                await conn.stream.send_all(data)
                conn.pumping = True
                body.claim()  # the pump reads it to the end or discards what it leaves
                self.nursery.start_soon(self._pump, conn, body, scope, timeout)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _StaleConnection from exc
        with scope:
            while True:
                try:
                    event = await conn.next_event()
                except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError) as exc:
                    if reused and body.ended and request.method in _IDEMPOTENT:
                        raise _StaleConnection from exc
                    raise UpstreamProtocolError(f"bad response from {self.address}: {exc}") from exc
                if type(event) is h11.Response:
                    break
        if scope.cancelled_caught:
            if scope.deadline == math.inf:  # never started: the pump cancelled it, stalled
                raise UpstreamTimeout(f"{self.address} took no byte of the request for {self.config.stall_timeout}s")
            raise UpstreamTimeout(f"no response from {self.address} within {timeout}s of the request's end")
        length = None
        resp_headers: Headers = []
        for name, value in event.headers:
            if name in HOP_BY_HOP:
                continue
            if name == b"content-length":
                length = int(value)
            resp_headers.append((name, value))
        response_body: Body
        if h.their_state is h11.DONE or (length == 0 and request.method != b"HEAD"):
            if length == 0:
                await conn.next_event()  # the EndOfMessage
            self.release(conn, reuse=True)
            response_body = empty_body()
        elif request.method == b"HEAD" or event.status_code in (204, 304):
            await conn.next_event()
            self.release(conn, reuse=True)
            response_body = empty_body()
        else:
            response_body = H1ResponseBody(conn, self, length)
        return Response(event.status_code, resp_headers, response_body)

    async def _pump(self, conn: _H1Connection, body: Body, clock: trio.CancelScope, timeout: float) -> None:
        """Send the request body; once it has gone whole, start the response ``clock``.

        A write the upstream takes nothing of for ``stall_timeout`` stops the
        exchange: the connection is dropped and the response wait ends (504).
        """
        h = conn.h11
        stall = self.config.stall_timeout
        try:
            with trio.CancelScope() as stuck:
                while chunk := await body.receive():
                    stuck.deadline = trio.current_time() + stall
                    await conn.stream.send_all(h.send(h11.Data(data=chunk)))
                    stuck.deadline = math.inf
                stuck.deadline = trio.current_time() + stall
                await conn.stream.send_all(h.send(h11.EndOfMessage(headers=body.trailers or [])))
            if stuck.cancelled_caught:
                clock.cancel()
                await trio.aclose_forcefully(conn.stream)
                return
            clock.deadline = trio.current_time() + timeout
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The upstream stopped reading: it may have answered early (RFC 9112
            # 9.6), and its answer is still ours to read to the end. The
            # connection is not reused: the request never ended on it.
            pass
        except (StreamReset, h11.LocalProtocolError):
            # The client's upload broke: the upstream can never get a whole request.
            await trio.aclose_forcefully(conn.stream)
        finally:
            conn.pumping = False
            body.discard()  # whatever it did not send (nothing, once it ended) will never be read


class _StaleConnection(Exception):
    pass


class _H1Tunnel:
    """Both directions of an upgraded connection. The first to end or fail closes both.

    The response body (:class:`_TunnelBody`) reads the upstream as its
    consumer asks; :meth:`pump` writes the request body to it, each write
    within ``stall_timeout``. The end of the request body half-closes the
    connection (the upstream sees the client is done); the end of the
    upstream's output, a failed read or write, or an abandoned response body
    close it, which cancels the pump.
    """

    __slots__ = ("body", "closed", "conn", "pool", "scope")

    def __init__(self, pool: _H1Pool, conn: _H1Connection, initial: bytes) -> None:
        self.pool = pool
        self.conn = conn
        self.scope = trio.CancelScope()
        self.closed = False
        self.body = _TunnelBody(self, initial)
        pool.tunnels.add(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.scope.cancel()
            self.pool.tunnels.discard(self)
            self.pool._drop(self.conn)  # a read waiting on the socket fails at once

    async def pump(self, body: Body) -> None:
        stream = self.conn.stream
        stall = self.pool.config.stall_timeout
        failed = False
        try:
            with self.scope:
                while chunk := await body.receive():
                    with trio.move_on_after(stall) as stalled:
                        await stream.send_all(chunk)
                    if stalled.cancelled_caught:
                        log.debug("upstream %s stopped reading its WebSocket; closing", self.pool.address)
                        failed = True
                        break
                else:
                    if isinstance(stream, trio.abc.HalfCloseableStream):
                        await stream.send_eof()
                    return  # the response side goes on until the upstream ends it
        except (StreamReset, trio.BrokenResourceError, trio.ClosedResourceError):
            failed = True  # the client's side broke, or the upstream's
        except BaseException:
            self.close()  # the pool is closing
            body.discard()
            raise
        self.close()
        if failed and not body.ended:
            await abandon(body)


class _TunnelBody(Body):
    """What the upstream sends after its 101: h11's leftovers, then the socket as the consumer reads."""

    __slots__ = ("_broken", "_done", "_initial", "_tunnel")

    def __init__(self, tunnel: _H1Tunnel, initial: bytes) -> None:
        super().__init__(None)
        self._tunnel = tunnel
        self._initial = initial
        self._done = False
        self._broken = False

    @property
    def ended(self) -> bool:
        return self._done and not self._broken

    async def receive(self) -> bytes:
        if self._done:
            if self._broken:
                raise StreamReset("the upstream's tunnel broke")
            return b""
        if self._initial:
            data, self._initial = self._initial, b""
            return data
        try:
            data = bytes(await self._tunnel.conn.stream.receive_some(65536))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._done = self._broken = True
            self._tunnel.close()
            raise StreamReset("the upstream's tunnel broke") from exc
        if not data:
            self._done = True
            self._tunnel.close()
        return data

    async def aclose(self) -> None:
        if not self._done:
            self._done = self._broken = True
            self._tunnel.close()
