"""The stream multiplexer, client side: pooled upstream connections.

:func:`open_upstreams` gives a service-lifetime :class:`Upstreams` whose
:meth:`~Upstreams.request` sends a request to an address and returns the
response as soon as its head arrives; the body streams after it.

HTTP/2 upstreams (the default): per address, a list of connections; a
request takes a stream slot on the first connection below the peer's
*current* ``SETTINGS_MAX_CONCURRENT_STREAMS`` (re-read on every
admission), a further connection is opened when all are full (up to
``max_connections``), and the slot is released on every path: response
done, reset, timeout, cancellation, connection loss. Connections are
opened in the pool's own nursery, never in a request's cancel scope, so a
request that gives up never leaves others waiting on a half-made connection.

HTTP/1.1 upstreams: a keep-alive pool of idle connections per address, one
request per connection at a time. A reused connection that turns out to be
closed is retried once on a fresh one when nothing of the request body was
sent.

Request bodies are pumped by a task the connection owns, so a handler can
return the response (and a listener start sending it) while the upload is
still going: bidirectional streaming.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h2.errors
import h2.events
import h2.exceptions
import h11
import trio

from blocks._h1 import H1Body, H1Stream
from blocks._h2 import H2Driver, H2Stream, make_h2
from blocks._splice import HeadFilter, Splice
from blocks._sync import Signal
from blocks.errors import StreamReset, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from blocks.http import HOP_BY_HOP, Body, Headers, Request, Response, empty_body
from blocks.routing import Address

log = logging.getLogger("blocks.multiplexer")


_CANCEL = h2.errors.ErrorCodes.CANCEL
# Retried once when a kept-alive h1 connection turns out to be closed.
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})


@attrs.frozen(kw_only=True)
class UpstreamConfig:
    """Knobs of the upstream pools. Durations in seconds.

    ``response_timeout`` bounds the wait for a response head (504 past it),
    checked every ``timeout_resolution`` seconds; a streaming body after the
    head is not bounded by it.
    """

    connect_timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    response_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    max_connections: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    max_streams_per_connection: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    max_idle_h1: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    stream_window: int = attrs.field(default=256 * 1024, validator=attrs.validators.ge(65535))
    connection_window: int = attrs.field(default=16 * 1024 * 1024, validator=attrs.validators.ge(65535))
    max_header_list_size: int = attrs.field(default=64 * 1024, validator=attrs.validators.ge(1024))
    timeout_resolution: float = attrs.field(default=0.05, validator=attrs.validators.gt(0))


@attrs.frozen
class PoolStatistics:
    address: Address
    protocol: str
    connections: int
    active_streams: int


# -- HTTP/2 -------------------------------------------------------------------------


class H2ClientConnection(H2Driver):
    """One pooled h2 connection to an upstream."""

    peer = "upstream"

    def __init__(self, stream: trio.abc.Stream, pool: _H2Pool) -> None:
        config = pool.config
        conn = make_h2(
            client_side=True,
            max_concurrent_streams=100,
            stream_window=config.stream_window,
            max_header_list_size=config.max_header_list_size,
        )
        super().__init__(stream, conn, connection_window=config.connection_window)
        self.pool = pool
        self._cap = config.max_streams_per_connection
        self.accepting = True  # false after a GOAWAY or a failure: no new streams
        self._nursery: trio.Nursery | None = None
        self._ready = trio.Event()
        self.handlers = {
            h2.events.ResponseReceived: self._on_response,
            h2.events.DataReceived: self.on_data,
            h2.events.StreamEnded: self._on_stream_ended,
            h2.events.TrailersReceived: self.on_trailers,
            h2.events.StreamReset: self.on_reset,
            h2.events.WindowUpdated: self.on_window_updated,
            h2.events.RemoteSettingsChanged: self.on_settings,
            h2.events.ConnectionTerminated: self._on_terminated,
        }

    def __repr__(self) -> str:
        host, port = self.pool.address
        return f"<H2ClientConnection {host}:{port} streams={len(self.streams)} accepting={self.accepting}>"

    @property
    def has_slot(self) -> bool:
        # Our own cap sits below the peer's: h2 scans every stream of a
        # connection each time one opens, so a few moderately loaded
        # connections cost far less CPU than one crowded one.
        n = len(self.streams)
        return self.accepting and n < self._cap and n < self.h2.remote_settings.max_concurrent_streams

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.start()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self.writer)
                nursery.start_soon(self._reader)
                # Usable once the peer's SETTINGS arrived: its stream limit is known.
                await self._ready.wait()
                if not self.closed:
                    task_status.started()
                await self._writer_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            self.mark_closed()
            self.pool.remove(self)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)

    def mark_closed(self) -> None:
        self.accepting = False
        super().mark_closed()
        self._ready.set()

    async def _reader(self) -> None:
        stream = self.stream
        try:
            while not self.closed:
                data = await stream.receive_some(65536)
                if not data:
                    break
                try:
                    events = self.h2.receive_data(data)
                except h2.exceptions.ProtocolError as exc:
                    log.warning("upstream %s broke the protocol: %s", self.pool.address, exc)
                    break
                self.dispatch(events)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.mark_closed()

    # -- streams -----------------------------------------------------------------

    def _send_head(self, request: Request, headers: Headers, end: bool) -> H2Stream:
        conn = self.h2
        sid = conn.get_next_available_stream_id()
        head = [
            (b":method", request.method),
            (b":scheme", request.scheme),
            (b":authority", request.authority),
            (b":path", request.path),
        ]
        head += headers
        conn.send_headers(sid, head, end_stream=end)
        st = H2Stream(sid)
        self.streams[sid] = st
        return st

    def open_spliced(
        self,
        request: Request,
        headers: Headers,
        down: H2Driver,
        down_st: H2Stream,
        *,
        request_ended: bool,
        head_filter: HeadFilter | None,
        on_close: Callable[[], None] | None,
    ) -> H2Stream:
        """Send the request head and join the new stream to ``down_st``. Never blocks."""
        st = self._send_head(request, headers, request_ended)
        self.mark()  # we are in a reader's batch: the head goes out when it ends
        Splice(down, down_st, self, st, request_ended=request_ended, head_filter=head_filter, on_close=on_close)
        return st

    def open_stream(self, request: Request, headers: Headers) -> H2Stream:
        """Send the request head (and start its body) on a new stream. Never blocks."""
        body = request.body
        end = body.ended and not body.trailers
        st = self._send_head(request, headers, end)
        self.kick()
        st.signal = Signal()
        if end:
            st.local_ended = True
        else:
            assert self._nursery is not None
            self._nursery.start_soon(self._pump, st, body)
        return st

    async def _pump(self, st: H2Stream, body: Body) -> None:
        with trio.CancelScope() as scope:
            st.cancel_scope = scope
            if st.closed:
                return
            try:
                await self.send_body(st, body)
            except StreamReset:
                # The client's upload broke, or the upstream stream went away.
                self.reset(st, _CANCEL)
                return
            except Exception:
                log.exception("request body pump failed")
                self.reset(st, _CANCEL)
                return
            st.local_ended = True
            if st.remote_ended:
                self.finish_stream(st)
        if scope.cancelled_caught and not body.ended:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await body.aclose()

    async def response(self, st: H2Stream) -> Response:
        """Wait for the response head on ``st`` (the pool's sweeper bounds the wait)."""
        if st.head is None and not st.closed:
            assert st.signal is not None
            try:
                await st.signal.wait()
            except BaseException:
                self.reset(st, _CANCEL)
                raise
        head: Response | None = st.head
        if head is None:
            if st.error is not None:
                raise st.error
            raise UpstreamProtocolError(f"upstream {self.pool.address} dropped the stream before a response")
        return head

    def fail_stream(self, st: H2Stream, error: BaseException) -> None:
        super().fail_stream(st, error)
        if st.cancel_scope is not None:
            st.cancel_scope.cancel()

    def stream_closed(self, st: H2Stream) -> None:
        self.pool.waiting.pop(st, None)
        self.pool.slot_freed()
        if not self.accepting and not self.streams and not self.closed:
            try:
                self.h2.close_connection()
            except h2.exceptions.ProtocolError:
                pass
            self.mark_closed()

    # -- events --------------------------------------------------------------------

    def _on_response(self, ev: h2.events.ResponseReceived) -> None:
        st = self.streams.get(ev.stream_id)
        if st is None:
            return
        self.pool.waiting.pop(st, None)
        status = 0
        headers: Headers = []
        length = None
        for name, value in ev.headers:
            if name[0] == 58:
                if name == b":status":
                    status = int(value)
            else:
                if name == b"content-length" and value.isdigit():
                    length = int(value)
                headers.append((name, value))
        if st.splice is not None:
            st.splice.head(status, headers, ev.stream_ended is not None)
            return
        body = empty_body() if ev.stream_ended is not None else self.new_inbound_body(st, length)
        st.head = Response(status, headers, body)
        if st.signal is not None:
            st.signal.set()

    def _on_stream_ended(self, ev: h2.events.StreamEnded) -> None:
        st = self.streams.get(ev.stream_id)
        if st is None:
            return
        if st.splice is not None:
            st.splice.ended(st)
            return
        st.remote_ended = True
        if st.body is not None:
            st.body.end()
        if st.local_ended:
            self.finish_stream(st)

    def on_settings(self, ev: h2.events.RemoteSettingsChanged) -> None:
        self._ready.set()
        super().on_settings(ev)
        self.pool.slot_freed()

    def _on_terminated(self, ev: h2.events.ConnectionTerminated) -> None:
        self.accepting = False
        last = ev.last_stream_id if ev.last_stream_id is not None else 0
        for st in [st for sid, st in self.streams.items() if sid > last]:
            self.fail_stream(st, StreamReset("refused by the upstream's GOAWAY"))
        if not self.survive_goaway(ev):
            self.mark_closed()
        self.pool.slot_freed()


class _Attempt:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


class _H2Pool:
    def __init__(self, address: Address, config: UpstreamConfig, nursery: trio.Nursery) -> None:
        self.address = address
        self.config = config
        self.nursery = nursery
        self.connections: list[H2ClientConnection] = []
        # Streams waiting for a response head -> their deadline. Insertion
        # order is deadline order (one timeout per pool), so the sweeper only
        # looks at the front.
        self.waiting: dict[H2Stream, tuple[float, H2ClientConnection]] = {}
        self._attempt: _Attempt | None = None
        self._freed = trio.Event()

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self.address, "h2", len(self.connections), sum(len(c.streams) for c in self.connections))

    def slot_freed(self) -> None:
        self._freed.set()

    def remove(self, conn: H2ClientConnection) -> None:
        if conn in self.connections:
            self.connections.remove(conn)
        self._freed.set()

    async def _connect(self, attempt: _Attempt) -> None:
        try:
            with trio.fail_after(self.config.connect_timeout):
                stream = await trio.open_tcp_stream(*self.address)
                conn = H2ClientConnection(stream, self)
                await self.nursery.start(conn.run)
            self.connections.append(conn)
        except (OSError, trio.TooSlowError, RuntimeError) as exc:
            attempt.error = exc
        finally:
            self._attempt = None
            attempt.done.set()
            self._freed.set()

    async def acquire(self) -> H2ClientConnection:
        """A connection with a free stream slot; waits for one if the pool is full."""
        while True:
            for conn in self.connections:
                if conn.has_slot:
                    return conn
            attempt = self._attempt
            if attempt is None and len(self.connections) < self.config.max_connections:
                attempt = self._attempt = _Attempt()
                self.nursery.start_soon(self._connect, attempt)
            if attempt is not None:
                await attempt.done.wait()
                if attempt.error is not None:
                    raise UpstreamConnectError(
                        f"cannot connect to {self.address[0]}:{self.address[1]}: {attempt.error}"
                    ) from attempt.error
                continue
            if self._freed.is_set():
                self._freed = trio.Event()
            await self._freed.wait()

    def expire(self, now: float) -> None:
        """Fail every stream whose response head is overdue: 504."""
        waiting = self.waiting
        while waiting:
            st = next(iter(waiting))
            deadline, conn = waiting[st]
            if deadline > now:
                return
            del waiting[st]
            st.error = UpstreamTimeout(f"no response from {self.address} within {self.config.response_timeout}s")
            conn.reset(st, _CANCEL)

    def splice(
        self,
        request: Request,
        headers: Headers,
        down: H2Driver,
        down_st: H2Stream,
        request_ended: bool,
        head_filter: HeadFilter | None,
        on_close: Callable[[], None] | None,
    ) -> bool:
        for conn in self.connections:
            if conn.has_slot:
                break
        else:
            return False
        try:
            st = conn.open_spliced(
                request, headers, down, down_st, request_ended=request_ended, head_filter=head_filter, on_close=on_close
            )
        except h2.exceptions.ProtocolError:
            return False
        self.waiting[st] = (trio.current_time() + self.config.response_timeout, conn)
        return True

    async def request(self, request: Request, headers: Headers, timeout: float) -> Response:
        for conn in self.connections:
            if conn.has_slot and timeout == self.config.response_timeout:
                # The common case: a free slot now, the pool's own timeout. The
                # sweeper bounds the wait; no cancel scope per request.
                st = self._open(conn, request, headers)
                self.waiting[st] = (trio.current_time() + timeout, conn)
                return await conn.response(st)
        # Waiting for a slot, or a timeout of its own: one deadline for both.
        with trio.move_on_after(timeout):
            conn = await self.acquire()
            st = self._open(conn, request, headers)
            return await conn.response(st)
        raise UpstreamTimeout(f"no response from {self.address} within {timeout}s")

    def _open(self, conn: H2ClientConnection, request: Request, headers: Headers) -> H2Stream:
        try:
            return conn.open_stream(request, headers)
        except h2.exceptions.ProtocolError as exc:
            raise UpstreamProtocolError(f"cannot open a stream to {self.address}: {exc}") from exc


# -- HTTP/1.1 ---------------------------------------------------------------------------


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


# -- the service ----------------------------------------------------------------------


@attrs.define(eq=False)
class Upstreams:
    """Every upstream pool of one hop. Use :func:`open_upstreams`."""

    config: UpstreamConfig
    _nursery: trio.Nursery
    _pools: dict[tuple[Address, str], Any] = attrs.field(factory=dict)

    def statistics(self) -> list[PoolStatistics]:
        return [pool.statistics() for pool in self._pools.values()]

    async def _sweep(self) -> None:
        # One timer for every response-head deadline of this hop: far cheaper
        # than a cancel scope per request, at the cost of this resolution.
        resolution = self.config.timeout_resolution
        while True:
            await trio.sleep(resolution)
            now = trio.current_time()
            for pool in self._pools.values():
                if type(pool) is _H2Pool and pool.waiting:
                    pool.expire(now)

    def splice(
        self,
        address: Address,
        request: Request,
        headers: Headers,
        down: H2Driver,
        down_st: H2Stream,
        *,
        request_ended: bool,
        head_filter: HeadFilter | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> bool:
        """The fast path: join ``down_st`` to a new h2 stream to ``address``, if one is free now.

        Returns False, having done nothing, when no pooled connection has a
        free stream slot (the caller then takes the awaiting path, which may
        open one). ``on_close`` runs once when the exchange ends, however it ends.
        """
        pool = self._pools.get((address, "h2"))
        if pool is None:
            return False
        done: bool = pool.splice(request, headers, down, down_st, request_ended, head_filter, on_close)
        return done

    async def request(
        self,
        address: Address,
        request: Request,
        headers: Headers,
        *,
        protocol: str = "h2",
        timeout: float | None = None,
    ) -> Response:
        """Send ``request`` (its method, scheme, authority, path and body) with ``headers``.

        Returns once the response head arrived. Raises
        :class:`~blocks.errors.UpstreamConnectError` (502) when the upstream
        cannot be reached, :class:`~blocks.errors.UpstreamTimeout` (504) when
        no head comes within ``timeout`` (default ``response_timeout``),
        :class:`~blocks.errors.UpstreamProtocolError` (502) when the stream
        dies before its head.
        """
        pool = self._pools.get((address, protocol))
        if pool is None:
            if protocol == "h2":
                pool = _H2Pool(address, self.config, self._nursery)
            elif protocol == "h1":
                pool = _H1Pool(address, self.config, self._nursery)
            else:
                raise ValueError(f"unknown upstream protocol {protocol!r}")
            self._pools[(address, protocol)] = pool
        response: Response = await pool.request(
            request, headers, self.config.response_timeout if timeout is None else timeout
        )
        return response


@asynccontextmanager
async def open_upstreams(config: UpstreamConfig | None = None) -> AsyncIterator[Upstreams]:
    """The upstream pools of one hop, alive for the ``async with`` block.

    Leaving the block closes every pooled connection.
    """
    async with trio.open_nursery() as nursery:
        upstreams = Upstreams(config or UpstreamConfig(), nursery)
        nursery.start_soon(upstreams._sweep)
        try:
            yield upstreams
        finally:
            nursery.cancel_scope.cancel()
            for pool in upstreams._pools.values():
                if type(pool) is _H1Pool:
                    pool.close_idle()
