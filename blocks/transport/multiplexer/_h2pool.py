"""The HTTP/2 pool: pooled, multiplexed connections to one upstream address (see the package docstring)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import trio

from blocks._sync import Signal
from blocks.errors import StreamReset, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from blocks.http import Headers, Request, Response, abandon, empty_body
from blocks.transport import Address
from blocks.transport._codec import HEADER_LIST_HARD_CAP, ErrorCodes, EventKind, ProtocolError, make_h2
from blocks.transport._h2 import H2Driver, H2Stream, flush_marked, in_batch
from blocks.transport._splice import HeadFilter, Sink, Splice
from blocks.transport.multiplexer._config import Dial, PoolStatistics, UpstreamConfig
from blocks.transport.multiplexer._h2retry import _Refused, _Replay, _Upload

log = logging.getLogger("blocks.multiplexer")

_CANCEL = ErrorCodes.CANCEL
_REFUSED = ErrorCodes.REFUSED_STREAM
_PROTOCOL_ERROR = ErrorCodes.PROTOCOL_ERROR


def _unanswered(st: H2Stream) -> bool:
    return st.head is None and (st.splice is None or not st.splice.head_sent)


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
            # Between the two, that response alone fails (_on_response); past the cap, the connection.
            header_list_cap=HEADER_LIST_HARD_CAP * config.max_header_list_size,
            # A GOAWAY received leaves the codec open for the frames behind it
            # (the responses of the streams it lets finish): ``accepting`` is
            # what stops new streams.
            outlive_goaway=True,
        )
        super().__init__(stream, conn, connection_window=config.connection_window)
        self.pool = pool
        self._cap = config.max_streams_per_connection
        self.accepting = True  # false after a GOAWAY or a failure: no new streams
        self._ready = trio.Event()
        self.handlers = self.bind(
            {
                EventKind.RESPONSE: self._on_response,
                EventKind.DATA: self.on_data,
                EventKind.STREAM_ENDED: self._on_stream_ended,
                EventKind.TRAILERS: self.on_trailers,
                EventKind.RESET: self.on_reset,
                EventKind.WINDOW_UPDATED: self.on_window_updated,
                EventKind.SETTINGS_CHANGED: self.on_settings,
                EventKind.TERMINATED: self._on_terminated,
            }
        )

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
        try:
            await self.receive_into(self._receive)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.mark_closed()

    def _receive(self, data: bytes | bytearray) -> None:
        try:
            events = self.h2.receive_data(data)
        except ProtocolError as exc:
            log.warning("upstream %s broke the protocol: %s", self.pool.address, exc)
            self.mark_closed()
            return
        self.dispatch(events)

    # -- streams -----------------------------------------------------------------

    def _send_head(self, request: Request, headers: Headers, end: bool, *, timed: bool = True) -> H2Stream:
        """Open a stream with ``request``'s head; ``timed``: on the pool's response clock (see :meth:`local_end`)."""
        conn = self.h2
        sid = conn.get_next_available_stream_id()
        head = [
            (b":method", request.method),
            (b":scheme", request.scheme),
            (b":authority", request.authority),
            (b":path", request.path),
        ]
        if request.protocol is not None:
            # An extended CONNECT (RFC 8441 3): only to a peer that said it takes them.
            if not conn.remote_settings.enable_connect_protocol:
                raise UpstreamProtocolError(
                    f"upstream {self.pool.address} does not take extended CONNECT (no SETTINGS_ENABLE_CONNECT_PROTOCOL)"
                )
            head.append((b":protocol", request.protocol))
        head += headers
        conn.send_headers(sid, head, end_stream=end)
        st = H2Stream(sid)
        self.streams[sid] = st
        if timed:
            if end or request.protocol is not None:  # (a tunnel's request never ends: its clock starts now)
                self._start_clock(st)
            else:
                st.timed = True
        if end:
            st.local_ended = True
        return st

    def local_end(self, st: H2Stream) -> None:
        """The request on ``st`` has gone whole: its response clock starts (if it is on one).

        ``response_timeout`` is the upstream's time to answer a whole request:
        an upload, however long, is not on it, and a head that came before the
        request ended stops it from starting (``_on_response``).
        """
        st.local_ended = True
        if st.timed:
            self._start_clock(st)

    def stalled(self, st: H2Stream) -> None:
        super().stalled(st)
        pool = self.pool
        pool.stalled[st] = self
        pool.watch.set()

    def _start_clock(self, st: H2Stream) -> None:
        st.timed = False
        pool = self.pool
        pool.waiting[st] = (trio.current_time() + pool.config.response_timeout, self)
        pool.watch.set()

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

    def open_stream(self, request: Request, headers: Headers, *, end: bool, timed: bool = True) -> H2Stream:
        """Send the request head on a new stream. Never blocks; the pool pumps the body."""
        st = self._send_head(request, headers, end, timed=timed)
        self.kick()
        st.signal = Signal()
        return st

    async def response(self, st: H2Stream) -> Response:
        """Wait for the response head on ``st`` (the pool's sweeper bounds the wait)."""
        if st.head is None and not st.closed:
            assert st.signal is not None
            try:
                await st.signal.wait()
            except BaseException:
                self.reset(st, _CANCEL)
                if st.head is not None:  # it came, even whole, as we were cancelled: nobody will read it
                    st.head.body.discard()
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
            except ProtocolError:
                pass
            self.mark_closed()

    def _refuse(self, st: H2Stream, why: str) -> None:
        """``st`` was never processed upstream: fail it so that its request may be retried."""
        error = st.error = _Refused(f"upstream {self.pool.address} refused the stream ({why})")
        splice = st.splice
        if type(splice) is Splice:  # (not a sink: those are never sent again)
            replay: object = splice.down_st.splice
            if type(replay) is _Replay and replay.splice is splice and not splice.closed:
                # No body byte went upstream: keep the downstream stream and splice it again.
                st.splice = None
                replay.park()
                self.pool.nursery.start_soon(self.pool.resplice, replay, self)
        self.fail_stream(st, error)

    # -- events --------------------------------------------------------------------

    def _on_response(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is None:
            return
        self.pool.waiting.pop(st, None)
        st.timed = False  # (answered before the request ended: no clock to start)
        status = 0
        headers: Headers = []
        length = None
        size = 0
        for name, value in ev.headers:
            size += len(name) + len(value)
            if name[0] == 58:
                if name == b":status":
                    status = int(value)
            else:
                if name == b"content-length" and value.isdigit():
                    length = int(value)
                headers.append((name, value))
        limit = self.pool.config.max_header_list_size
        if size > limit - 32 * len(ev.headers):  # (RFC 9113 6.5.2's count: 32 more a field)
            size += 32 * len(ev.headers)
            st.error = UpstreamProtocolError(
                f"response head of {size} bytes from {self.pool.address} is over max_header_list_size {limit}"
            )
            self.reset(st, _PROTOCOL_ERROR)
            return
        if st.splice is not None:
            st.splice.head(status, headers, ev.stream_ended is not None)
            return
        body = empty_body() if ev.stream_ended is not None else self.new_inbound_body(st, length)
        st.head = Response(status, headers, body)
        if st.signal is not None:
            st.signal.set()

    def _on_stream_ended(self, ev: Any) -> None:
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

    def on_reset(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is not None and ev.error_code == _REFUSED and _unanswered(st):
            self._refuse(st, "REFUSED_STREAM")
        else:
            super().on_reset(ev)

    def on_settings(self, ev: Any) -> None:
        self._ready.set()
        super().on_settings(ev)
        self.pool.slot_freed()

    def _on_terminated(self, ev: Any) -> None:
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


class _Attempt:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


class _H2Pool:
    def __init__(
        self,
        address: Address,
        config: UpstreamConfig,
        nursery: trio.Nursery,
        *,
        dial: Dial | None = None,
        protocol: str = "h2",
        watch: Signal | None = None,
    ) -> None:
        self.address = address
        # Set when a stream gets a deadline (waiting, stalled): wakes the sweeper that expires them.
        self.watch = watch if watch is not None else Signal()
        self.config = config
        self.nursery = nursery
        self.protocol = protocol  # as the statistics name it: "h2", or "https" over TLS
        self._dial: Dial = dial or functools.partial(trio.open_tcp_stream, *address)
        self.connections: list[H2ClientConnection] = []
        # Streams waiting for a response head -> their deadline. Insertion
        # order is deadline order (one timeout per pool), so the sweeper only
        # looks at the front.
        self.waiting: dict[H2Stream, tuple[float, H2ClientConnection]] = {}
        # Streams whose request waits for the upstream's window (or our writer): see expire.
        self.stalled: dict[H2Stream, H2ClientConnection] = {}
        self.retries = 0
        self._attempt: _Attempt | None = None
        self._freed = trio.Event()

    def statistics(self) -> PoolStatistics:
        connections = tuple(c.statistics() for c in self.connections)
        streams = sum(c.streams for c in connections)
        return PoolStatistics(self.address, self.protocol, len(connections), streams, self.retries, connections)

    def slot_freed(self) -> None:
        self._freed.set()

    def remove(self, conn: H2ClientConnection) -> None:
        if conn in self.connections:
            self.connections.remove(conn)
        self._freed.set()

    async def _connect(self, attempt: _Attempt) -> None:
        try:
            with trio.fail_after(self.config.connect_timeout):
                await self.adopt(await self._dial())
        except (OSError, trio.TooSlowError, RuntimeError) as exc:
            attempt.error = exc
        finally:
            self._attempt = None
            attempt.done.set()
            self._freed.set()

    async def adopt(self, stream: trio.abc.Stream) -> None:
        """Run an h2 connection on ``stream`` (just opened); it joins the pool once the peer's SETTINGS came."""
        conn = H2ClientConnection(stream, self)
        await self.nursery.start(conn.run)
        self.connections.append(conn)

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
        """Fail every stream whose response head is overdue, or whose request the upstream has
        taken no byte of for ``stall_timeout``: 504."""
        if self.stalled:
            self._expire_stalls(now)
        waiting = self.waiting
        while waiting:
            st = next(iter(waiting))
            deadline, conn = waiting[st]
            if deadline > now:
                return
            del waiting[st]
            st.error = UpstreamTimeout(f"no response from {self.address} within {self.config.response_timeout}s")
            conn.reset(st, _CANCEL)

    def _expire_stalls(self, now: float) -> None:
        limit = self.config.stall_timeout
        for st, conn in list(self.stalled.items()):
            since = st.stalled_since
            if since is None or st.closed:
                del self.stalled[st]  # it moved on, or ended
            elif now - since >= limit:
                del self.stalled[st]
                st.error = UpstreamTimeout(f"{self.address} took no byte of the request for {limit}s")
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
            conn.open_spliced(
                request, headers, down, down_st, request_ended=request_ended, head_filter=head_filter, on_close=on_close
            )
        except (ProtocolError, UpstreamProtocolError):
            return False  # the handler path tries again, and answers the error if it stands
        return True

    def sink(self, request: Request, headers: Headers, sink: Sink) -> bool:
        """Send a body-less request on a free slot, its response to ``sink``; False if no slot is free now."""
        conn = self._free()
        if conn is None:
            return False
        try:
            st = conn._send_head(request, headers, True)
        except (ProtocolError, UpstreamProtocolError):
            return False
        st.splice = sink  # type: ignore[assignment]  # duck-typed: the drivers call what a splice has
        sink.opened(conn, st)
        # Written after what the caller's batch marked before (a primary's last frames), and
        # with every other head sent to this connection in the same batch.
        conn.mark()
        if not in_batch():
            flush_marked()
        return True

    async def resplice(self, replay: _Replay, refused_by: H2Driver | None) -> None:
        """Retry a refused spliced stream on another connection (a task: it may have to open one)."""
        timeout = self.config.response_timeout
        self.retries += 1
        try:
            conn = None
            with trio.move_on_after(timeout):
                conn = await self.acquire(refused_by if isinstance(refused_by, H2ClientConnection) else None)
            if replay.splice.closed:
                return  # the downstream stream went away meanwhile
            if conn is None:
                raise UpstreamTimeout(f"no stream slot at {self.address} within {timeout}s")
            replay.resume(conn)  # (on the response clock from the request's end, as any stream)
        except (UpstreamConnectError, UpstreamTimeout, UpstreamProtocolError, ProtocolError) as exc:
            if not replay.splice.closed:
                replay.give_up(exc)
            return
        except BaseException:
            if not replay.splice.closed:
                replay.give_up(UpstreamConnectError("the upstream pool closed"))
            raise

    async def request(self, request: Request, headers: Headers, timeout: float) -> Response:
        upload: _Upload | None = None
        avoid: H2ClientConnection | None = None
        try:
            pooled = timeout == self.config.response_timeout
            for retry in (False, True):
                conn = None
                try:
                    if pooled:
                        # The pool's own timeout: the sweeper bounds the wait for the head
                        # from the request's end (local_end); no cancel scope per request.
                        conn = self._free(avoid)
                        if conn is None:
                            with trio.move_on_after(timeout):
                                conn = await self.acquire(avoid)
                            if conn is None:
                                raise UpstreamTimeout(f"no stream slot at {self.address} within {timeout}s")
                        st, upload = self._open(conn, request, headers, upload, timed=True)
                        return await conn.response(st)
                    # A timeout of its own: one deadline for the slot, the upload and the head.
                    with trio.move_on_after(timeout):
                        conn = await self.acquire(avoid)
                        st, upload = self._open(conn, request, headers, upload, timed=False)
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
        self, conn: H2ClientConnection, request: Request, headers: Headers, upload: _Upload | None, *, timed: bool
    ) -> tuple[H2Stream, _Upload | None]:
        """Open a stream for ``request`` on ``conn``; its body goes by ``upload`` (the retry's) or a new one."""
        body = request.body
        try:
            if upload is None:
                end = body.ended and not body.trailers
                st = conn.open_stream(request, headers, end=end, timed=timed)
                if not end:
                    upload = _Upload(body, conn, st)
                    self.nursery.start_soon(self._pump, upload)
                return st, upload
            # The retry: the body is untouched, or ended with nothing sent but its end.
            finished = upload.finished
            st = conn.open_stream(request, headers, end=finished and not body.trailers, timed=timed)
            if finished and body.trailers:
                conn.h2.send_headers(st.id, body.trailers, end_stream=True)
                conn.kick()
                conn.local_end(st)
            upload.move(conn, st)
            if upload.broken:  # the body broke since the refusal: nothing will complete it
                conn.reset(st, _CANCEL)
            return st, upload
        except ProtocolError as exc:
            raise UpstreamProtocolError(f"cannot open a stream to {self.address}: {exc}") from exc

    async def _pump(self, upload: _Upload) -> None:
        """Send the request body, on the first stream or on its retry.

        The body is the pump's from its first read: what it leaves unsent when
        it stops early is discarded here (its window goes back), whoever else
        still holds the body.
        """
        body = upload.body
        try:
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
                except (StreamReset, ProtocolError):
                    # The client's upload broke, or the upstream stream went away.
                    upload.broken = True
                    upload.conn.reset(upload.st, _CANCEL)
                    return
                except Exception:
                    log.exception("request body pump failed")
                    upload.broken = True
                    upload.conn.reset(upload.st, _CANCEL)
                    return
                upload.finished = True
                conn.local_end(st)
                if st.remote_ended:
                    conn.finish_stream(st)
            if upload.scope.cancelled_caught and not body.ended and not upload.st.remote_ended:
                # (An upstream that ended its response and then refused the rest of
                # the request, RST_STREAM(NO_ERROR) as RFC 9113 8.1 allows, did not
                # break the exchange: the body's owner refuses it once the response
                # is out, and abandoning it here would reset that response.)
                await abandon(body)
        finally:
            if not upload.finished:
                body.discard()


# -- HTTP/1.1 ---------------------------------------------------------------------------
