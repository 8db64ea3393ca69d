"""The HTTP/1.1 pool: kept-alive connections to one upstream address (see the package docstring)."""

from __future__ import annotations

import logging

import h11
import trio

from blocks._h1 import H1Body, H1Stream
from blocks.errors import StreamReset, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from blocks.http import HOP_BY_HOP, Body, Headers, Request, Response, empty_body
from blocks.multiplexer._config import PoolStatistics, UpstreamConfig
from blocks.routing import Address

log = logging.getLogger("blocks.multiplexer")

# Retried once when a kept-alive h1 connection turns out to be closed.
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})


class _H1Connection(H1Stream):
    __slots__ = ("pumping", "tcp")

    def __init__(self, stream: trio.SocketStream) -> None:
        super().__init__(stream, h11.Connection(h11.CLIENT))
        self.tcp = stream
        self.pumping = False

    def close(self) -> None:
        self.tcp.socket.close()

    @property
    def h11(self) -> h11.Connection:
        return self.conn


class H1ResponseBody(H1Body):
    """A response body read from a pooled h1 connection, which it returns when done."""

    __slots__ = ("_conn", "_pool")

    peer = "upstream"

    def __init__(self, conn: _H1Connection, pool: _H1Pool, length: int | None) -> None:
        super().__init__(conn, length)
        self._conn = conn
        self._pool = pool

    def finished(self, complete: bool) -> None:
        if not self._done:
            super().finished(complete)
            self._pool.release(self._conn, complete)


class _H1Pool:
    def __init__(self, address: Address, config: UpstreamConfig, nursery: trio.Nursery) -> None:
        self.address = address
        self.config = config
        self.nursery = nursery
        self.idle: list[_H1Connection] = []
        self.active = 0

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self.address, "h1", len(self.idle) + self.active, self.active)

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
        for conn in self.idle:
            conn.close()
        self.idle.clear()

    async def _connect(self) -> _H1Connection:
        try:
            with trio.fail_after(self.config.connect_timeout):
                return _H1Connection(await trio.open_tcp_stream(*self.address))
        except (OSError, trio.TooSlowError) as exc:
            raise UpstreamConnectError(f"cannot connect to {self.address[0]}:{self.address[1]}: {exc}") from exc

    async def request(self, request: Request, headers: Headers, timeout: float) -> Response:
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

    async def _exchange(
        self, conn: _H1Connection, request: Request, headers: Headers, body: Body, timeout: float, reused: bool
    ) -> Response:
        h = conn.h11
        out_headers = [(b"host", request.authority)]
        out_headers += [(n, v) for n, v in headers if n not in HOP_BY_HOP]
        if not body.ended and body.length is None:
            out_headers.append((b"transfer-encoding", b"chunked"))
        elif body.ended and request.method in (b"POST", b"PUT", b"PATCH"):
            out_headers = [(n, v) for n, v in out_headers if n != b"content-length"]
            out_headers.append((b"content-length", b"0"))
        data = h.send(h11.Request(method=request.method, target=request.path, headers=out_headers))
        try:
            if body.ended:
                data += h.send(h11.EndOfMessage())
                await conn.stream.send_all(data)
            else:
                await conn.stream.send_all(data)
                conn.pumping = True
                self.nursery.start_soon(self._pump, conn, body)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _StaleConnection from exc
        with trio.move_on_after(timeout) as scope:
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
            raise UpstreamTimeout(f"no response from {self.address} within {timeout}s")
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

    async def _pump(self, conn: _H1Connection, body: Body) -> None:
        h = conn.h11
        try:
            while chunk := await body.receive():
                await conn.stream.send_all(h.send(h11.Data(data=chunk)))
            await conn.stream.send_all(h.send(h11.EndOfMessage(headers=body.trailers or [])))
        except (StreamReset, trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
            # Either side gave up mid-upload: this connection cannot be reused.
            await trio.aclose_forcefully(conn.stream)
        finally:
            conn.pumping = False


class _StaleConnection(Exception):
    pass
