"""HTTP/2 server connections (the listener's h2 side).

One task per connection reads and dispatches frames; one task per stream
runs the handler and sends its response. A stream's task lives in its own
cancel scope: a RST_STREAM from the client cancels exactly that handler,
and whatever the handler holds (an upstream stream, a slot) is released by
its own cleanup.

A malformed request (validating listeners) is an error of its stream
alone, ended in one place, :meth:`~blocks.transport._h2requests.RequestChecks.malformed`: a 400
without END_STREAM if no response started, then RST_STREAM(PROTOCOL_ERROR),
whatever made it malformed and whatever path it took.

Drain (RFC 9113 6.8, graceful shutdown): GOAWAY(2^31-1) at once, so the
client stops opening streams, and a PING right behind it. The client
answers the PING after whatever it sent before it read the GOAWAY (one
byte stream: TCP keeps the order), so once the ACK is in, every stream the
client opened in the race is in too: the final GOAWAY then names the
highest of them, and streams above it are refused (REFUSED_STREAM: never
processed, safe to retry). A client that does not answer PINGs gets the
final GOAWAY ``drain_goaway_delay`` after the first. The connection closes
once the final GOAWAY is out and the last stream is done.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import trio

from blocks.errors import BadRequest, BlocksError, PayloadTooLarge, StreamReset
from blocks.http import Handler, Request, Response, abandon, empty_body, error_response, respond
from blocks.timing import Timing
from blocks.transport._codec import (
    HEADER_LIST_HARD_CAP,
    ErrorCodes,
    EventKind,
    GuardedFrameBuffer,
    ProtocolError,
    make_h2,
)
from blocks.transport._h2 import H2Stream, Relay, flush_marked
from blocks.transport._h2requests import RequestChecks
from blocks.transport._validate import validate_request_head

if TYPE_CHECKING:
    from blocks.transport.listener import ListenerConfig

log = logging.getLogger("blocks.listener")

_STATUS = {code: b"%d" % code for code in range(100, 600)}
_CANCEL = ErrorCodes.CANCEL
_NO_ERROR = ErrorCodes.NO_ERROR
_REFUSED = ErrorCodes.REFUSED_STREAM
_INTERNAL = ErrorCodes.INTERNAL_ERROR
_CALM = ErrorCodes.ENHANCE_YOUR_CALM
_PROTOCOL_ERROR = ErrorCodes.PROTOCOL_ERROR
_UNLIMITED = 2**62  # a limit set to None

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""The client connection preface (RFC 9113 3.4)."""

_DRAIN_PING = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"drain\x00\x00\x00"
"""The PING sent behind the drain's first GOAWAY (length 8, type PING, no flags, stream 0, 8 bytes of
opaque data), written beside the codec as the GOAWAY is: its ACK says the client read the GOAWAY."""


def _abuse_reason(message: str) -> str:
    """The reason a codec's ENHANCE_YOUR_CALM names, for the listener's count (``ServerStatistics.abuse``)."""
    if "empty frames" in message:
        return "empty_frames"
    if "control frames" in message:
        return "control_flood"
    if "header block" in message.lower():
        return "header_flood"  # CONTINUATIONs past the cap, or an HPACK bomb
    return "abuse"


class H2ServerConnection(RequestChecks):
    peer = "client"

    def __init__(
        self,
        stream: trio.abc.Stream,
        handler: Handler,
        config: ListenerConfig,
        *,
        client: str,
        scheme: bytes,
        relay: Relay | None = None,
        abuse: dict[str, int] | None = None,
    ) -> None:
        cap = HEADER_LIST_HARD_CAP * config.max_header_list_size
        guard = GuardedFrameBuffer(
            max_header_block=cap,
            max_empty=config.max_empty_frames if config.max_empty_frames is not None else _UNLIMITED,
            flood_limit=config.flood_limit if config.flood_limit is not None else _UNLIMITED,
            flood_window=config.flood_window,
        )
        conn = make_h2(
            client_side=False,
            max_concurrent_streams=config.max_concurrent_streams,
            stream_window=config.stream_window,
            max_header_list_size=config.max_header_list_size,
            # Between the two, a 431 of that stream (validation); past the cap, the connection.
            header_list_cap=cap,
            count_streams=False,  # _on_request refuses a stream past the limit, not the connection
            huffman=config.hpack_huffman,
            guard=guard,
            check_lengths=not config.validate,  # a validating listener checks them per stream
            connect_protocol=config.enable_connect_protocol,
        )
        super().__init__(
            stream, conn, connection_window=config.connection_window, max_backlog=config.max_outbound_buffer
        )
        self.handler = handler
        self.relay = relay
        self.config = config
        self.client = client
        self.scheme = scheme
        self.abuse = abuse  # the listener's count of connections closed for abuse, by reason
        self.draining = False
        self._last_stream_id: int | None = None  # set by the final GOAWAY
        self._final_goaway_sent = False
        self._guard = guard
        self._ping_acks: int | None = None  # while the drain waits for its PING's ACK: the count before it
        self._ping_answered = trio.Event()
        self.max_streams = config.max_concurrent_streams
        self.body_limit = config.max_request_body
        self.count_body = config.validate or self.body_limit is not None
        self._opened = 0  # streams the client opened
        self._last_opened = 0  # the highest of their ids
        self._resets = 0  # of those, reset by the client before we finished them, or by us as malformed
        self._nursery: trio.Nursery | None = None
        self._done = trio.Event()
        self._reader_done = trio.Event()
        self._idle: trio.Event | None = None  # while the watchdog sleeps out a quarter of the idle timeout
        self.handlers = self.bind(
            {
                EventKind.REQUEST: self._on_request,
                EventKind.DATA: self.on_data,
                EventKind.STREAM_ENDED: self._on_stream_ended,
                EventKind.TRAILERS: self._on_trailers if config.validate else self.on_trailers,
                EventKind.RESET: self._on_reset,
                EventKind.WINDOW_UPDATED: self._on_window_updated,
                EventKind.SETTINGS_CHANGED: self.on_settings,
                EventKind.TERMINATED: self._on_terminated,
            }
        )

    async def run(self, initial: bytes) -> None:
        self.start()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.writer)
            nursery.start_soon(self._reader, initial)
            nursery.start_soon(self._watchdog)
            if self.draining:
                self._begin_drain()
            await self._done.wait()
            with trio.move_on_after(self.config.close_timeout):
                await self._writer_done.wait()
                await self._reader_done.wait()
            nursery.cancel_scope.cancel()

    def mark_closed(self) -> None:
        super().mark_closed()
        self._done.set()

    async def _reader(self, initial: bytes) -> None:
        try:
            while len(initial) < len(PREFACE) and PREFACE.startswith(initial):
                # Over TLS the listener did not sniff: the preface is read here.
                data = await self.stream.receive_some(65536)
                if not data:
                    return
                initial += data
            if initial.startswith(PREFACE):
                self._receive(initial)
            else:
                self._bad_preface()
            await self.receive_into(self._receive)
            if not self.closed:
                return  # the client ended the connection
            await self._linger()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.mark_closed()
            self._reader_done.set()

    async def _linger(self) -> None:
        """We closed on a client still sending: let our GOAWAY reach it.

        Closing a socket with unread input makes the kernel send a reset,
        which can destroy the GOAWAY in the client's receive buffer before it
        is read. So: wait for the writer to send it, half-close, and discard
        input until the client closes too (``run`` bounds this by
        ``close_timeout``).
        """
        await self._writer_done.wait()
        if isinstance(self.stream, trio.SocketStream):
            await self.stream.send_eof()
            while await self.stream.receive_some(65536):
                pass

    def _bad_preface(self) -> None:
        """Not the client preface (RFC 9113 3.4): GOAWAY(PROTOCOL_ERROR), after our SETTINGS, and close.

        (h2 would raise without queueing a GOAWAY: it checks the preface
        outside its error handling.)
        """
        log.debug("invalid HTTP/2 preface from %s", self.client)
        self.h2.close_connection(error_code=_PROTOCOL_ERROR)
        self.mark_closed()

    def _receive(self, data: bytes | bytearray) -> None:
        try:
            events = self.h2.receive_data(data)
            if self._ping_acks is not None and self._guard.ping_acks > self._ping_acks:
                self._ping_answered.set()  # (after the streams of this read: _final_goaway runs later)
        except ProtocolError as exc:
            # The codec queued a GOAWAY with the right error code; flush it and go.
            log.debug("h2 protocol error from %s: %s", self.client, exc)
            if getattr(exc, "error_code", None) == _CALM:
                self._count_abuse(_abuse_reason(str(exc)))
            self.mark_closed()
            return
        self.dispatch(events)

    # -- events ----------------------------------------------------------------

    def _on_request(self, ev: Any) -> None:
        sid: int = ev.stream_id
        if len(self.streams) >= self.max_streams or (self._last_stream_id is not None and sid > self._last_stream_id):
            # Past SETTINGS_MAX_CONCURRENT_STREAMS (a stream error, RFC 9113 5.1.2), or
            # after our final GOAWAY: refused, which tells the client it may retry it.
            self.h2.reset_stream(sid, _REFUSED)
            return
        st = H2Stream(sid)
        self.streams[sid] = st
        self._opened += 1
        self._last_opened = sid
        timing = Timing()
        request = Request(b"", b"", b"", b"", [], empty_body(), self.client, "2", timing, wire=st)
        error: BlocksError | None = None
        try:
            length = self._fill_request(request, ev.headers)
        except BlocksError as exc:
            error = exc
            length = None
        if length is not None:
            if self.body_limit is not None and length > self.body_limit:
                error = PayloadTooLarge(f"declared body of {length} bytes is over {self.body_limit}")
            st.expected = length
        if request.protocol is not None:
            # A tunnel (extended CONNECT, a WebSocket) carries a stream, not a
            # body: it lives as long as it likes, and max_request_body does not
            # apply to it.
            st.tunnel = True
        ended = ev.stream_ended is not None
        if ended:
            st.remote_ended = True
        elif self.config.request_body_timeout is not None and request.protocol is None:
            st.body_deadline = trio.current_time() + self.config.request_body_timeout
            self._watch()
        if ended and length and error is None and self.config.validate:
            error = BadRequest(f"no body, where content-length declares {length} bytes")
        if error is None:
            if self.relay is not None and self.relay(request, self, st, ended):
                return  # spliced: frames are relayed by the readers from now on
        elif error.status == 400:  # the listener's own 400s are malformed requests (RFC 9113 8.1.1)
            self.malformed(st, error)
            return
        if not ended:
            request.body = self.new_inbound_body(st, length)
        assert self._nursery is not None
        self._nursery.start_soon(self._run_stream, st, request, error)

    def _fill_request(self, request: Request, raw: list[tuple[bytes, bytes]]) -> int | None:
        """Pseudo-headers into the request, the rest into its header list; the declared length.

        Internal hops trust their peer and only split the list; the edge
        validates everything here, so a malformed request is a stream error
        (:meth:`malformed`) that leaves the connection's other streams alone.
        """
        config = self.config
        if config.validate:
            return validate_request_head(
                request,
                raw,
                config.max_header_list_size,
                config.max_header_count,
                max_target=config.max_target,
                connect_protocol=config.enable_connect_protocol,
            )
        headers = request.headers
        length = None
        for field in raw:
            name, value = field
            if name[0] == 58:  # b":"
                if name == b":method":
                    request.method = value
                elif name == b":path":
                    request.path = value
                elif name == b":authority":
                    request.authority = value
                elif name == b":scheme":
                    request.scheme = value
                elif name == b":protocol":
                    request.protocol = value
            else:
                if name == b"content-length":
                    length = int(value)
                headers.append(field)  # as decoded: a never-indexed field stays so on the next link
        return length

    def _on_reset(self, ev: Any) -> None:
        if ev.stream_id in self.streams and self._count_reset():
            return
        self.on_reset(ev)

    def _count_reset(self) -> bool:
        """One more stream the client had reset before we finished it; True if that closed the connection.

        Rapid reset (CVE-2023-44487): a client that cancels most of what it
        opens makes us do work for nothing; cancelling some is normal. A
        malformed request's reset counts the same (:meth:`malformed`).
        """
        self._resets += 1
        limit = self.config.max_client_resets
        if limit is not None and self._resets > limit and 2 * self._resets > self._opened:
            self.calm(
                f"{self._resets} of {self._opened} streams reset by the client or for being malformed", "rapid_reset"
            )
            return True
        return False

    def _on_window_updated(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id) if ev.stream_id else None
        if st is None and (ev.stream_id or not self.streams):
            # A window update that serves no stream we are sending on.
            try:
                self.h2.control_frame()
            except ProtocolError as exc:
                self.calm(str(exc), "control_flood")
                return
        self.on_window_updated(ev)

    def stalled(self, st: H2Stream) -> None:
        super().stalled(st)
        self._watch()

    def _watch(self) -> None:
        """A stream has a clock to watch (a stall, a body deadline): wake the watchdog if it sleeps as idle."""
        if self._idle is not None:
            self._idle.set()

    def calm(self, why: str, reason: str = "abuse") -> None:
        """Close the connection with GOAWAY(ENHANCE_YOUR_CALM): the client is abusive (``reason``, counted)."""
        log.info("closing the connection of %s: %s", self.client, why)
        self._count_abuse(reason)
        try:
            # The codec would name the last stream it parsed; we name the last one we served.
            self.h2.close_connection(error_code=_CALM, last_stream_id=self._last_opened)
        except ProtocolError:
            pass
        self.mark()
        self.mark_closed()

    def _count_abuse(self, reason: str) -> None:
        abuse = self.abuse
        if abuse is not None:
            abuse[reason] = abuse.get(reason, 0) + 1

    def _on_stream_ended(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is not None:
            st.remote_ended = True
            if st.splice is not None:
                st.splice.ended(st)
            elif st.body is not None:
                st.body.end()

    def _on_terminated(self, ev: Any) -> None:
        # The client will open no more streams; finish the ones it has.
        if not self.survive_goaway(ev):
            self.mark_closed()
            return
        self._last_stream_id = ev.last_stream_id or 0
        self.draining = True

    def fail_stream(self, st: H2Stream, error: BaseException) -> None:
        super().fail_stream(st, error)
        if st.cancel_scope is not None:
            st.cancel_scope.cancel()

    def stream_closed(self, st: H2Stream) -> None:
        if self._last_stream_id is not None and not self.streams and not self.closed:
            if not self._final_goaway_sent:  # (the client's GOAWAY ended it: ours goes now)
                with contextlib.suppress(ProtocolError):
                    self.h2.close_connection(last_stream_id=self._last_stream_id)
            self.mark_closed()

    # -- timeouts ----------------------------------------------------------------------

    async def _watchdog(self) -> None:
        """The connection's timeouts, checked a few times per the shortest of them.

        - ``stall_timeout``: a stream that has waited that long to send (the
          client's window stays shut, or the client does not read) is reset,
          and whatever feeds it upstream is cancelled;
        - ``request_body_timeout``: a request body not ended by then gets
          408 (or a reset, once the response started);
        - ``h2_idle_timeout``: a connection without streams that long is
          closed with GOAWAY(NO_ERROR).

        Nothing on the request path reads a clock for this: a stream notes
        the time only when it starts waiting. A connection without streams
        has only its idle timeout to watch: the watchdog then sleeps a
        quarter of it at a time (a stall or a body deadline wakes it sooner),
        and a quarter in which streams came and went counts as busy. So a
        connection is closed as idle a quarter of ``h2_idle_timeout`` late at
        most, and 10,000 idle connections wake the watchdogs 133 times a
        second, not 1,300.
        """
        config = self.config
        timeouts = [config.stall_timeout, config.h2_idle_timeout]
        if config.request_body_timeout is not None:
            timeouts.append(config.request_body_timeout)
        period = min(timeouts) / 4
        idle_since = trio.current_time()
        while not self.closed:
            if not self.streams:
                opened = self._opened
                woken = self._idle = trio.Event()
                with trio.move_on_after(config.h2_idle_timeout / 4):
                    await woken.wait()
                self._idle = None
                now = trio.current_time()
                if self._opened != opened or self.streams:
                    idle_since = now
                elif now - idle_since >= config.h2_idle_timeout and not self.closed:
                    log.debug("closing the idle connection of %s", self.client)
                    with contextlib.suppress(ProtocolError):
                        self.h2.close_connection(last_stream_id=self._last_opened)
                    self.mark_closed()
                continue
            await trio.sleep(period)
            now = trio.current_time()
            if self.streams:
                idle_since = now
            for st in list(self.streams.values()):
                if st.closed:
                    continue
                if st.stalled_since is not None and now - st.stalled_since >= config.stall_timeout:
                    log.debug("stream %d of %s stalled for %.1f s", st.id, self.client, now - st.stalled_since)
                    self.reset(st, _CANCEL)
                elif st.body_deadline is not None and not st.remote_ended and now >= st.body_deadline:
                    self._refuse_body(st, 0, StreamReset("request body too slow", status=408))
            flush_marked()  # what the resets queued on spliced upstream connections

    # -- drain ---------------------------------------------------------------------

    def drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        if self._nursery is not None:
            self._begin_drain()

    def _begin_drain(self) -> None:
        if self.closed:
            return
        self.send_graceful_goaway(2**31 - 1)
        self._ping_acks = self._guard.ping_acks
        self._queue(_DRAIN_PING)
        assert self._nursery is not None
        self._nursery.start_soon(self._final_goaway)

    async def _final_goaway(self) -> None:
        with trio.move_on_after(self.config.drain_goaway_delay):
            await self._ping_answered.wait()
        self._ping_acks = None
        if self.closed:
            return
        # Streams the client opened until now are served; later ones are refused.
        self._last_stream_id = self.h2.highest_inbound_stream_id
        self.send_graceful_goaway(self._last_stream_id)
        self._final_goaway_sent = True
        if not self.streams:
            self.stream_closed(H2Stream(0))

    # -- streams -------------------------------------------------------------------

    def body_abandoned(self, st: H2Stream) -> None:
        """A request body its handler closed early: the stream stays for the answer, which ends it
        (RST_STREAM(NO_ERROR) after it, RFC 9113 8.1: see :meth:`_run_stream`); what the client
        still sends meanwhile is acknowledged and dropped. A reset here would beat the answer."""

    async def _run_stream(self, st: H2Stream, request: Request, error: BlocksError | None) -> None:
        response: Response | None = None
        sent = False
        try:
            with trio.CancelScope() as scope:
                st.cancel_scope = scope
                if st.closed:
                    # Reset (by the client, or as malformed) before its task ran: the handler will
                    # never hear of it, so what a hop's fast path decided for it is given back here.
                    if request.exchange is not None:
                        request.exchange.closed()
                    return
                if error is not None:
                    response = error_response(error.status, error.headers, hop=self.config.hop)
                else:
                    response = await respond(self.handler, request)
                    refused = st.body.error if st.body is not None else None
                    if isinstance(refused, StreamReset) and refused.status < 500 and response.status >= 500:
                        # The client's upload was refused (over the limit, not matching its
                        # length): that is the answer, not whatever a relay made of the cut.
                        await abandon(response.body)
                        response.closed()
                        response = error_response(refused.status, hop=self.config.hop)
                if request.method == b"HEAD" and not response.body.ended:
                    await abandon(response.body)
                    response.body = empty_body()
                await self._send_response(st, response)
                sent = True
        except StreamReset:
            pass
        except Exception:
            log.exception("failed while sending a response")
            self.reset(st, _INTERNAL)
        finally:
            # Every path, cancellation included: the stream ends on the wire,
            # whatever the response holds is released exactly once, and so is
            # every request body byte nobody read (the handler is done with it).
            if response is None:
                if not st.closed:
                    self.reset(st, _CANCEL)
            else:
                if not st.closed and not sent:
                    # The body broke (or we were cancelled) after the head: the
                    # client must learn the response is cut short.
                    self.reset(st, _CANCEL)
                elif not st.closed:
                    # Sent in full. A request body the handler left unread is
                    # refused with NO_ERROR (RFC 9113 8.1), never left to stall.
                    if st.body is None or st.body.ended:
                        self.finish_stream(st)
                    else:
                        self.reset(st, _NO_ERROR)
                if not response.body.ended:
                    await abandon(response.body)
                response.closed()
            body = st.body
            if body is not None and not (body.claimed and body.received_all):
                # Nobody started reading it, or it did not end: nobody will read it now. (A body
                # that ended is left to a reader that started it: a relay's pump still sending it.)
                body.discard()

    async def _send_response(self, st: H2Stream, response: Response) -> None:
        headers = [(b":status", _STATUS[response.status])]
        headers += response.headers
        body = response.body
        st.head = headers  # the response has started: a malformed request's stream is only reset from now on
        try:
            if body.ended and not body.trailers:
                self.h2.send_headers(st.id, headers, end_stream=True)
                self.kick()
                return
            self.h2.send_headers(st.id, headers)
        except ProtocolError as exc:
            raise StreamReset("stream closed before the response") from exc
        self.kick()  # the head goes now, whenever the body's first bytes come
        await self.send_body(st, body)
