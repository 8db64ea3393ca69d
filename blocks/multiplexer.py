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

GOAWAY and safe retry (RFC 9113 8.7). A connection that receives GOAWAY
takes no new stream (new requests choose or open another connection; a
draining connection does not count toward ``max_connections``); its streams
at or below the GOAWAY's last stream id finish normally, and those above it,
like a stream reset with ``REFUSED_STREAM``, were never processed. Such a
request is retried once on another connection to the same address when none
of its body has gone upstream yet, on the awaiting path and the spliced one
alike; a second refusal, or a refusal after the first body byte, is a 503
(a spliced stream answers 502, as it does any failure before the head).
Nothing else is ever retried.

HTTP/1.1 upstreams: a keep-alive pool of idle connections per address, one
request per connection at a time. A reused connection that turns out to be
closed is retried once on a fresh one when nothing of the request body was
sent.

Request bodies are pumped by a task in the pool's nursery (it outlives a
refused first stream), so a handler can return the response (and a listener
start sending it) while the upload is still going: bidirectional streaming.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h11
import trio

from blocks._h1 import H1Body, H1Stream
from blocks._h2 import H2Driver, H2Stream, flush_marked, make_h2
from blocks._splice import HeadFilter, Splice
from blocks._sync import Signal
from blocks.errors import StreamReset, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from blocks.http import HOP_BY_HOP, Body, Headers, Request, Response, empty_body
from blocks.routing import Address

log = logging.getLogger("blocks.multiplexer")


_CANCEL = h2.errors.ErrorCodes.CANCEL
_REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
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
    """One pool: its open connections (draining ones included), the streams
    on them, and how many refused requests it retried on another connection."""

    address: Address
    protocol: str
    connections: int
    active_streams: int
    retries: int = 0


# -- HTTP/2 -------------------------------------------------------------------------


class _Refused(UpstreamProtocolError):
    """The upstream never processed the stream (RFC 9113 8.7): refused with
    ``REFUSED_STREAM``, or above the last stream id of its GOAWAY. Safe to
    send again, if none of the request body went with it."""

    status = 503


def _unanswered(st: H2Stream) -> bool:
    return st.head is None and (st.splice is None or not st.splice.head_sent)


# h2's connection state machine, except that a GOAWAY received leaves it open.
# h2 moves to CLOSED on any GOAWAY it receives and then rejects every other
# frame, including those that came in the same read right behind it (the
# responses of the very streams the GOAWAY lets finish, a PING), before the
# reader could put the state back with ``survive_goaway``: the connection
# would die with them. ``accepting`` is what stops new streams.
_OPEN = h2.connection.ConnectionState.CLIENT_OPEN
_OUTLIVE_GOAWAY = {
    **h2.connection.H2ConnectionStateMachine._transitions,
    (_OPEN, h2.connection.ConnectionInputs.RECV_GOAWAY): (None, _OPEN),
}


def _give_back(conn: h2.connection.H2Connection, size: int, sid: int) -> None:
    try:
        conn.acknowledge_received_data(size, sid)
    except h2.exceptions.ProtocolError:
        pass  # the stream is gone; h2 has still returned the connection window


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
        conn.state_machine._transitions = _OUTLIVE_GOAWAY
        super().__init__(stream, conn, connection_window=config.connection_window)
        self.pool = pool
        self._cap = config.max_streams_per_connection
        self.accepting = True  # false after a GOAWAY or a failure: no new streams
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
        splice = Splice(
            down, down_st, self, st, request_ended=request_ended, head_filter=head_filter, on_close=on_close
        )
        _Replay(splice, request, headers, request_ended)
        return st

    def open_stream(self, request: Request, headers: Headers, *, end: bool) -> H2Stream:
        """Send the request head on a new stream. Never blocks; the pool pumps the body."""
        st = self._send_head(request, headers, end)
        self.kick()
        st.signal = Signal()
        st.local_ended = end
        return st

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
        # A refused stream's body pump waits: the requester moves it to the retry or stops it.
        if st.cancel_scope is not None and type(error) is not _Refused:
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

    def _refuse(self, st: H2Stream, why: str) -> None:
        """``st`` was never processed upstream: fail it so that its request may be retried."""
        error = st.error = _Refused(f"upstream {self.pool.address} refused the stream ({why})")
        splice = st.splice
        if splice is not None:
            replay: object = splice.down_st.splice
            if type(replay) is _Replay and replay.splice is splice and not splice.closed:
                # No body byte went upstream: keep the downstream stream and splice it again.
                st.splice = None
                replay.park()
                self.pool.nursery.start_soon(self.pool.resplice, replay, self)
        self.fail_stream(st, error)

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

    def on_reset(self, ev: h2.events.StreamReset) -> None:
        st = self.streams.get(ev.stream_id)
        if st is not None and ev.error_code == _REFUSED and _unanswered(st):
            self._refuse(st, "REFUSED_STREAM")
        else:
            super().on_reset(ev)

    def on_settings(self, ev: h2.events.RemoteSettingsChanged) -> None:
        self._ready.set()
        super().on_settings(ev)
        self.pool.slot_freed()

    def _on_terminated(self, ev: h2.events.ConnectionTerminated) -> None:
        # No new stream from now on. Streams above the last id were never
        # processed, whatever the error code (RFC 9113 6.8); the others finish
        # if the GOAWAY is graceful, and fail with the connection if not.
        self.accepting = False
        last = ev.last_stream_id if ev.last_stream_id is not None else 0
        for st in [st for sid, st in self.streams.items() if sid > last]:
            if _unanswered(st):
                self._refuse(st, f"above the last stream id {last} of its GOAWAY")
            else:
                self.fail_stream(st, StreamReset("answered above the last stream id of a GOAWAY"))
        if not self.survive_goaway(ev):
            self.mark_closed()
        self.pool.slot_freed()


class _Upload:
    """A request body on its way upstream. It outlives a refused first stream.

    ``sent`` turns true with the first body byte handed to a stream: from
    then on the request can never be retried. While a refused stream may
    still be retried, the pump waits (holding the chunk it read, if any)
    until the requester moves it to the new stream or gives up.
    """

    __slots__ = ("_moved", "body", "broken", "conn", "finished", "scope", "sent", "st")

    def __init__(self, body: Body, conn: H2ClientConnection, st: H2Stream) -> None:
        self.body = body
        self.conn = conn
        self.st = st
        self.sent = False
        self.finished = False  # the end of the body (or its trailers) was sent
        self.broken = False  # the pump gave up: the body cannot be sent again
        self.scope = st.cancel_scope = trio.CancelScope()
        self._moved = Signal()

    @property
    def replayable(self) -> bool:
        """Nothing of the body went upstream, and it can still be sent in full."""
        return not self.sent and not self.broken

    def move(self, conn: H2ClientConnection, st: H2Stream) -> None:
        """Carry on on ``st``: the retry of a refused stream."""
        self.conn = conn
        self.st = st
        st.cancel_scope = self.scope
        self._moved.set()

    def abandon(self) -> None:
        self.scope.cancel()

    async def target(self) -> tuple[H2ClientConnection, H2Stream]:
        """The stream to send on, once there is one; StreamReset if there never will be."""
        while True:
            st = self.st
            if not st.closed:
                return self.conn, st
            if self.sent or type(st.error) is not _Refused:
                raise StreamReset("the upstream stream closed while its request body was being sent")
            await self._moved.wait()


class _Replay:
    """A spliced request that may still be retried, as its downstream stream sees it.

    It stands in for the :class:`Splice` on the downstream stream (the drivers
    call ``data``, ``ended``, ``window``, ``failed`` and ``refuse`` on
    whatever is there; anything else hands the stream back to the splice
    first) while no request body byte has gone upstream and no response head
    has come back. Until then it passes every event on; the first body byte or
    trailers, or a window update after the head, put the splice back, so
    the steady state costs nothing.

    When the upstream refuses the stream it is *parked*: the downstream's
    events are kept, unacknowledged (the client's stream window bounds them),
    until :meth:`resume` splices a new upstream stream and replays them, or
    :meth:`give_up` answers the error.
    """

    __slots__ = ("events", "headers", "origin", "request_ended", "splice")

    def __init__(self, splice: Splice, origin: Request, headers: Headers, ended: bool) -> None:
        self.splice = splice
        self.origin = origin
        self.headers = headers
        self.request_ended = ended  # the request ended without a body byte
        self.events: list[tuple[bytes | None, int, bool, Headers | None]] | None = None
        # Duck-typed: the drivers only call the four methods below.
        splice.down_st.splice = self  # type: ignore[assignment]

    def _detach(self) -> None:
        self.splice.down_st.splice = self.splice

    def data(self, driver: H2Driver, st: H2Stream, data: bytes, size: int, end: bool) -> None:
        if self.events is not None:
            self.events.append((data, size, end, None))
            return
        if data:
            self._detach()  # the body has started: no retry from now on
        elif end:
            self.request_ended = True
        self.splice.data(driver, st, data, size, end)

    def ended(self, st: H2Stream, trailers: Headers | None = None) -> None:
        if self.events is not None:
            self.events.append((None, 0, True, trailers))
            return
        if trailers:
            self._detach()
        else:
            self.request_ended = True
        self.splice.ended(st, trailers)

    def window(self, st: H2Stream) -> None:
        if self.events is None:
            if self.splice.head_sent:
                self._detach()
            self.splice.window(st)

    def failed(self, driver: H2Driver, error: BaseException) -> None:
        self._release()
        self.splice.failed(driver, error)

    def refuse(self, status: int) -> None:
        self._release()
        self._detach()
        self.splice.refuse(status)

    def __getattr__(self, name: str) -> Any:
        # A splice method this stand-in does not know (the drivers grow): the
        # safe default is to give the retry up and let the splice answer.
        if name.startswith("_") or name in _Replay.__slots__:
            raise AttributeError(name)
        self._release()
        self._detach()
        return getattr(self.splice, name)

    def park(self) -> None:
        self.events = []

    def _release(self) -> None:
        """Acknowledge whatever was kept while parked: it will never be relayed."""
        events, self.events = self.events, None
        if events:
            down = self.splice.down
            sid = self.splice.down_st.id
            for _, size, _, _ in events:
                if size:
                    _give_back(down.h2, size, sid)
            down.kick()

    def resume(self, conn: H2ClientConnection) -> H2Stream:
        """Splice the downstream stream to a new stream on ``conn`` and replay what was kept."""
        old = self.splice
        down, down_st = old.down, old.down_st
        st = conn._send_head(self.origin, self.headers, self.request_ended)
        events, self.events = self.events or [], None
        new = Splice(
            down,
            down_st,
            conn,
            st,
            request_ended=self.request_ended,
            head_filter=old.head_filter,
            on_close=old.on_close,
        )
        old.on_close = None
        old.closed = True
        for data, size, end, trailers in events:
            if data is None:
                new.ended(down_st, trailers)
            else:
                new.data(down, down_st, data, size, end)
        conn.mark()
        down.mark()
        flush_marked()  # not in a reader's batch: write both connections now
        return st

    def give_up(self, error: BaseException) -> None:
        """Answer the downstream stream with ``error``'s status (as a splice does)."""
        self._release()
        self._detach()
        self.splice.failed(self.splice.up, error)


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
        self.retries = 0
        self._attempt: _Attempt | None = None
        self._freed = trio.Event()

    def statistics(self) -> PoolStatistics:
        streams = sum(len(c.streams) for c in self.connections)
        return PoolStatistics(self.address, "h2", len(self.connections), streams, self.retries)

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

    def _free(self, avoid: H2ClientConnection | None = None) -> H2ClientConnection | None:
        for conn in self.connections:
            if conn.has_slot and conn is not avoid:
                return conn
        return None

    async def acquire(self, avoid: H2ClientConnection | None = None) -> H2ClientConnection:
        """A connection with a free stream slot; waits for one if the pool is full.

        ``avoid`` (the connection that refused a stream) is taken only when no
        other connection has a slot and no new one may be opened.
        """
        while True:
            fallback = None
            for conn in self.connections:
                if conn.has_slot:
                    if conn is not avoid:
                        return conn
                    fallback = conn
            attempt = self._attempt
            # Draining connections (after a GOAWAY) do not count: they take no new streams.
            if attempt is None and sum(c.accepting for c in self.connections) < self.config.max_connections:
                attempt = self._attempt = _Attempt()
                self.nursery.start_soon(self._connect, attempt)
            if attempt is not None:
                await attempt.done.wait()
                if attempt.error is not None:
                    raise UpstreamConnectError(
                        f"cannot connect to {self.address[0]}:{self.address[1]}: {attempt.error}"
                    ) from attempt.error
                continue
            if fallback is not None:
                return fallback
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
        conn = self._free()
        if conn is None:
            return False
        try:
            st = conn.open_spliced(
                request, headers, down, down_st, request_ended=request_ended, head_filter=head_filter, on_close=on_close
            )
        except h2.exceptions.ProtocolError:
            return False
        self.waiting[st] = (trio.current_time() + self.config.response_timeout, conn)
        return True

    async def resplice(self, replay: _Replay, refused_by: H2ClientConnection) -> None:
        """Retry a refused spliced stream on another connection (a task: it may have to open one)."""
        timeout = self.config.response_timeout
        self.retries += 1
        try:
            conn = None
            with trio.move_on_after(timeout):
                conn = await self.acquire(refused_by)
            if replay.splice.closed:
                return  # the downstream stream went away meanwhile
            if conn is None:
                raise UpstreamTimeout(f"no stream slot at {self.address} within {timeout}s")
            st = replay.resume(conn)
        except (UpstreamConnectError, UpstreamTimeout, h2.exceptions.ProtocolError) as exc:
            if not replay.splice.closed:
                replay.give_up(exc)
            return
        except BaseException:
            if not replay.splice.closed:
                replay.give_up(UpstreamConnectError("the upstream pool closed"))
            raise
        self.waiting[st] = (trio.current_time() + timeout, conn)

    async def request(self, request: Request, headers: Headers, timeout: float) -> Response:
        upload: _Upload | None = None
        avoid: H2ClientConnection | None = None
        try:
            for retry in (False, True):
                conn = self._free(avoid) if timeout == self.config.response_timeout else None
                try:
                    if conn is not None:
                        # The common case: a free slot now, the pool's own timeout. The
                        # sweeper bounds the wait; no cancel scope per request.
                        st, upload = self._open(conn, request, headers, upload)
                        self.waiting[st] = (trio.current_time() + timeout, conn)
                        return await conn.response(st)
                    # Waiting for a slot, or a timeout of its own: one deadline for both.
                    with trio.move_on_after(timeout):
                        conn = await self.acquire(avoid)
                        st, upload = self._open(conn, request, headers, upload)
                        return await conn.response(st)
                    raise UpstreamTimeout(f"no response from {self.address} within {timeout}s")
                except _Refused as exc:
                    if retry or (upload is not None and not upload.replayable):
                        why = "again, on another connection" if retry else "after the request body started"
                        raise UpstreamProtocolError(f"{exc}, {why}", status=503) from None
                    avoid = conn
                    self.retries += 1
            raise AssertionError("unreachable")
        except BaseException:
            if upload is not None:
                upload.abandon()
            raise

    def _open(
        self, conn: H2ClientConnection, request: Request, headers: Headers, upload: _Upload | None
    ) -> tuple[H2Stream, _Upload | None]:
        """Open a stream for ``request`` on ``conn``; its body goes by ``upload`` (the retry's) or a new one."""
        body = request.body
        try:
            if upload is None:
                end = body.ended and not body.trailers
                st = conn.open_stream(request, headers, end=end)
                if not end:
                    upload = _Upload(body, conn, st)
                    self.nursery.start_soon(self._pump, upload)
                return st, upload
            # The retry: the body is untouched, or ended with nothing sent but its end.
            finished = upload.finished
            st = conn.open_stream(request, headers, end=finished and not body.trailers)
            if finished and body.trailers:
                conn.h2.send_headers(st.id, body.trailers, end_stream=True)
                conn.kick()
                st.local_ended = True
            upload.move(conn, st)
            if upload.broken:  # the body broke since the refusal: nothing will complete it
                conn.reset(st, _CANCEL)
            return st, upload
        except h2.exceptions.ProtocolError as exc:
            raise UpstreamProtocolError(f"cannot open a stream to {self.address}: {exc}") from exc

    async def _pump(self, upload: _Upload) -> None:
        """Send the request body, on the first stream or on its retry."""
        body = upload.body
        with upload.scope:
            try:
                while True:
                    chunk = await body.receive()
                    conn, st = await upload.target()
                    if not chunk:
                        if body.trailers:
                            conn.h2.send_headers(st.id, body.trailers, end_stream=True)
                        else:
                            conn.h2.end_stream(st.id)
                        conn.kick()
                        break
                    last = body.ended and not body.trailers  # the common one-chunk body: END_STREAM with it
                    upload.sent = True
                    await conn.send_data(st, chunk, end_stream=last)
                    if last:
                        break
            except (StreamReset, h2.exceptions.ProtocolError):
                # The client's upload broke, or the upstream stream went away.
                upload.broken = True
                upload.conn.reset(upload.st, _CANCEL)
                return
            except Exception:
                log.exception("request body pump failed")
                upload.broken = True
                upload.conn.reset(upload.st, _CANCEL)
                return
            upload.finished = st.local_ended = True
            if st.remote_ended:
                conn.finish_stream(st)
        if upload.scope.cancelled_caught and not body.ended:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await body.aclose()


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
        A stream the upstream refuses before any request body byte went up is
        spliced once more, on another connection (opened if need be).
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

        On h2, a stream the upstream never processed (``REFUSED_STREAM``, or
        above a GOAWAY's last stream id) is sent once more on another
        connection if none of the request body had gone up yet, with a
        ``timeout`` of its own; refused again, or refused after the first
        body byte, it is an ``UpstreamProtocolError`` with status 503.
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
