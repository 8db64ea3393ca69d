"""The HTTP/2 driver: :class:`H2Driver`, one codec on one trio stream, and the batch its readers end with.

A driver reads (:meth:`H2Driver.receive_into`), dispatches the codec's
events to its role's handlers, and writes what the codec queued, straight
from the reader's batch (:func:`flush_marked`) or through its writer task.
The batch's state lives here with the class, because the driver's methods
write it (``_dispatching``, set by :meth:`H2Driver.dispatch` and read by
:func:`in_batch` and :meth:`H2Driver.send_soon`). The theory of operation
and the invariants are the package docstring's (:mod:`blocks.transport._h2`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import trio

from blocks._sync import Signal
from blocks.errors import StreamReset
from blocks.http import Body, BytesBody, Headers, StreamBody
from blocks.transport._codec import Codec, ErrorCodes, EventKind, ProtocolError
from blocks.transport._h2._stream import H2ConnectionStatistics, H2Stream, acknowledge

log = logging.getLogger("blocks.h2")

_DEFAULT_WINDOW = 65535
MAX_WINDOW = 2**31 - 1
BACKLOG_HIGH = 256 * 1024
"""Bytes waiting for a connection's writer past which DATA senders wait (back-pressure)."""
RECEIVE_SIZE = 65536
"""The most one read takes from a connection's socket: one reader's batch."""

_marked: collections.deque[H2Driver] = collections.deque()
_local: dict[Any, H2Driver] = {}  # this process's connections on plain sockets, by (own address, peer's)
_INET = (socket.AF_INET, socket.AF_INET6)
_taking_depth = [0]  # reads _take_local is dispatching, one inside another
_MAX_TAKING = 8
"""How deep reads handed on between connections of one process may nest (a chain's hops: a few)."""
_dispatching = False  # a reader's batch is being dispatched: flush_marked comes at its end


def flush_marked() -> None:
    """Write out every connection a reader's batch touched, in the order they were marked.

    Readers process a whole ``receive_some`` worth of frames, marking each
    connection they queued bytes on (their own, and through splices, others).
    At the end of the batch each one is written with one non-blocking
    ``os.write``: one syscall per connection per batch and no task switch.
    Whatever the socket does not take goes to that connection's writer.
    First marked, first written: what a batch relays goes out before the
    reader's own connection's housekeeping (its window updates, its acks).
    """
    while _marked:
        _marked.popleft()._flush_now()


def in_batch() -> bool:
    """Whether a reader's batch is being dispatched now: what is marked goes out at its end."""
    return _dispatching


class H2Driver:
    """A codec (:class:`~blocks.transport.streams.Codec`) on a trio stream, with a coalescing writer."""

    peer = "peer"  # who is on the other end, for messages
    handlers: dict[type, Callable[[Any], None]]  # the codec's event class -> its handler (see bind)

    def __init__(
        self,
        stream: trio.abc.Stream,
        conn: Codec,
        *,
        connection_window: int,
        max_backlog: int | None = None,
    ) -> None:
        self.stream = stream
        self.h2 = conn
        self.streams: dict[int, H2Stream] = {}
        self.closed = False
        self._wake = Signal()
        self._out: list[bytes] = []  # bytes taken from the codec, waiting for the writer
        self._sending = False  # the writer is inside send_all
        self.backlog = 0  # bytes in _out or inside send_all
        self.pushed = 0  # DATA bytes splices gave h2 since the last flush (not in backlog yet)
        self.backlogged = False  # a DATA sender waits for the backlog to fall
        self.body_limit: int | None = None  # server side: max_request_body
        self.count_body = False  # server side: count request body bytes (limit, declared length)
        self._max_backlog = max_backlog
        self._marked = False
        # A plain socket can take bytes straight from a reader, without waking
        # the writer (see flush_marked); TLS always goes through the writer.
        self._fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        self._writer_done = trio.Event()
        self._connection_window = connection_window
        self._parked = False  # the reader waits for the socket to be readable (see _take_local)
        self._taking = False  # _take_local is dispatching a read for it
        self._peer_key: Any = None  # (the peer's address, ours): the peer's key in _local if it is of this process
        self._reading: Callable[[bytes | bytearray], None] | None = None  # the reader's receive, while it runs

    # -- reading ---------------------------------------------------------------

    async def receive_into(self, receive: Callable[[bytes | bytearray], None]) -> None:
        """Hand each read of the peer's bytes to ``receive`` (a batch) until the peer ends or we close.

        On a plain socket the reads are ``os.read`` calls with one checkpoint
        each, where ``receive_some`` pays two and a read that finds nothing:
        a read that came back short emptied the socket, so the next one first
        waits for it to be readable; a full one yields, so that one busy
        connection does not starve the others, and reads again. A lone token
        that crosses a hop costs its reader one wake-up and one read, and
        none at all when the bytes come from a connection of this process
        (see :meth:`_take_local`). Over TLS, ``receive_some``. Errors are
        trio's (``BrokenResourceError``, ``ClosedResourceError``).
        """
        stream = self.stream
        if self._fd < 0:
            while not self.closed:
                data = await stream.receive_some(RECEIVE_SIZE)
                if not data:
                    return
                receive(data)
            return
        assert isinstance(stream, trio.SocketStream)
        sock = stream.socket
        fd = self._fd
        read = os.read
        wait_readable = trio.lowlevel.wait_readable
        checkpoint = trio.lowlevel.checkpoint
        here = None
        if sock.family in _INET:  # (an address names one TCP socket; an unnamed unix socket's does not)
            try:
                # (A listener's connections all share its address: only the pair names one.)
                own, peer = sock.getsockname(), sock.getpeername()
                here, self._peer_key = (own, peer), (peer, own)
            except OSError:
                pass
        if here is not None:
            _local[here] = self
            self._reading = receive
        full = False
        try:
            while not self.closed:
                if full:
                    await checkpoint()
                    if sock.fileno() != fd:  # (a wait would have raised ClosedResourceError: see notify_closing)
                        raise trio.ClosedResourceError("the connection's socket was closed")
                else:
                    self._parked = True
                    try:
                        await wait_readable(fd)
                    finally:
                        self._parked = False
                try:
                    data = read(fd, RECEIVE_SIZE)
                except BlockingIOError:
                    full = False  # (read for it already: a local peer's flush)
                    continue
                except OSError as exc:
                    raise trio.BrokenResourceError(f"reading from the {self.peer} failed: {exc}") from exc
                if not data:
                    return
                full = len(data) == RECEIVE_SIZE
                receive(data)
        finally:
            self._parked = False
            self._reading = None
            if here is not None and _local.get(here) is self:
                del _local[here]

    def _take_local(self) -> None:
        """A connection of this process just wrote to ours: read and dispatch it now, in the writer's batch.

        Hops that share a process (the chain recipe runs edge, proxy and
        worker in one) still talk over loopback sockets, and each hop's reader
        used to be woken by trio for what the hop before it had just written:
        a wake-up per hop per token. When the reader waits for its socket
        (nothing unread, ``_parked``), one read of what was just written is
        dispatched here at once, as the reader would have; the reader finds
        the socket empty when it next looks. At most one read: more (a full
        one) is left to the reader, so a busy link still yields. What goes
        wrong here is this connection's alone, as in its reader: a failure
        closes it.

        What it dispatches may write back to a connection of this process,
        and so on: each connection takes at most one such read at a time
        (``_taking``), and a chain of them is at most :data:`_MAX_TAKING`
        deep, past which readers are woken as before. Two hops that answer
        each other (DATA, then WINDOW_UPDATE, then DATA) cannot recurse.
        """
        receive = self._reading
        if receive is None or self.closed:
            return
        stream = self.stream
        assert isinstance(stream, trio.SocketStream)
        if stream.socket.fileno() != self._fd:
            return  # closed (its reader has yet to hear of it): the number may be another socket's by now
        try:
            data = os.read(self._fd, RECEIVE_SIZE)
        except OSError:
            return  # nothing there after all, or broken: the reader finds out
        if not data:
            return  # the end: the reader finds it too
        self._taking = True
        _taking_depth[0] += 1
        try:
            receive(data)
        except Exception:
            log.exception("%s failed on what a local connection sent", type(self).__name__)
            self.mark_closed()
        finally:
            self._taking = False
            _taking_depth[0] -= 1

    # -- writing ---------------------------------------------------------------

    def kick(self) -> None:
        """Move what the state machine queued to the writer; wake it only if there is something."""
        self.pushed = 0  # whatever splices pushed is in ``data`` now, and counted as backlog
        data = self.h2.data_to_send()
        if data:
            self._queue(data)

    def _queue(self, data: bytes) -> None:
        self._out.append(data)
        self.backlog += len(data)
        self._wake.set()
        if self._max_backlog is not None and self.backlog > self._max_backlog and not self.closed:
            # DATA waits at BACKLOG_HIGH, so only a peer that does not read
            # while it makes us answer (PINGs, SETTINGS, heads) gets here.
            log.info("%s does not read: %d bytes waiting; closing", self.peer, self.backlog)
            self.mark_closed()

    def bind(self, handlers: Mapping[EventKind, Callable[[Any], None]]) -> dict[type, Callable[[Any], None]]:
        """The role's handlers by kind, keyed by the codec's event classes: what ``handlers`` holds.

        Once per connection, so that :meth:`dispatch` finds an event's handler
        with one dict lookup on its class. Kinds without a handler are ignored.
        """
        return {cls: handlers[kind] for cls, kind in self.h2.event_kinds.items() if kind in handlers}

    def dispatch(self, events: list[Any]) -> None:
        """Run each event's handler (``self.handlers``), then flush what the batch touched.

        A handler that raises costs its event's stream only (see
        :meth:`event_failed`): the rest of the batch goes on.
        """
        global _dispatching
        handlers = self.handlers
        _dispatching = True
        try:
            for ev in events:
                handler = handlers.get(type(ev))
                if handler is not None:
                    try:
                        handler(ev)
                    except Exception:
                        self.event_failed(ev)
                    if self.closed:
                        break  # the rest of the batch is moot (and may be a flood)
        finally:
            _dispatching = False
            self.mark()
            flush_marked()

    def event_failed(self, ev: Any) -> None:
        """A handler raised (a bug, ours or in code a hop runs for a user): that stream alone is reset.

        Logged once with the traceback. A stream's event resets that stream
        with INTERNAL_ERROR (and whatever it was spliced to, as any reset
        does); an event of the whole connection closes the connection, whose
        state can no longer be trusted.
        """
        sid = getattr(ev, "stream_id", 0) or 0
        log.exception("%s failed on %s", type(self).__name__, type(ev).__name__)
        st = self.streams.get(sid) if sid else None
        if st is not None:
            self.reset(st, ErrorCodes.INTERNAL_ERROR)
        elif sid:
            with contextlib.suppress(ProtocolError):
                self.h2.reset_stream(sid, ErrorCodes.INTERNAL_ERROR)
        else:
            with contextlib.suppress(ProtocolError):
                self.h2.close_connection(ErrorCodes.INTERNAL_ERROR)
            self.mark_closed()

    def mark(self) -> None:
        """From a reader: flush this connection when the reader's batch is done."""
        if not self._marked:
            self._marked = True
            _marked.append(self)

    def _flush_now(self) -> None:
        self._marked = False
        self.pushed = 0
        data = self.h2.data_to_send()
        if not data:
            return
        if self._fd >= 0 and not self._out and not self._sending and not self.closed:
            try:
                sent = os.write(self._fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.mark_closed()
                return
            if sent == len(data):
                if self.backlogged and self.backlog < BACKLOG_HIGH // 2:
                    # Splices parked on what this batch pushed, and it all went out
                    # here, not through the writer (which would wake them): wake them.
                    self.backlogged = False
                    self.wake_all_windows()  # their pushes mark us again: flush_marked goes on
                peer = _local.get(self._peer_key)
                if peer is not None and peer._parked and not peer._taking and _taking_depth[0] < _MAX_TAKING:
                    peer._take_local()  # (a hop of this process: no wake-up for it)
                return
            data = data[sent:]
        self._queue(data)

    def send_soon(self) -> None:
        """Write what the state machine queued: at the end of the reader's batch in one, else now."""
        self.mark()
        if not _dispatching:
            flush_marked()

    def statistics(self) -> H2ConnectionStatistics:
        window, unacknowledged = self.h2.inbound_books()
        return H2ConnectionStatistics(streams=len(self.streams), inbound_window=window, unacknowledged=unacknowledged)

    def start(self) -> None:
        """Queue the preface and our SETTINGS, and open the connection window."""
        self.h2.initiate_connection()
        extra = self._connection_window - _DEFAULT_WINDOW
        if extra > 0:
            self.h2.increment_flow_control_window(extra)
        self.kick()

    async def writer(self) -> None:
        """Send what :meth:`kick` queued, one ``send_all`` per wake-up, until the connection closes."""
        stream = self.stream
        out = self._out
        try:
            while True:
                await self._wake.wait()
                if self.closed:
                    self.kick()
                # A close may come while we send: what it queued (a GOAWAY) goes before we return.
                while out:
                    data = out[0] if len(out) == 1 else b"".join(out)
                    out.clear()
                    self._sending = True
                    await stream.send_all(data)
                    self._sending = False
                    self.backlog -= len(data)
                    if self.backlogged and self.backlog < BACKLOG_HIGH // 2:
                        self.backlogged = False
                        self.wake_all_windows()
                        flush_marked()  # what spliced pipes sent on waking
                    if self.closed:
                        self.kick()
                if self.closed:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.mark_closed()
        finally:
            self._writer_done.set()

    def send_graceful_goaway(self, last_stream_id: int) -> None:
        """Send GOAWAY(NO_ERROR, ``last_stream_id``) and keep the connection open.

        The codec's state machine would close on a GOAWAY it sends, which
        would forbid finishing the streams in flight, so the frame is written
        beside it instead (``Codec.goaway_frame``). The final GOAWAY, once the
        streams are done, goes through the codec as usual.
        """
        self.kick()
        self._queue(self.h2.goaway_frame(last_stream_id))

    def survive_goaway(self, ev: Any) -> bool:
        """After a peer's graceful GOAWAY, let the streams below its last id finish.

        Returns True when the connection stays usable for those streams. The
        caller must not open new streams on it. (See :meth:`send_graceful_goaway`
        for why the codec's state is put back.)
        """
        if ev.error_code != 0 or not self.streams:
            return False
        self.h2.reopen_after_goaway()
        return True

    def mark_closed(self) -> None:
        if not self.closed:
            self.closed = True
            self._wake.set()
            for st in list(self.streams.values()):
                self.stream_lost(st)

    def stream_lost(self, st: H2Stream) -> None:
        """Hook: the connection ended under ``st`` (the client tells apart the streams it may send again)."""
        self.fail_stream(st, StreamReset("connection closed"))

    # -- streams -----------------------------------------------------------------

    def fail_stream(self, st: H2Stream, error: BaseException) -> None:
        """The stream is gone: wake everyone who waits on it."""
        if st.closed:
            return
        st.closed = True
        self.streams.pop(st.id, None)
        if st.body is not None:
            st.body.fail(error)
        if st.signal is not None:
            st.signal.set()
        if st.window is not None:
            st.window.set()
        if st.splice is not None:
            st.splice.failed(self, error)
        self.stream_closed(st)

    def stream_closed(self, st: H2Stream) -> None:
        """Hook: a stream left ``streams`` (slot accounting in the client)."""

    def stalled(self, st: H2Stream) -> None:
        """Sending on ``st`` waits, from now, for the peer's window or for the writer: a stream
        that waits ``stall_timeout`` is reset (the server's and the pool's sweepers)."""
        st.stalled_since = trio.current_time()

    def body_abandoned(self, st: H2Stream) -> None:
        """Its reader closed ``st``'s inbound body before its end: the client resets the stream (it
        wants no more of the response); the server does not (see its override)."""
        self.reset(st)

    def local_end(self, st: H2Stream) -> None:
        """Our END_STREAM on ``st`` went to the codec (the client starts the response clock here)."""
        st.local_ended = True

    def finish_stream(self, st: H2Stream) -> None:
        """Both directions ended normally."""
        if not st.closed:
            st.closed = True
            self.streams.pop(st.id, None)
            self.stream_closed(st)

    def reset(self, st: H2Stream, code: int = ErrorCodes.CANCEL) -> None:
        """Reset the stream on the wire (if the codec still thinks it is open) and drop it."""
        if not self.closed:
            try:
                self.h2.reset_stream(st.id, code)
            except ProtocolError:
                pass
            self.kick()
        self.fail_stream(st, st.error or StreamReset("stream reset locally"))

    def new_inbound_body(self, st: H2Stream, length: int | None) -> StreamBody:
        """A body for data the peer sends on ``st``; window returns as it is read."""
        sid = st.id
        conn = self.h2

        def consumed(n: int) -> None:
            if not self.closed:
                acknowledge(conn, n, sid)
                self.kick()

        def abandon() -> None:
            if not st.closed and conn.stream_is_open(sid):
                self.body_abandoned(st)

        body = StreamBody(length, on_consumed=consumed, on_abandon=abandon)
        st.body = body
        return body

    def on_data(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        data = ev.data or b""
        size = ev.flow_controlled_length or 0
        if st is not None:
            st.received += len(data)
            if self.count_body and self.body_refused(st, ev.stream_ended is not None, size):
                return
            if st.splice is not None:
                st.splice.data(self, st, data, size, ev.stream_ended is not None)
                return
            body = st.body
        else:
            body = None
        if body is None or body._ended:
            if size:  # nobody will read it
                acknowledge(self.h2, size, ev.stream_id)
            return
        padding = size - len(data)
        if padding:
            acknowledge(self.h2, padding, ev.stream_id)
        body.feed(data)

    def body_refused(self, st: H2Stream, end: bool, size: int) -> bool:
        """Hook (server side): ``st.received`` grew (``end``: its last frame); True if the frame must not
        be delivered (it takes ``size``, the frame's flow-controlled length, off the pipe)."""
        return False

    def on_trailers(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is not None:
            if st.splice is not None:
                st.splice.ended(st, list(ev.headers))
            elif st.body is not None:
                st.body.end(list(ev.headers))

    def on_reset(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is not None:
            error = StreamReset(f"{self.peer} reset the stream ({ev.error_code!r})", code=ev.error_code)
            self.fail_stream(st, error)

    def on_settings(self, ev: Any) -> None:
        self.wake_all_windows()

    def on_window_updated(self, ev: Any) -> None:
        if ev.stream_id:
            st = self.streams.get(ev.stream_id)
            if st is not None:
                if st.window is not None:
                    st.window.set()
                if st.splice is not None:
                    st.splice.window(st)
        else:
            self.wake_all_windows()

    def wake_all_windows(self) -> None:
        for st in list(self.streams.values()):
            if st.window is not None:
                st.window.set()
            if st.splice is not None:
                st.splice.window(st)

    async def send_data(self, st: H2Stream, data: bytes, end_stream: bool = False) -> None:
        """Send ``data`` on ``st`` as its send windows allow, waiting for them."""
        conn = self.h2
        sid = st.id
        progressed = False
        while True:
            if st.closed or self.closed:
                raise StreamReset("stream closed by peer")
            try:
                window = conn.local_flow_control_window(sid)
            except ProtocolError as exc:
                raise StreamReset("stream closed by peer") from exc
            if self.backlog >= BACKLOG_HIGH:
                window = 0  # the peer is not reading fast enough; wait for the writer
                self.backlogged = True
            size = len(data)
            frame = conn.max_outbound_frame_size
            if size <= window and size <= frame:
                conn.send_data(sid, data, end_stream=end_stream)
                st.sent += size
                self.kick()
                st.stalled_since = None
                return
            if window > 0:
                n = min(window, frame)
                conn.send_data(sid, data[:n])
                st.sent += n
                data = data[n:]
                self.kick()
                progressed = True
                continue
            if st.window is None:
                st.window = Signal()
            if progressed or st.stalled_since is None:
                self.stalled(st)  # stalled since the last progress
                progressed = False
            await st.window.wait()

    async def send_body(self, st: H2Stream, body: Body) -> None:
        """Send ``body`` (already known not to be ended) and its trailers on ``st``."""
        conn = self.h2
        if type(body) is BytesBody:
            data = await body.receive()
            if body.trailers:
                await self.send_data(st, data)
                self._send_trailers(st, body.trailers)
            else:
                await self.send_data(st, data, end_stream=True)
            return
        while chunk := await body.receive():
            await self.send_data(st, chunk)
        if st.closed or self.closed:
            raise StreamReset("stream closed by peer")
        if body.trailers:
            self._send_trailers(st, body.trailers)
        else:
            conn.end_stream(st.id)
            self.kick()

    def _send_trailers(self, st: H2Stream, trailers: Headers) -> None:
        self.h2.send_headers(st.id, trailers, end_stream=True)
        self.kick()
