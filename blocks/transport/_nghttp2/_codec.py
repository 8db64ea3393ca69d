"""The nghttp2 codec: :class:`NgCodec`, one libnghttp2 session behind the :class:`~blocks.transport._codec.Codec`
contract (what the library reports becomes the contract's events in :mod:`._reports`; each read's
frame headers are checked first in :mod:`._scan`).

Rules the codec keeps, which the library does not enforce:

- Callbacks only record. Nothing calls into the session from a callback
  (``nghttp2_submit_trailer`` from a DATA source's read callback is the one
  call the library documents as allowed there). A callback that raises
  returns ``NGHTTP2_ERR_CALLBACK_FAILURE`` (its ``onerror`` keeps the
  exception), the library stops, and the codec re-raises it: cffi would
  otherwise print it and return 0.
- A header block's fields are buffered until the frame that ends it is in
  (``on_frame_recv``): the fields before a bad one never reach the driver.
- The session runs with ``no_http_messaging`` (the edge validates request
  heads itself, as with hyper-h2: a field with CR, LF, NUL or stray
  whitespace reaches the validator, which answers 400, where the library
  would drop it silently), manual flow control (``no_auto_window_update``:
  the driver gives window back as the body is read) and no record of closed
  streams (a late frame on one is ignored or its stream's error, never the
  connection's).
- A peer's RST_STREAM is reported once, when the frame is received; a stream
  the library resets itself (a stream error it found) is reported then too,
  as ``StreamReset`` with ``remote_reset`` False.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, ClassVar

import h2.exceptions

from blocks.transport._codec import (
    CLOSED_STREAMS,
    ClosedStreams,
    ErrorCodes,
    EventKind,
    GuardedFrameBuffer,
    ProtocolError,
)
from blocks.transport._nghttp2 import _events as events
from blocks.transport._nghttp2._headers import nv_array, submit_headers
from blocks.transport._nghttp2._library import (
    DATA_EOF,
    DATA_NO_END_STREAM,
    DEFERRED,
    END_STREAM,
    SETTINGS_ENABLE_CONNECT_PROTOCOL,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SHIM,
    STREAM_STATE_CLOSED,
    NgProtocolError,
    NgStreamClosedError,
    check,
    failures,
    ffi,
    goaway,
    lib,
    wire_code,
)
from blocks.transport._nghttp2._reports import CALLBACKS, READ, replay
from blocks.transport._nghttp2._scan import ANSWER, CLOSE, LATE, Scan

_MAX_WINDOW = 2**31 - 1
_NO_STREAMS_LIMIT = 2**31 - 1
_NO_ACK_LIMIT = 2**31 - 1
_MAX_CONTINUATIONS = 63  # (the guard's MAX_CONTINUATIONS, for a client, where the library has the option)
_POINTER = ffi.new("const uint8_t **")


class _Out:
    """What the driver gave for one stream's DATA and the session has not framed yet."""

    __slots__ = ("chunks", "deferred", "end", "size", "trailers")

    def __init__(self) -> None:
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.end = False
        self.trailers: Any = None
        self.deferred = False  # the source said it had nothing yet: the session waits for a resume


class NgCodec:
    """One HTTP/2 connection on a libnghttp2 session (see the module docstring). Made by ``make_nghttp2``."""

    event_kinds: ClassVar[Mapping[type, EventKind]] = {
        events.RequestReceived: EventKind.REQUEST,
        events.ResponseReceived: EventKind.RESPONSE,
        events.DataReceived: EventKind.DATA,
        events.TrailersReceived: EventKind.TRAILERS,
        events.StreamEnded: EventKind.STREAM_ENDED,
        events.StreamReset: EventKind.RESET,
        events.WindowUpdated: EventKind.WINDOW_UPDATED,
        events.RemoteSettingsChanged: EventKind.SETTINGS_CHANGED,
        events.ConnectionTerminated: EventKind.TERMINATED,
        events.PingAckReceived: EventKind.PING_ACK,
    }
    name = "nghttp2"

    __slots__ = (
        "__dict__",  # (made only when something sets another attribute: a test wrapping receive_data, say)
        "_acknowledged",
        "_block",
        "_block_size",
        "_cap",
        "_chunks",
        "_closed_streams",
        "_error",
        "_error_message",
        "_events",
        "_goaway_code",
        "_handle",
        "_heads",
        "_highest_inbound",
        "_log",
        "_opened",
        "_out",
        "_overflowed",
        "_padding",
        "_patch_streams",
        "_peer_window",
        "_provider",
        "_received",
        "_reset_reported",
        "_runs",
        "_scan",
        "_sent",
        "_session",
        "_settings",
        "_terminated",
        "_unframed",
        "client_side",
        "guard",
    )

    def __init__(
        self,
        *,
        client_side: bool,
        settings: list[tuple[int, int]],
        header_list_cap: int,
        count_streams: bool,
        guard: GuardedFrameBuffer | None,
    ) -> None:
        self.client_side = client_side
        self.guard = guard
        self._settings = settings
        self._cap = header_list_cap
        self._patch_streams: int | None = None
        if not count_streams:
            # The library fails the connection past our SETTINGS_MAX_CONCURRENT_STREAMS; a server that
            # counts its streams refuses the stream alone. The library is told no limit, the peer is
            # told ours: the value is put back in our first SETTINGS frame as it leaves (_patch).
            self._patch_streams = dict(settings).get(SETTINGS_MAX_CONCURRENT_STREAMS)
        self._events: list[Any] = []
        self._error: ProtocolError | None = None  # a connection error a callback found (then it fails)
        self._error_message = ""
        self._goaway_code: int = ErrorCodes.PROTOCOL_ERROR  # (the code of our GOAWAY, once _goaway_sent found it)
        self._block: list[tuple[bytes, bytes]] = []  # the header block being received
        self._block_size = 0
        self._chunks: list[bytes] = []  # the DATA frame being received
        self._runs: dict[int, Any] = {}  # per stream, the DataReceived its DATA of this read is joined into
        self._highest_inbound = 0  # see highest_inbound_stream_id
        self._heads: set[int] = set()  # streams whose head (request or final response) was received
        self._opened: set[int] = set()  # (a client's) streams it opened, until they close
        self._reset_reported: set[int] = set()  # streams reset (by either side, or the library) and open
        self._out: dict[int, _Out] = {}  # streams with a DATA source at the session
        self._unframed = 0  # the bytes in their sources
        self._sent = bytearray()  # taken from the session early (to keep frames in order), not sent yet
        self._received = 0  # DATA bytes reported to the driver
        self._acknowledged = 0  # of those, given back
        self._padding: dict[int, int] = {}  # padding received per stream, that the library gave back itself
        self._terminated = False
        self._overflowed = 0  # a stream the library reset for DATA past its window (a connection error)
        # streams closed, remembered as h2 does (its name, its bound): True for one closed by a reset
        self._closed_streams = ClosedStreams(CLOSED_STREAMS)
        self._peer_window = 65535  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self._handle = ffi.new_handle(self)
        self._provider = ffi.new("nghttp2_data_provider *")  # (its source: this codec, for _read)
        self._provider.source.ptr = self._handle
        self._provider.read_callback = READ
        self._log: Any = None
        user_data = self._handle
        if SHIM:
            self._log = user_data = ffi.gc(lib.pb_log_new(header_list_cap), lib.pb_log_del)
        option = ffi.new("nghttp2_option **")
        check(lib.nghttp2_option_new(option))
        opt = ffi.gc(option[0], lib.nghttp2_option_del)
        lib.nghttp2_option_set_no_auto_window_update(opt, 1)
        lib.nghttp2_option_set_no_http_messaging(opt, 1)
        lib.nghttp2_option_set_no_closed_streams(opt, 1)
        # The library fails a session past 1,000 answers (PING and SETTINGS ACKs) queued and not taken;
        # the codec takes them after every read, so they are bounded by a read, and the limits on
        # control frames are the guard's (flood_limit) and the driver's (max_outbound_buffer).
        lib.nghttp2_option_set_max_outbound_ack(opt, _NO_ACK_LIMIT)
        lib.nghttp2_option_set_max_send_header_block_length(opt, max(header_list_cap, 65536))
        if client_side:
            # (our streams are counted by the pool: the library should hold none back)
            lib.nghttp2_option_set_peer_max_concurrent_streams(opt, _NO_STREAMS_LIMIT)
        if SHIM:
            lib.pb_set_max_continuations(opt, _MAX_CONTINUATIONS)  # (where the library has it)
        elif (continuations := getattr(lib, "nghttp2_option_set_max_continuations", None)) is not None:
            continuations(opt, _MAX_CONTINUATIONS)
        session = ffi.new("nghttp2_session **")
        new = lib.nghttp2_session_client_new2 if client_side else lib.nghttp2_session_server_new2
        check(new(session, CALLBACKS, user_data, opt))
        self._session = ffi.gc(session[0], lib.nghttp2_session_del)
        self._scan = Scan(
            client_side=client_side,
            guard=guard,
            cap=header_list_cap,
            session=self._session,
            heads=self._heads,
            opened=self._opened,
            closed=self._closed_streams,
        )

    def __repr__(self) -> str:
        return f"<NgCodec {'client' if self.client_side else 'server'} streams={len(self._heads)}>"

    # -- the contract's reading ------------------------------------------------------

    @property
    def max_outbound_frame_size(self) -> int:
        return int(lib.nghttp2_session_get_remote_settings(self._session, SETTINGS_MAX_FRAME_SIZE))

    @property
    def highest_inbound_stream_id(self) -> int:
        """The highest stream the peer opened with a whole header block (as hyper-h2 counts it: a block
        cut short opened nothing, where the library counts the stream from its first frame)."""
        return self._highest_inbound

    @property
    def remote_settings(self) -> _RemoteSettings:
        return _RemoteSettings(self._session)

    def stream_is_open(self, stream_id: int) -> bool:
        stream = lib.nghttp2_session_find_stream(self._session, stream_id)
        return bool(stream != ffi.NULL and lib.nghttp2_stream_get_state(stream) != STREAM_STATE_CLOSED)

    def local_flow_control_window(self, stream_id: int) -> int:
        session = self._session
        window = lib.nghttp2_session_get_stream_remote_window_size(session, stream_id)
        if window < 0 or not self.stream_is_open(stream_id):
            raise NgStreamClosedError(f"stream {stream_id} is closed", ErrorCodes.STREAM_CLOSED)
        connection = lib.nghttp2_session_get_remote_window_size(session)
        if self._unframed:  # DATA handed over and not framed yet counts as sent
            pending = self._out.get(stream_id)
            if pending is not None:
                window -= pending.size
            connection -= self._unframed
        return int(max(0, min(window, connection)))

    def inbound_books(self) -> tuple[int, int]:
        return int(lib.nghttp2_session_get_local_window_size(self._session)), self._received - self._acknowledged

    def get_next_available_stream_id(self) -> int:
        return int(lib.nghttp2_session_get_next_stream_id(self._session))

    # -- bytes in ------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray) -> list[Any]:
        """Feed received bytes; the events they make, in order. ProtocolError after queueing the GOAWAY."""
        if self._terminated:
            return []
        evs = self._events = []
        self._runs = {}
        limit = len(data)
        error: ProtocolError | None = None
        if self.guard is not None:
            data, limit, error = self._scan.server(data)
        elif self.client_side:
            limit, error = self._scan.client(data)
        if self._scan.late:
            self._receive_answering_late(bytes(data[:limit]), limit)
        elif limit:
            if type(data) is not bytes or limit < len(data):
                data = bytes(data[:limit])
            rv = lib.nghttp2_session_mem_recv(self._session, data, limit)
            if rv < 0:
                raise self._fatal(rv)
            if self._log is not None and self._log.len:
                replay(self)
            self._events = []
        if error is not None:
            self._take()
            if lib.nghttp2_session_want_read(self._session) or not self._goaway_sent():
                self._terminate(getattr(error, "error_code", ErrorCodes.PROTOCOL_ERROR))
                raise error
            # (the library found a connection error in a frame before: its error is the connection's)
        # The library queues its GOAWAY for a connection error and goes on: take what it queued, and
        # if that ended the session, the error is the connection's.
        self._take()
        if self._overflowed:
            self._terminate(ErrorCodes.FLOW_CONTROL_ERROR)
            raise NgProtocolError(f"DATA past stream {self._overflowed}'s window", ErrorCodes.FLOW_CONTROL_ERROR)
        if not lib.nghttp2_session_want_read(self._session) and self._goaway_sent():
            self._terminated = True
            raise NgProtocolError(self._error_message or "the peer broke the protocol", self._goaway_code)
        return evs

    def _receive_answering_late(self, data: bytes, limit: int) -> None:
        """``data`` to the session in pieces cut where the scan's ``late`` says (positions in ``data``), acting there:

        - ``LATE``, at the end of a late frame (see :mod:`._scan`): its RST_STREAM(STREAM_CLOSED) is framed
          then, for the library frames its answers (a PING's ACK) ahead of what is submitted later, and
          the answers are to go out in the order of the frames they answer;
        - ``CLOSE``, at the start of a frame on a half-closed (remote) stream (RFC 9113 5.1: the stream's
          error STREAM_CLOSED, where the library fails the connection): the stream is reset there
          (:meth:`_close_half_closed`), so that the session, which closes it as the RST_STREAM is framed,
          takes the frame for a late one and ignores it (a header block decoded all the same, for the
          HPACK context; DATA counted against the connection's window and taken as consumed at once);
        - ``ANSWER``, at that frame's end: the RST_STREAM and the driver's ``StreamReset`` go out then,
          unless the frame itself was a connection error (an undecodable header block), whose GOAWAY
          goes alone, as hyper-h2, which finds those first, sends it;
        - ``SKIP``: the bytes up to the position given are not fed at all (a frame the library would
          fail the connection for, which carries nothing: a stray SETTINGS ACK).
        """
        session = self._session
        start = 0
        held: tuple[bytes, Any] | None = None
        try:
            for at, action, value in self._scan.late:
                at = min(at, limit)  # (a late frame the read cuts: answered at the read's end)
                if at > start:
                    rv = lib.nghttp2_session_mem_recv(session, data[start:at], at - start)
                    if rv < 0:
                        raise self._fatal(rv)
                    if self._log is not None and self._log.len:
                        replay(self)
                    start = at
                if action == LATE:
                    self._take()  # (a GOAWAY the library queued for the frame: the session then wants no more)
                    if lib.nghttp2_session_want_read(session):
                        check(lib.nghttp2_submit_rst_stream(session, 0, value, ErrorCodes.STREAM_CLOSED))
                        self._take()
                elif action == CLOSE:
                    held = self._close_half_closed(value)
                elif action == ANSWER:
                    self._take()  # (a GOAWAY the library queued for the frame: the session then wants no more)
                    if held is not None and lib.nghttp2_session_want_read(session):
                        self._sent += held[0]
                        self._events.append(held[1])
                        held = None
                else:  # SKIP
                    start = value
            if start < limit:
                rv = lib.nghttp2_session_mem_recv(session, data[start:], limit - start)
                if rv < 0:
                    raise self._fatal(rv)
                if self._log is not None and self._log.len:
                    replay(self)
        finally:
            self._scan.late.clear()
            self._events = []

    def _close_half_closed(self, sid: int) -> tuple[bytes, Any] | None:
        """RFC 9113 5.1: a frame other than WINDOW_UPDATE, PRIORITY or RST_STREAM on a half-closed (remote)
        stream is its stream's error STREAM_CLOSED. The session resets the stream now; what it frames for
        that, and the ``StreamReset`` (``remote_reset`` False, as hyper-h2 reports it), are returned to be
        written once the frame is in (:meth:`_receive_answering_late`)."""
        if not self.stream_is_open(sid):
            return None  # (closed since the scan: the session takes the frame for a late one)
        if sid in self._reset_reported:
            # Reset since the scan (by the driver, or by the library for a stream error earlier in the read):
            # its RST_STREAM goes now, so that the session closes the stream and takes the frame for a late one.
            self._take()
            return None
        self._take()  # (what was queued before goes out first, as in reset_stream)
        self._drop(sid)
        self._runs.pop(sid, None)
        self._reset_reported.add(sid)
        check(lib.nghttp2_submit_rst_stream(self._session, 0, sid, ErrorCodes.STREAM_CLOSED))
        out = self._sent
        mark = len(out)
        self._take()  # (the session closes the stream as it frames the RST_STREAM)
        framed = bytes(out[mark:])
        del out[mark:]
        return framed, events.StreamReset(sid, ErrorCodes.STREAM_CLOSED, remote_reset=False)

    def _fatal(self, rv: int) -> ProtocolError:
        """The library stopped (a callback failed, a flood of its own counting): GOAWAY, and the error."""
        failure = failures.pop() if failures else None
        failures.clear()
        log = self._log
        if log is not None:
            if log.overflow and self._error is None:
                self._error = h2.exceptions.DenialOfServiceError(
                    f"header block over {self._cap} bytes decoded (an HPACK bomb?)"
                )
            log.len = 0
        if self._error is not None:
            error: ProtocolError = self._error
            self._error = None
        elif isinstance(failure, ProtocolError):
            error = failure
        elif failure is not None:
            error = NgProtocolError(f"{type(failure).__name__}: {failure}", ErrorCodes.INTERNAL_ERROR)
            error.__cause__ = failure
        elif rv == -904:  # NGHTTP2_ERR_FLOODED
            error = h2.exceptions.DenialOfServiceError("too many frames to answer queued (a control-frame flood)")
        elif rv == -903:  # NGHTTP2_ERR_BAD_CLIENT_MAGIC
            error = NgProtocolError("invalid client preface")
        else:
            error = NgProtocolError(ffi.string(lib.nghttp2_strerror(rv)).decode())
        code = getattr(error, "error_code", ErrorCodes.PROTOCOL_ERROR)
        # The session is not to be used after a fatal error: the GOAWAY is written here.
        self._sent += goaway(self.highest_inbound_stream_id, code)
        self._terminated = True
        return error

    # -- bytes out -----------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """Every byte queued so far: what was taken early, then what the session frames now."""
        self._take()
        out = self._sent
        if not out:
            return b""
        data = bytes(out)
        out.clear()
        return data

    def _take(self) -> None:
        session = self._session
        pointer = _POINTER
        out = self._sent
        while True:
            n = lib.nghttp2_session_mem_send(session, pointer)
            if n <= 0:
                if n < 0:
                    raise self._fatal(n)
                break
            if self._patch_streams is not None:
                self._patch(out, ffi.buffer(pointer[0], n))
                continue
            out += ffi.buffer(pointer[0], n)
        if self._log is not None and self._log.len:
            replay(self)  # (streams closed as their last frame went)

    def _patch(self, out: bytearray, chunk: Any) -> None:
        """Our first SETTINGS frame, with the concurrent-stream limit the peer is to see (see __init__)."""
        start = len(out)
        out += chunk
        value = self._patch_streams
        self._patch_streams = None
        assert value is not None
        # The server's first frame is its SETTINGS; MAX_CONCURRENT_STREAMS is its first entry (_settings).
        if out[start + 3] == 0x4 and int.from_bytes(out[start + 9 : start + 11]) == SETTINGS_MAX_CONCURRENT_STREAMS:
            out[start + 11 : start + 15] = value.to_bytes(4)

    def initiate_connection(self) -> None:
        settings = self._settings
        if self._patch_streams is not None:
            settings = [(SETTINGS_MAX_CONCURRENT_STREAMS, _NO_STREAMS_LIMIT)] + [
                (key, value) for key, value in settings if key != SETTINGS_MAX_CONCURRENT_STREAMS
            ]
        iv = ffi.new("nghttp2_settings_entry[]", settings)
        check(lib.nghttp2_submit_settings(self._session, 0, iv, len(settings)))

    def increment_flow_control_window(self, increment: int) -> None:
        check(lib.nghttp2_submit_window_update(self._session, 0, 0, increment))

    def send_headers(self, stream_id: int, headers: Any, end_stream: bool = False) -> None:
        """A head (opening the stream on a client) or, on a stream with a head, trailers."""
        if self._terminated:
            raise NgProtocolError("the connection is closed")
        session = self._session
        out = self._out.get(stream_id)
        if out is not None:
            nva, keep = nv_array(headers)
            # Trailers after DATA the session has not framed yet: they go after it, with its END_STREAM.
            if not end_stream:
                raise NgProtocolError("trailers must end the stream")
            out.trailers = (nva, keep, len(headers))
            out.end = True
            if out.deferred:
                out.deferred = False
                check(lib.nghttp2_session_resume_data(session, stream_id))
            return
        flags = END_STREAM if end_stream else 0
        if self.client_side and stream_id >= lib.nghttp2_session_get_next_stream_id(session):
            opened = submit_headers(session, flags, -1, headers)
            check(opened)
            if opened != stream_id:
                raise NgProtocolError(f"stream {stream_id} is not the next one ({opened})")
            self._opened.add(stream_id)
            self._take()  # (the session opens the stream as it frames the HEADERS: DATA may follow now)
            return
        if not self.stream_is_open(stream_id):
            raise NgStreamClosedError(f"stream {stream_id} is closed", ErrorCodes.STREAM_CLOSED)
        if lib.nghttp2_session_get_stream_local_close(session, stream_id):
            raise NgProtocolError(f"stream {stream_id} has ended")  # (the library would send them)
        check(submit_headers(session, flags, stream_id, headers))

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """DATA on ``stream_id``, within its send windows (the driver checks them); framed at the next take."""
        out = self._out.get(stream_id)
        if out is None:
            if not self.stream_is_open(stream_id):
                raise NgStreamClosedError(f"stream {stream_id} is closed", ErrorCodes.STREAM_CLOSED)
            if lib.nghttp2_session_get_stream_local_close(self._session, stream_id):
                raise NgProtocolError(f"stream {stream_id} has ended")  # (as hyper-h2's state machine says it)
            out = self._out[stream_id] = _Out()
            out.chunks.append(data)
            out.size = len(data)
            self._unframed += len(data)
            out.end = end_stream
            # END_STREAM goes with the source's end, unless trailers follow (_read says so then).
            check(lib.nghttp2_submit_data(self._session, END_STREAM, stream_id, self._provider))
            return
        if out.end:
            raise NgStreamClosedError(f"stream {stream_id} has ended", ErrorCodes.STREAM_CLOSED)
        if data:
            out.chunks.append(data)
            out.size += len(data)
            self._unframed += len(data)
        out.end = end_stream
        if out.deferred:
            out.deferred = False
            check(lib.nghttp2_session_resume_data(self._session, stream_id))

    def end_stream(self, stream_id: int) -> None:
        self.send_data(stream_id, b"", end_stream=True)

    def reset_stream(self, stream_id: int, error_code: int = 0) -> None:
        if self._terminated or not self.stream_is_open(stream_id):
            raise NgStreamClosedError(f"stream {stream_id} is closed", ErrorCodes.STREAM_CLOSED)
        # What was given for the stream before goes out before the reset (the session would send a
        # queued RST_STREAM ahead of the stream's HEADERS and drop its DATA).
        self._take()
        self._drop(stream_id)
        check(lib.nghttp2_submit_rst_stream(self._session, 0, stream_id, int(error_code)))
        self._reset_reported.add(stream_id)

    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None:
        if acknowledged_size <= 0 or self._terminated:
            return
        self._acknowledged += acknowledged_size
        if self._padding:
            padding = self._padding.pop(stream_id, 0)
            if padding:
                if padding > acknowledged_size:
                    self._padding[stream_id] = padding - acknowledged_size
                acknowledged_size -= min(padding, acknowledged_size)
                if not acknowledged_size:
                    return
        check(lib.nghttp2_session_consume(self._session, stream_id, acknowledged_size))

    def close_connection(self, error_code: int = 0, *, last_stream_id: int | None = None) -> None:
        if self._terminated:
            raise NgProtocolError("the connection is already closed")
        self._terminated = True
        last = self.highest_inbound_stream_id if last_stream_id is None else last_stream_id
        check(lib.nghttp2_session_terminate_session2(self._session, last, int(error_code)))

    def _terminate(self, error_code: int) -> None:
        if not self._terminated:
            self.close_connection(error_code)

    def goaway_frame(self, last_stream_id: int) -> bytes:
        return goaway(last_stream_id, 0)

    def reopen_after_goaway(self) -> None:
        """Nothing to put back: the session lets the streams under a GOAWAY's last id finish."""

    def control_frame(self) -> None:
        if self.guard is not None:
            self.guard.control_frame()

    def _goaway_sent(self) -> bool:
        """Whether what the session queued so far holds a GOAWAY of ours; its code in ``_goaway_code``."""
        out = self._sent
        pos = 0
        found = False
        size = len(out)
        if size >= 24 and out[:3] == b"PRI":
            pos = 24
        while pos + 9 <= size:
            length = int.from_bytes(out[pos : pos + 3])
            if out[pos + 3] == 0x7 and pos + 17 <= size:
                self._goaway_code = wire_code(int.from_bytes(out[pos + 13 : pos + 17]))
                found = True
            pos += 9 + length
        return found

    # -- callbacks (recording only: see the module docstring) -------------------------------

    def _settings_received(self, settings: list[tuple[int, int]]) -> None:
        """RFC 9113 6.9.2: a new SETTINGS_INITIAL_WINDOW_SIZE that takes a stream's send window past
        2^31-1 is a connection error FLOW_CONTROL_ERROR (the library resets those streams instead).

        The library has applied the change to every stream it did not overflow: a window now past the
        maximum minus the change is one it left as it was (or, for an increase close to the maximum
        twice over, one it raised: a connection error either way, at a window no peer reaches).
        """
        for key, value in settings:
            if key != SETTINGS_INITIAL_WINDOW_SIZE:
                continue
            delta = value - self._peer_window
            self._peer_window = value
            if delta <= 0:
                continue
            for sid in list(self._heads) + list(self._out):
                window = lib.nghttp2_session_get_stream_remote_window_size(self._session, sid)
                if window + delta > _MAX_WINDOW:
                    self._error = NgProtocolError(
                        f"SETTINGS_INITIAL_WINDOW_SIZE {value} takes stream {sid}'s window past 2^31-1",
                        ErrorCodes.FLOW_CONTROL_ERROR,
                    )
                    raise self._error

    def _on_stream_close(self, stream_id: int, error_code: int) -> None:
        by_reset = stream_id in self._reset_reported
        self._closed_streams[stream_id] = by_reset
        if error_code == ErrorCodes.FLOW_CONTROL_ERROR and not by_reset:
            # The library resets a stream that overflowed its window, without a word: hyper-h2 fails
            # the connection (RFC 9113 6.9.1 allows either), and so does the codec (receive_data).
            self._overflowed = stream_id
        self._heads.discard(stream_id)
        self._opened.discard(stream_id)
        self._reset_reported.discard(stream_id)
        self._scan.peer_ended.discard(stream_id)
        self._drop(stream_id)

    def _drop(self, stream_id: int) -> None:
        out = self._out.pop(stream_id, None)
        if out is not None:
            self._unframed -= out.size

    def _read(self, stream_id: int, buf: Any, length: int, flags: Any) -> int:
        out = self._out.get(stream_id)
        if out is None:
            flags[0] |= DATA_EOF
            return 0
        chunks = out.chunks
        written = 0
        while chunks and written < length:
            chunk = chunks[0]
            room = length - written
            if len(chunk) <= room:
                ffi.memmove(buf + written, chunk, len(chunk))
                written += len(chunk)
                chunks.popleft()
            else:
                ffi.memmove(buf + written, chunk[:room], room)
                chunks[0] = chunk[room:]
                written += room
        out.size -= written
        self._unframed -= written
        if not chunks:
            if not out.end:
                if not written:
                    out.deferred = True
                    return DEFERRED
                return written
            del self._out[stream_id]
            flags[0] |= DATA_EOF
            if out.trailers is not None:
                flags[0] |= DATA_NO_END_STREAM
                nva, _keep, count = out.trailers
                check(lib.nghttp2_submit_trailer(self._session, stream_id, nva, count))
        return written


class _RemoteSettings:
    """The peer's settings, as far as the drivers read them."""

    __slots__ = ("_session",)

    def __init__(self, session: Any) -> None:
        self._session = session

    @property
    def max_concurrent_streams(self) -> int:
        return int(lib.nghttp2_session_get_remote_settings(self._session, SETTINGS_MAX_CONCURRENT_STREAMS))

    @property
    def enable_connect_protocol(self) -> int:
        return int(lib.nghttp2_session_get_remote_settings(self._session, SETTINGS_ENABLE_CONNECT_PROTOCOL))
