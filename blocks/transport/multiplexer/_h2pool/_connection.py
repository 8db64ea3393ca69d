"""One pooled HTTP/2 connection to an upstream (:class:`H2ClientConnection`): the streams it opens,
their response clock, the events that answer them, and its lifetime (a cap on its streams, an idle
timeout, a PING when it has been quiet).

A stream that ends unanswered ends in one of two places, which sort it by
the invariant of :mod:`blocks.transport.multiplexer._h2retry`: ``_refuse``
(the upstream refused it, or a GOAWAY's last stream id is below it) and
``stream_lost`` (the connection ended under it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from blocks._sync import Signal
from blocks.errors import StreamReset, UpstreamProtocolError
from blocks.http import Headers, Request, Response, empty_body
from blocks.transport._codec import HEADER_LIST_HARD_CAP, ErrorCodes, EventKind, ProtocolError, make_h2
from blocks.transport._h2 import H2Driver, H2Stream
from blocks.transport._splice import HeadFilter, Splice
from blocks.transport.multiplexer._h2retry import _Refused, _Replay

if TYPE_CHECKING:
    from blocks.transport.multiplexer._h2pool._pool import _H2Pool

log = logging.getLogger("blocks.multiplexer")

_CANCEL = ErrorCodes.CANCEL
_REFUSED = ErrorCodes.REFUSED_STREAM
_PROTOCOL_ERROR = ErrorCodes.PROTOCOL_ERROR
_CLOSED = "the connection closed"
_PING = bytes.fromhex("000008060000000000") + b"pb-alive"  # a PING frame (length 8, type 6, stream 0) and its data


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
        self._max_opened = config.max_requests_per_connection
        self.accepting = True  # false after a GOAWAY, a failure, or its last request: no new streams
        self._ready = trio.Event()
        self._scope: trio.CancelScope | None = None  # run()'s: cancelled when the upstream is found dead
        self.opened = 0  # streams opened (the idle clock and max_requests_per_connection read it)
        self.heard = False  # bytes came since the pool's last keepalive look
        now = trio.current_time()
        self._quiet_since = now  # (keepalive: nothing heard since)
        self._idle_since = now  # (keepalive: no stream since, to a tick)
        self.idle_at = now  # when its last stream closed (exact: see stream_closed)
        self._seen_opened = 0
        self._ping_sent: float | None = None  # when the PING now unanswered went out
        self.end_reason = _CLOSED  # what the streams it cuts say (see _ended)
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
                EventKind.PING_ACK: self._on_ping_ack,
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
                self._scope = nursery.cancel_scope
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
            if self.accepting and not self.streams and not self.closed:
                self.pool.closed_idle(trio.current_time() - self.idle_at)  # (no GOAWAY, no stream: its idle close)
            self._ended("the upstream closed the connection")
        except trio.BrokenResourceError as exc:
            self._ended(f"the connection broke: {exc.__cause__ or exc}")
        except trio.ClosedResourceError:
            pass
        finally:
            self.mark_closed()

    def _ended(self, how: str) -> None:
        if not self.closed:
            self.end_reason = how if self.end_reason is _CLOSED else f"{how}, {self.end_reason}"

    def _receive(self, data: bytes | bytearray) -> None:
        self.heard = True
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
        self.opened += 1
        if self.opened == self._max_opened:
            self.accepting = False  # its last request: it closes once its streams are done (stream_closed)
            self.pool.replace()
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
        pool = self.pool
        pool.waiting.pop(st, None)
        pool.slot_freed()
        if not self.streams:
            if not self.accepting:
                if not self.closed:
                    self.close()
            else:
                # (The one clock read for a connection's lifetime: when it falls idle, which under
                # load is seldom. It dates an idle close by the upstream: see _H2Pool.closed_idle.)
                self.idle_at = trio.current_time()

    def close(self) -> None:
        """Take no new stream, send GOAWAY(NO_ERROR) (the writer sends it, then the socket closes)."""
        self.accepting = False
        try:
            self.h2.close_connection()
        except ProtocolError:
            pass
        self.mark_closed()

    def _refuse(self, st: H2Stream, why: str, *, maybe_processed: bool = False) -> None:
        """``st`` is unanswered and was never processed upstream (``maybe_processed``: its connection
        ended under it, see ``stream_lost``): fail it so that its request may be retried."""
        what = "cut the stream before its response" if maybe_processed else "refused the stream"
        error = st.error = _Refused(f"upstream {self.pool.address} {what} ({why})", maybe_processed=maybe_processed)
        splice = st.splice
        if type(splice) is Splice:  # (not a sink: those are never sent again)
            replay: object = splice.down_st.splice
            if (
                type(replay) is _Replay
                and replay.splice is splice
                and not splice.closed
                and error.retryable(replay.origin.method)
            ):
                # No body byte went upstream: keep the downstream stream and splice it again.
                st.splice = None
                replay.park()
                self.pool.nursery.start_soon(self.pool.resplice, replay, self)
        self.fail_stream(st, error)

    def stream_lost(self, st: H2Stream) -> None:
        # The connection ended under ``st``: unanswered, it may go again (a safe
        # method, no body byte up); answered, its body fails at once.
        if _unanswered(st):
            self._refuse(st, self.end_reason, maybe_processed=True)
        else:
            super().stream_lost(st)

    # -- lifetime --------------------------------------------------------------------

    def ping(self, now: float) -> None:
        """Send a PING (beside the codec's state machine, as a GOAWAY that keeps it open is): its ACK
        is due within ``h2_ping_timeout`` (:meth:`keepalive`)."""
        self._ping_sent = now
        self.kick()
        self._queue(_PING)

    def keepalive(self, now: float) -> None:
        """The pool's look at this connection, every ``keepalive_tick``: close it with GOAWAY(NO_ERROR)
        after ``h2_idle_timeout`` without a stream, PING it after ``h2_ping_interval`` without a byte
        from the upstream, and end it if a PING's ACK is ``h2_ping_timeout`` late.

        Nothing on the request path reads a clock for this: a stream only counts
        ``opened``, and a read sets ``heard``; so each is measured to a tick.
        """
        if self.closed:
            return
        config = self.pool.config
        sent = self._ping_sent
        if sent is not None:
            if now - sent >= config.h2_ping_timeout:
                self.dead(f"no PING ACK within {config.h2_ping_timeout}s")
            return
        if self.heard:
            self.heard = False
            self._quiet_since = now
        if self.streams or self.opened != self._seen_opened:
            self._seen_opened = self.opened
            self._idle_since = now
        elif config.h2_idle_timeout is not None and now - self._idle_since >= config.h2_idle_timeout:
            log.debug("closing the idle connection to %s", self.pool.address)
            self.close()
            return
        if config.h2_ping_interval is not None and now - self._quiet_since >= config.h2_ping_interval:
            self.ping(now)

    def dead(self, why: str) -> None:
        """The upstream stopped answering: its streams fail (or go again) now, and the connection ends
        without waiting for its writer, which a peer that reads nothing would hold up."""
        log.warning("upstream %s: %s; closing the connection", self.pool.address, why)
        self.end_reason = why
        self.mark_closed()
        if self._scope is not None:
            self._scope.cancel()

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
            self.end_reason = f"closed after a GOAWAY ({ev.error_code!r}, last stream id {last})"
            self.mark_closed()
        elif self._ping_sent is None:
            # Streams wait on a server that said GOAWAY: a PING finds out now, not at its idle
            # timeout, whether it still reads (one whose state machine closed with its GOAWAY, as
            # hypercorn's at keep_alive_max_requests, answers it by closing: its streams are cut).
            self.end_reason = f"after its GOAWAY (last stream id {last})"
            self.ping(trio.current_time())
        self.pool.slot_freed()

    def _on_ping_ack(self, ev: Any) -> None:
        self._ping_sent = None
