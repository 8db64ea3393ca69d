"""The nghttp2 codec: :class:`NgCodec`, one libnghttp2 session behind the :class:`~blocks.transport._codec.Codec`
contract, and the callbacks that turn what the library parses into the contract's events.

Rules this module keeps, which the library does not enforce:

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
import struct
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import h2.exceptions
import hpack

from blocks.transport._codec import (
    CLOSED_STREAMS,
    ClosedStreams,
    ErrorCodes,
    EventKind,
    GuardedFrameBuffer,
    ProtocolError,
)
from blocks.transport._nghttp2 import _events as events
from blocks.transport._nghttp2 import _shim
from blocks.transport._nghttp2._ffi import load

_loaded = _shim.load()
SHIM_REASON = _loaded if isinstance(_loaded, str) else ""
"""Why the C shim is not in use (empty when it is): the codec then runs in cffi's ABI mode."""
if isinstance(_loaded, str):
    _loaded = load()
    if isinstance(_loaded, str):
        raise ImportError(_loaded)  # noqa: TRY004 (what a missing library is to the importer)
ffi, lib = _loaded
SHIM = not SHIM_REASON
MODE = "shim" if SHIM else "abi"
"""How the codec reaches the library: ``"shim"`` (cffi's API mode, the callbacks in C) or ``"abi"``."""

_CALLBACK_FAILURE = -902  # NGHTTP2_ERR_CALLBACK_FAILURE
_DEFERRED = -508  # NGHTTP2_ERR_DEFERRED
_DATA_EOF = 0x1
_DATA_NO_END_STREAM = 0x2
_END_STREAM = 0x1
_NO_INDEX = 0x1  # NGHTTP2_NV_FLAG_NO_INDEX
_STREAM_STATE_CLOSED = 7  # NGHTTP2_STREAM_STATE_CLOSED
_CALM = ErrorCodes.ENHANCE_YOUR_CALM
_SETTINGS_MAX_FRAME_SIZE = 5
_SETTINGS_INITIAL_WINDOW_SIZE = 4
_MAX_WINDOW = 2**31 - 1
_SETTINGS_MAX_CONCURRENT_STREAMS = 3
_SETTINGS_ENABLE_CONNECT_PROTOCOL = 8
_NO_STREAMS_LIMIT = 2**31 - 1
_NO_ACK_LIMIT = 2**31 - 1
_LATE, _CLOSE, _ANSWER, _SKIP = range(4)  # what _receive_answering_late does where _late says
_WITHHELD_MORE = 65536  # (a frame or header block withheld (_scan) is at most this past the header-list cap)
_MAX_CONTINUATIONS = 63  # (the guard's MAX_CONTINUATIONS, for a client, where the library has the option)


class NgProtocolError(h2.exceptions.ProtocolError):
    """A protocol error the nghttp2 codec found or was asked about: ``error_code`` is what its GOAWAY says."""

    def __init__(self, message: str, error_code: int = ErrorCodes.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.error_code = cast(ErrorCodes, error_code)  # (a code the RFC does not name stays an int)


class NgStreamClosedError(NgProtocolError):
    """A call about a stream the session does not have open (h2's ``StreamClosedError``)."""


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
    }
    name = "nghttp2"

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
            self._patch_streams = dict(settings).get(_SETTINGS_MAX_CONCURRENT_STREAMS)
        self._events: list[Any] = []
        self._error: ProtocolError | None = None  # a connection error a callback found (then it fails)
        self._error_message = ""
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
        # (guard) bytes of the frame being scanned still to come: first, the client's preface
        self._scan_skip = 0 if client_side else 24
        # a frame header cut by the end of a read (on a server, with what follows it: withheld from the library)
        self._scan_head = b""
        self._scan_last = 0  # (guard) the highest stream the client opened
        self._scan_new: set[int] = set()  # (guard) the streams opened in the read being scanned
        self._peer_reset = ClosedStreams(CLOSED_STREAMS)  # (guard) streams the client reset
        # streams closed, remembered as h2 does (its name, its bound): True for one closed by a reset
        self._closed_streams = ClosedStreams(CLOSED_STREAMS)
        self._peer_ended: set[int] = set()  # (guard) open streams the client ended: half-closed (remote)
        self._acks_due = 0 if client_side else 1  # (guard) SETTINGS ACKs due: for our one SETTINGS frame
        # what to do where in the read (a position, an action, a stream or, for _SKIP, where the cut ends):
        # answer a late frame (at its end), reset a half-closed (remote) stream (at its frame's start) and
        # write the answer (at its end), cut a frame out (_receive_answering_late)
        self._late: list[tuple[int, int, int]] = []
        self._peer_window = 65535  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self._handle = ffi.new_handle(self)
        self._provider = ffi.new("nghttp2_data_provider *")  # (its source: this codec, for _read)
        self._provider.source.ptr = self._handle
        self._provider.read_callback = _READ
        self._log: Any = None
        user_data = self._handle
        if SHIM:
            self._log = user_data = ffi.gc(lib.pb_log_new(header_list_cap), lib.pb_log_del)
        option = ffi.new("nghttp2_option **")
        _check(lib.nghttp2_option_new(option))
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
        _check(new(session, _CALLBACKS, user_data, opt))
        self._session = ffi.gc(session[0], lib.nghttp2_session_del)

    def __repr__(self) -> str:
        return f"<NgCodec {'client' if self.client_side else 'server'} streams={len(self._heads)}>"

    # -- the contract's reading ------------------------------------------------------

    @property
    def max_outbound_frame_size(self) -> int:
        return int(lib.nghttp2_session_get_remote_settings(self._session, _SETTINGS_MAX_FRAME_SIZE))

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
        return bool(stream != ffi.NULL and lib.nghttp2_stream_get_state(stream) != _STREAM_STATE_CLOSED)

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
            data, limit, error = self._scan(data)
        elif self.client_side:
            limit, error = self._scan_late(data)
        if self._late:
            self._receive_answering_late(bytes(data[:limit]), limit)
        elif limit:
            if type(data) is not bytes or limit < len(data):
                data = bytes(data[:limit])
            rv = lib.nghttp2_session_mem_recv(self._session, data, limit)
            if rv < 0:
                raise self._fatal(rv)
            if self._log is not None and self._log.len:
                self._replay()
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
        """``data`` to the session in pieces cut where ``_late`` says (positions in ``data``), acting there:

        - ``_LATE``, at the end of a late frame (``_scan_stream``): its RST_STREAM(STREAM_CLOSED) is framed
          then, for the library frames its answers (a PING's ACK) ahead of what is submitted later, and
          the answers are to go out in the order of the frames they answer;
        - ``_CLOSE``, at the start of a frame on a half-closed (remote) stream (RFC 9113 5.1: the stream's
          error STREAM_CLOSED, where the library fails the connection): the stream is reset there
          (:meth:`_close_half_closed`), so that the session, which closes it as the RST_STREAM is framed,
          takes the frame for a late one and ignores it (a header block decoded all the same, for the
          HPACK context; DATA counted against the connection's window and taken as consumed at once);
        - ``_ANSWER``, at that frame's end: the RST_STREAM and the driver's ``StreamReset`` go out then,
          unless the frame itself was a connection error (an undecodable header block), whose GOAWAY
          goes alone, as hyper-h2, which finds those first, sends it;
        - ``_SKIP``: the bytes up to the position given are not fed at all (a frame the library would
          fail the connection for, which carries nothing: :meth:`_scan`).
        """
        session = self._session
        start = 0
        held: tuple[bytes, Any] | None = None
        try:
            for at, action, value in self._late:
                at = min(at, limit)  # (a late frame the read cuts: answered at the read's end)
                if at > start:
                    rv = lib.nghttp2_session_mem_recv(session, data[start:at], at - start)
                    if rv < 0:
                        raise self._fatal(rv)
                    if self._log is not None and self._log.len:
                        self._replay()
                    start = at
                if action == _LATE:
                    self._take()  # (a GOAWAY the library queued for the frame: the session then wants no more)
                    if lib.nghttp2_session_want_read(session):
                        _check(lib.nghttp2_submit_rst_stream(session, 0, value, ErrorCodes.STREAM_CLOSED))
                        self._take()
                elif action == _CLOSE:
                    held = self._close_half_closed(value)
                elif action == _ANSWER:
                    self._take()  # (a GOAWAY the library queued for the frame: the session then wants no more)
                    if held is not None and lib.nghttp2_session_want_read(session):
                        self._sent += held[0]
                        self._events.append(held[1])
                        held = None
                else:  # _SKIP
                    start = value
            if start < limit:
                rv = lib.nghttp2_session_mem_recv(session, data[start:], limit - start)
                if rv < 0:
                    raise self._fatal(rv)
                if self._log is not None and self._log.len:
                    self._replay()
        finally:
            self._late.clear()
            self._events = []

    def _close_half_closed(self, sid: int) -> tuple[bytes, Any] | None:
        """RFC 9113 5.1: a frame other than WINDOW_UPDATE, PRIORITY or RST_STREAM on a half-closed (remote)
        stream is its stream's error STREAM_CLOSED. The session resets the stream now; what it frames for
        that, and the ``StreamReset`` (``remote_reset`` False, as hyper-h2 reports it), are returned to be
        written once the frame is in (:meth:`_receive_answering_late`)."""
        if not self.stream_is_open(sid) or sid in self._reset_reported:
            return None  # (closed or reset since the scan: the session takes the frame for a late one)
        self._take()  # (what was queued before goes out first, as in reset_stream)
        self._drop(sid)
        self._runs.pop(sid, None)
        self._reset_reported.add(sid)
        _check(lib.nghttp2_submit_rst_stream(self._session, 0, sid, ErrorCodes.STREAM_CLOSED))
        out = self._sent
        mark = len(out)
        self._take()  # (the session closes the stream as it frames the RST_STREAM)
        framed = bytes(out[mark:])
        del out[mark:]
        return framed, events.StreamReset(sid, ErrorCodes.STREAM_CLOSED, remote_reset=False)

    def _fatal(self, rv: int) -> ProtocolError:
        """The library stopped (a callback failed, a flood of its own counting): GOAWAY, and the error."""
        failure = _failures.pop() if _failures else None
        _failures.clear()
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
        self._sent += _goaway(self.highest_inbound_stream_id, code)
        self._terminated = True
        return error

    def _scan(self, data: bytes | bytearray) -> tuple[bytes | bytearray, int, ProtocolError | None]:
        """The guard's limits and :meth:`_scan_stream`'s rules over the frames in ``data`` (a server's):
        the bytes to feed (a frame withheld from the read before first, see below), how many of them may
        go to the session (actions where ``_late`` says), and the error of the first frame past a limit.

        A frame header cut by the end of a read is withheld from the session until it is whole, and so
        is DATA or a header block on a stream already opened and not open for it (half-closed (remote),
        reset by the client, closed) until its end is in: it is answered (and the driver told) in the
        read that completes it, as hyper-h2, which acts on whole frames and header blocks, answers it.
        A SETTINGS ACK with none due (RFC 9113 6.5.3 makes it no error; the library fails the
        connection) is cut out."""
        guard = self.guard
        assert guard is not None
        head = self._scan_head
        if head:
            data = head + data
            self._scan_head = b""
        size = len(data)
        if not self._scan_skip:  # (a HEADERS cut by a read opens its stream at the library once it is in)
            self._scan_new.clear()
        pos = min(self._scan_skip, size)
        self._scan_skip -= pos
        unpack = _unpack_head
        heads = self._heads
        peer_reset = self._peer_reset
        ended = self._peer_ended
        new = self._scan_new
        while pos + 9 <= size:
            high, low, kind, flags, sid = unpack(data, pos)
            length = high << 16 | low
            end = pos + 9 + length
            interrupted = False
            if (
                kind <= 1
                and sid <= self._scan_last
                and ((sid not in heads and sid not in new) or sid in ended or sid in peer_reset)
            ):
                end, interrupted = _whole(data, sid, size, kind, flags, end)
                if end < 0:
                    if size - pos > self._cap + _WITHHELD_MORE or length > self._max_frame:
                        end = pos + 9 + length  # (past any header block the guard lets through: as it comes)
                    else:
                        self._scan_head = bytes(data[pos:])
                        return data, pos, None
            ends = False
            carried = 0
            if kind <= 1 or kind == 9:
                carried = length
                if flags & 0x8 and kind != 9 and pos + 9 < size:  # PADDED (its length, when in)
                    carried -= 1 + data[pos + 9]
                if kind == 1 and flags & 0x20:  # PRIORITY
                    carried -= 5
                ends = bool((kind != 9 and flags & 0x1) or (kind and flags & 0x4))
            try:
                guard.check(kind, max(carried, 0), ends, bool(flags & 0x1) if kind == 4 else False)
                if interrupted:  # (RFC 9113 6.10, found first, as hyper-h2 finds it before the stream's state)
                    raise NgProtocolError(f"a frame inside the header block of stream {sid & 0x7FFFFFFF}")
                if kind <= 3 and (kind or flags & 0x1 or sid not in heads or sid in peer_reset or sid in ended):
                    # (not DATA on an open stream, short of its last)
                    self._scan_stream(kind, flags, sid & 0x7FFFFFFF, pos, end, length, carried)
                elif kind == 4 and flags & 0x1 and not length and not sid:  # a SETTINGS ACK
                    if self._acks_due:
                        self._acks_due -= 1
                    else:
                        self._late.append((pos, _SKIP, pos + 9))
            except ProtocolError as exc:
                return data, pos, exc
            pos += 9 + length
        if pos > size:
            self._scan_skip = pos - size
            return data, size, None
        self._scan_head = bytes(data[pos:])
        return data, pos, None

    @property
    def _max_frame(self) -> int:
        """The largest frame we take (a larger one is the library's connection error)."""
        return int(lib.nghttp2_session_get_local_settings(self._session, _SETTINGS_MAX_FRAME_SIZE))

    def _scan_stream(self, kind: int, flags: int, sid: int, start: int, end: int, length: int, carried: int) -> None:
        """What the library is lax or strict about, from a frame's header, answered as hyper-h2 answers
        it: RFC 9113 5.1.1 (a new stream's id above every one opened: else a connection error) and 5.1
        (a frame after the peer's RST_STREAM, DATA or HEADERS on a closed stream: the stream's error
        STREAM_CLOSED, HEADERS on a stream the peer had ended: the connection's; the library ignores
        them all; DATA or HEADERS on a half-closed (remote) stream: the stream's error STREAM_CLOSED,
        where the library fails the connection)."""
        if kind == 3:  # RST_STREAM
            self._peer_reset[sid] = True
            self._peer_ended.discard(sid)
            return
        if flags & 0x8 and carried < 0 and kind <= 1:  # (a connection error, found by hyper-h2 as it parses)
            raise NgProtocolError(f"padding past the end of a frame on stream {sid}")
        if kind == 2:  # PRIORITY: allowed on any stream
            return
        if sid in self._peer_reset:
            self._late.append((end, _LATE, sid))
            return
        if not sid & 1:
            return
        if sid > self._scan_last:
            if kind == 1:
                self._scan_last = sid
                self._scan_new.add(sid)
                if flags & _END_STREAM:
                    self._peer_ended.add(sid)
            return  # (DATA on an idle stream: the library's connection error)
        if sid in self._heads or sid in self._scan_new:  # open (the common case, DATA on a stream whose request came)
            if sid in self._peer_ended:
                if length > self._max_frame:
                    return  # (the library's connection error FRAME_SIZE_ERROR, as hyper-h2's)
                self._peer_ended.discard(sid)
                self._peer_reset[sid] = True  # (reset where the frame starts: a later frame is a late one)
                self._late += ((start, _CLOSE, sid), (end, _ANSWER, sid))
            elif flags & _END_STREAM:
                self._peer_ended.add(sid)
            return
        if lib.nghttp2_session_find_stream(self._session, sid) != ffi.NULL:
            return
        closed = self._closed_streams
        by_reset = closed.get(sid)
        if by_reset is None:
            if kind == 1 and sid > closed.forgotten[1]:
                raise NgProtocolError(f"stream {sid} opened after stream {self._scan_last}")
            by_reset = True  # forgotten: taken for one we reset
        if kind == 1 and not by_reset:
            raise NgProtocolError(f"HEADERS on stream {sid}, which the client ended", ErrorCodes.STREAM_CLOSED)
        self._late.append((end, _LATE, sid))

    def _scan_late(self, data: bytes | bytearray) -> tuple[int, ProtocolError | None]:
        """A client's scan of the frame headers in ``data``: DATA or HEADERS on a stream it closed and the
        library forgot (RFC 9113 5.1: the server sent them before our RST_STREAM reached it) is answered
        with RST_STREAM(STREAM_CLOSED), as hyper-h2 answers it; the library would ignore it. Only a
        HEADERS frame that opens no known response costs more than the loop."""
        head = self._scan_head
        if head:
            data = head + data
        size = len(data)
        pos = min(self._scan_skip, size)
        self._scan_skip -= pos
        heads = self._heads
        opened = self._opened
        unpack = _unpack_head
        while pos + 9 <= size:
            high, low, kind, _, sid = unpack(data, pos)
            length = high << 16 | low
            if kind <= 1 and sid not in heads and sid not in opened:
                try:
                    self._late_on_client(kind, sid & 0x7FFFFFFF, pos + 9 + length - len(head))
                except ProtocolError as exc:
                    self._scan_head = b""
                    return max(pos - len(head), 0), exc
            pos += 9 + length
        if pos > size:
            self._scan_skip = pos - size
            self._scan_head = b""
        else:
            self._scan_head = bytes(data[pos:])
        return size - len(head), None

    def _late_on_client(self, kind: int, sid: int, end: int) -> None:
        closed = self._closed_streams
        by_reset = closed.get(sid)
        if by_reset is None:
            if not sid & 1 or sid > closed.forgotten[1]:
                return  # (on a stream never opened: the library's to answer)
            by_reset = True  # (a forgotten stream is taken for one we reset)
        if kind == 1 and not by_reset:
            # (h2's answer, a connection error: the library's would be to ignore the frame)
            raise NgProtocolError(f"HEADERS on stream {sid}, which has ended", ErrorCodes.STREAM_CLOSED)
        self._late.append((end, _LATE, sid))

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
            self._replay()  # (streams closed as their last frame went)

    def _patch(self, out: bytearray, chunk: Any) -> None:
        """Our first SETTINGS frame, with the concurrent-stream limit the peer is to see (see __init__)."""
        start = len(out)
        out += chunk
        value = self._patch_streams
        self._patch_streams = None
        assert value is not None
        # The server's first frame is its SETTINGS; MAX_CONCURRENT_STREAMS is its first entry (_settings).
        if out[start + 3] == 0x4 and int.from_bytes(out[start + 9 : start + 11]) == _SETTINGS_MAX_CONCURRENT_STREAMS:
            out[start + 11 : start + 15] = value.to_bytes(4)

    def initiate_connection(self) -> None:
        settings = self._settings
        if self._patch_streams is not None:
            settings = [(_SETTINGS_MAX_CONCURRENT_STREAMS, _NO_STREAMS_LIMIT)] + [
                (key, value) for key, value in settings if key != _SETTINGS_MAX_CONCURRENT_STREAMS
            ]
        iv = ffi.new("nghttp2_settings_entry[]", settings)
        _check(lib.nghttp2_submit_settings(self._session, 0, iv, len(settings)))

    def increment_flow_control_window(self, increment: int) -> None:
        _check(lib.nghttp2_submit_window_update(self._session, 0, 0, increment))

    def send_headers(self, stream_id: int, headers: Any, end_stream: bool = False) -> None:
        """A head (opening the stream on a client) or, on a stream with a head, trailers."""
        if self._terminated:
            raise NgProtocolError("the connection is closed")
        session = self._session
        out = self._out.get(stream_id)
        if out is not None:
            nva, keep = _nv_array(headers)
            # Trailers after DATA the session has not framed yet: they go after it, with its END_STREAM.
            if not end_stream:
                raise NgProtocolError("trailers must end the stream")
            out.trailers = (nva, keep, len(headers))
            out.end = True
            if out.deferred:
                out.deferred = False
                _check(lib.nghttp2_session_resume_data(session, stream_id))
            return
        flags = _END_STREAM if end_stream else 0
        if self.client_side and stream_id >= lib.nghttp2_session_get_next_stream_id(session):
            opened = _submit_headers(session, flags, -1, headers)
            _check(opened)
            if opened != stream_id:
                raise NgProtocolError(f"stream {stream_id} is not the next one ({opened})")
            self._opened.add(stream_id)
            self._take()  # (the session opens the stream as it frames the HEADERS: DATA may follow now)
            return
        if not self.stream_is_open(stream_id):
            raise NgStreamClosedError(f"stream {stream_id} is closed", ErrorCodes.STREAM_CLOSED)
        _check(_submit_headers(session, flags, stream_id, headers))

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
            _check(lib.nghttp2_submit_data(self._session, _END_STREAM, stream_id, self._provider))
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
            _check(lib.nghttp2_session_resume_data(self._session, stream_id))

    def end_stream(self, stream_id: int) -> None:
        self.send_data(stream_id, b"", end_stream=True)

    def reset_stream(self, stream_id: int, error_code: int = 0) -> None:
        if self._terminated or not self.stream_is_open(stream_id):
            raise NgStreamClosedError(f"stream {stream_id} is closed", ErrorCodes.STREAM_CLOSED)
        # What was given for the stream before goes out before the reset (the session would send a
        # queued RST_STREAM ahead of the stream's HEADERS and drop its DATA).
        self._take()
        self._drop(stream_id)
        _check(lib.nghttp2_submit_rst_stream(self._session, 0, stream_id, int(error_code)))
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
        _check(lib.nghttp2_session_consume(self._session, stream_id, acknowledged_size))

    def close_connection(self, error_code: int = 0, *, last_stream_id: int | None = None) -> None:
        if self._terminated:
            raise NgProtocolError("the connection is already closed")
        self._terminated = True
        last = self.highest_inbound_stream_id if last_stream_id is None else last_stream_id
        _check(lib.nghttp2_session_terminate_session2(self._session, last, int(error_code)))

    def _terminate(self, error_code: int) -> None:
        if not self._terminated:
            self.close_connection(error_code)

    def goaway_frame(self, last_stream_id: int) -> bytes:
        return _goaway(last_stream_id, 0)

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
                self._goaway_code = _code(int.from_bytes(out[pos + 13 : pos + 17]))
                found = True
            pos += 9 + length
        return found

    _goaway_code: int = ErrorCodes.PROTOCOL_ERROR

    # -- callbacks (recording only: see the module docstring) -------------------------------

    def _frame(self, kind: int, flags: int, sid: int, flow: int, a: int, b: int, extra: Any) -> None:
        """A frame received, as the library reports it (see :mod:`._shim` for ``a``, ``b``, ``extra``)."""
        evs = self._events
        if kind == 0:  # DATA
            chunks = self._chunks
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            if len(data) != flow:
                # Padded, or behind the chunks of a frame the library dropped without a word (its stream
                # closed while the frame was coming in): this frame's own bytes are the last ones.
                padding = a
                data = data[len(data) - (flow - padding) :]
                if padding:
                    # (the library gives padding back itself: the driver's acknowledgement of it is not
                    # passed on, see acknowledge_received_data)
                    self._padding[sid] = self._padding.get(sid, 0) + padding
            ended = True if flags & _END_STREAM else None
            self._received += flow
            run = self._runs.get(sid)
            if run is not None:  # (the stream's DATA of this read so far, and none of its other events)
                run.data += data
                run.flow_controlled_length += flow
                run.stream_ended = ended
            else:
                run = self._runs[sid] = events.DataReceived(sid, data, flow, ended)
                evs.append(run)
            if ended:
                del self._runs[sid]
                evs.append(events.StreamEnded(sid))
        elif kind == 1:  # HEADERS
            if self._runs:
                self._runs.pop(sid, None)
            block = self._block if self._block_size else []
            self._block = []
            self._block_size = 0
            ended = True if flags & _END_STREAM else None
            heads = self._heads
            if sid in heads:
                evs.append(events.TrailersReceived(sid, block, ended))
            elif self.client_side:
                status = block[0][1] if block and block[0][0] == b":status" else b""
                if status[:1] == b"1" and len(status) == 3:
                    if ended:  # (an informational response may not end the stream: the stream's error)
                        evs.append(events.ResponseReceived(sid, block, ended))
                        evs.append(events.StreamEnded(sid))
                        heads.add(sid)
                    return  # informational: the final head is still to come
                heads.add(sid)
                evs.append(events.ResponseReceived(sid, block, ended))
            else:
                heads.add(sid)
                if sid > self._highest_inbound:
                    self._highest_inbound = sid
                evs.append(events.RequestReceived(sid, block, ended))
            if ended:
                evs.append(events.StreamEnded(sid))
        elif kind == 3:  # RST_STREAM
            if sid not in self._heads and sid not in self._opened:
                return  # (on a stream closed: the library reports it all the same)
            self._runs.pop(sid, None)
            self._reset_reported.add(sid)
            evs.append(events.StreamReset(sid, _code(a)))
        elif kind == 8:  # WINDOW_UPDATE
            if self._runs:
                self._runs.pop(sid, None)
            evs.append(events.WindowUpdated(sid, a))
        elif kind == 4:  # SETTINGS
            if not flags & 0x1:
                self._settings_received(extra)
                evs.append(events.RemoteSettingsChanged())
        elif kind == 7:  # GOAWAY
            evs.append(events.ConnectionTerminated(_code(b), a, extra))

    def _replay(self) -> None:
        """What the shim recorded (see :mod:`._shim`), in order, as the ABI-mode callbacks report it."""
        log = self._log
        view = ffi.buffer(log.buf, log.len)
        size = log.len
        log.len = 0
        unpack = _unpack_from
        pos = 0
        try:
            while pos < size:
                tag = view[pos]
                if tag == b"B":
                    count, total = unpack("=II", view, pos + 1)
                    lengths = unpack(f"={2 * count}I", view, pos + 9)
                    start = pos + 9 + 8 * count
                    pos = start + total
                    blob = view[start:pos]
                    block = []
                    at = 0
                    for i in range(0, 2 * count, 2):
                        middle = at + lengths[i]
                        end = middle + lengths[i + 1]
                        block.append((blob[at:middle], blob[middle:end]))
                        at = end
                    self._block = block
                    self._block_size = 1 if block else 0  # (only whether there is one is read)
                elif tag == b"F":
                    kind, flags, sid, length, a, b = unpack("=BBiIII", view, pos + 1)
                    pos += 19
                    extra: Any = None
                    if kind == 7:
                        (count,) = unpack("=I", view, pos)
                        extra = view[pos + 4 : pos + 4 + count]
                        pos += 4 + count
                    elif kind == 4:
                        pairs = unpack(f"={2 * a}I", view, pos)
                        extra = list(zip(pairs[::2], pairs[1::2], strict=True))
                        pos += 8 * a
                    self._frame(kind, flags, sid, length, a, b, extra)
                elif tag == b"D":
                    _sid, length = unpack("=iI", view, pos + 1)
                    self._chunks.append(view[pos + 9 : pos + 9 + length])
                    pos += 9 + length
                elif tag == b"C":
                    sid, code = unpack("=iI", view, pos + 1)
                    pos += 9
                    self._on_stream_close(sid, code)
                elif tag == b"I":
                    sid, lib_error = unpack("=ii", view, pos + 1)
                    pos += 9
                    self._invalid(sid, lib_error)
                else:  # E
                    (length,) = unpack("=I", view, pos + 1)
                    self._error_message = view[pos + 5 : pos + 5 + length].decode(errors="replace")
                    pos += 5 + length
        except ProtocolError as exc:  # (a connection error found in a frame: the library went on past it)
            self._error = exc
            raise self._fatal(_CALLBACK_FAILURE) from None

    def _invalid(self, sid: int, lib_error: int) -> None:
        self._error_message = ffi.string(lib.nghttp2_strerror(lib_error)).decode()
        self._block = []  # (a header block cut short)
        self._block_size = 0
        if sid and sid in self._heads and sid not in self._reset_reported:
            # The session resets the stream itself (a stream error): the driver hears of it once.
            self._reset_reported.add(sid)
            self._runs.pop(sid, None)
            self._events.append(events.StreamReset(sid, _stream_error_code(lib_error), remote_reset=False))

    def _settings_received(self, settings: list[tuple[int, int]]) -> None:
        """RFC 9113 6.9.2: a new SETTINGS_INITIAL_WINDOW_SIZE that takes a stream's send window past
        2^31-1 is a connection error FLOW_CONTROL_ERROR (the library resets those streams instead).

        The library has applied the change to every stream it did not overflow: a window now past the
        maximum minus the change is one it left as it was (or, for an increase close to the maximum
        twice over, one it raised: a connection error either way, at a window no peer reaches).
        """
        for key, value in settings:
            if key != _SETTINGS_INITIAL_WINDOW_SIZE:
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
        self._peer_ended.discard(stream_id)
        self._drop(stream_id)

    def _drop(self, stream_id: int) -> None:
        out = self._out.pop(stream_id, None)
        if out is not None:
            self._unframed -= out.size

    def _read(self, stream_id: int, buf: Any, length: int, flags: Any) -> int:
        out = self._out.get(stream_id)
        if out is None:
            flags[0] |= _DATA_EOF
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
                    return _DEFERRED
                return written
            del self._out[stream_id]
            flags[0] |= _DATA_EOF
            if out.trailers is not None:
                flags[0] |= _DATA_NO_END_STREAM
                nva, _keep, count = out.trailers
                _check(lib.nghttp2_submit_trailer(self._session, stream_id, nva, count))
        return written


class _RemoteSettings:
    """The peer's settings, as far as the drivers read them."""

    __slots__ = ("_session",)

    def __init__(self, session: Any) -> None:
        self._session = session

    @property
    def max_concurrent_streams(self) -> int:
        return int(lib.nghttp2_session_get_remote_settings(self._session, _SETTINGS_MAX_CONCURRENT_STREAMS))

    @property
    def enable_connect_protocol(self) -> int:
        return int(lib.nghttp2_session_get_remote_settings(self._session, _SETTINGS_ENABLE_CONNECT_PROTOCOL))


def _check(rv: int) -> None:
    if rv < 0:
        message = ffi.string(lib.nghttp2_strerror(rv)).decode()
        if rv in (-510, -501):  # NGHTTP2_ERR_STREAM_CLOSED, NGHTTP2_ERR_INVALID_ARGUMENT on a stream
            raise NgStreamClosedError(message, ErrorCodes.STREAM_CLOSED)
        raise NgProtocolError(message)


def _whole(data: bytes | bytearray, sid: int, size: int, kind: int, flags: int, end: int) -> tuple[int, bool]:
    """Where the DATA frame (``kind`` 0) or the header block (1) of stream ``sid`` ends in ``data`` (``end``:
    where its first frame ends), -1 if that is not in ``data`` yet; and whether another frame (or a
    CONTINUATION of another stream) interrupts the header block (a connection error: the block then
    ends with that frame)."""
    if kind == 1:
        while not flags & 0x4:  # (END_HEADERS)
            if end + 9 > size:
                return -1, False
            high, low, kind, flags, other = _unpack_head(data, end)
            end += 9 + (high << 16 | low)
            if kind != 9 or other != sid:
                return (end if end <= size else -1), True
    return (end if end <= size else -1), False


def _code(value: int) -> int:
    try:
        return ErrorCodes(value)
    except ValueError:
        return value


_LIB_TO_CODE = {
    -505: ErrorCodes.PROTOCOL_ERROR,  # NGHTTP2_ERR_PROTO
    -510: ErrorCodes.STREAM_CLOSED,  # NGHTTP2_ERR_STREAM_CLOSED
    -522: ErrorCodes.FRAME_SIZE_ERROR,  # NGHTTP2_ERR_FRAME_SIZE_ERROR
    -524: ErrorCodes.FLOW_CONTROL_ERROR,  # NGHTTP2_ERR_FLOW_CONTROL
    -523: ErrorCodes.COMPRESSION_ERROR,  # NGHTTP2_ERR_HEADER_COMP
    -535: ErrorCodes.REFUSED_STREAM,  # NGHTTP2_ERR_REFUSED_STREAM
}


def _stream_error_code(lib_error: int) -> int:
    return _LIB_TO_CODE.get(lib_error, ErrorCodes.PROTOCOL_ERROR)


def _goaway(last_stream_id: int, error_code: int) -> bytes:
    return (8 << 48 | 0x7 << 40).to_bytes(9) + last_stream_id.to_bytes(4) + int(error_code).to_bytes(4)


def _flatten(headers: Any) -> tuple[list[bytes], bytes, bytearray]:
    """A header list's names and values in order, joined into one buffer, and each field's nv flags
    (never-indexed for an ``hpack.NeverIndexedHeaderTuple``)."""
    parts = []
    flags = bytearray()
    for field in headers:
        name, value = field
        parts.append(name)
        parts.append(value)
        flags.append(_NO_INDEX if type(field) is _NEVER_INDEXED else 0)
    try:
        joined = b"".join(parts)
    except TypeError:  # (a field given as str: encoded as h2 would)
        parts = [part.encode() if isinstance(part, str) else bytes(part) for part in parts]
        joined = b"".join(parts)
    return parts, joined, flags


def _nv_array(headers: Any) -> tuple[Any, Any]:
    """A header list as ``nghttp2_nv[]``; the second item, the buffers it points into, must live as
    long as the call that takes the array (the library copies the fields).

    The array is packed by ``struct`` in one call where ``nghttp2_nv`` has the layout of an LP64 ABI
    (:data:`_NV_PACKED`), field by field through cffi elsewhere.
    """
    parts, joined, flags = _flatten(headers)
    base = _from_buffer(_CHAR_ARRAY, joined, False)
    count = len(flags)
    if _NV_PACKED:
        at = int(ffi.cast("uintptr_t", base))
        flat: list[int] = []
        for i in range(count):
            name = len(parts[2 * i])
            value = len(parts[2 * i + 1])
            flat += (at, at + name, name, value, flags[i])
            at += name + value
        packed = _pack(_NV_FORMAT * count, *flat)
        return _from_buffer(_NV_ARRAY, packed, False), (base, packed)
    fields = []
    at = 0
    for i in range(count):
        name = len(parts[2 * i])
        value = len(parts[2 * i + 1])
        fields.append((base + at, base + at + name, name, value, flags[i]))
        at += name + value
    return _new(_NV_ARRAY, fields), base


def _submit_headers(session: Any, flags: int, stream_id: int, headers: Any) -> int:
    """``nghttp2_submit_headers`` of a header list: through the shim's ``pb_submit_headers`` (the names
    and values in one buffer, their lengths and flags in two more), or an ``nghttp2_nv`` array."""
    if not SHIM:
        nva, _keep = _nv_array(headers)
        return int(lib.nghttp2_submit_headers(session, flags, stream_id, ffi.NULL, nva, len(headers), ffi.NULL))
    parts, joined, flagged = _flatten(headers)
    lengths = _pack(f"={len(parts)}I", *map(len, parts))
    return int(lib.pb_submit_headers(session, flags, stream_id, joined, lengths, bytes(flagged), len(flagged)))


# -- the callbacks, shared by every session (each finds its codec through user_data) -------------


def _keep_failure(exc_type: Any, exc: BaseException, tb: Any) -> None:
    """A callback raised: kept for the codec to re-raise after the library call (cffi would print it)."""
    _failures.append(exc)


_failures: list[BaseException] = []


if SHIM:  # (API mode's ffi is cffi's C object itself)
    _from_handle, _unpack, _from_buffer, _new = ffi.from_handle, ffi.unpack, ffi.from_buffer, ffi.new
else:  # (ABI mode's is Python: its C functions, without the wrappers)
    _backend = ffi._backend
    _from_handle, _unpack, _from_buffer, _new = (
        _backend.from_handle,
        _backend.unpack,
        _backend.from_buffer,
        _backend.newp,
    )
_CHAR_ARRAY = ffi.typeof("char[]")
_NV_ARRAY = ffi.typeof("nghttp2_nv[]")
_NEVER_INDEXED = hpack.NeverIndexedHeaderTuple
_NV_FORMAT = "QQQQB7x"  # name, value, namelen, valuelen, flags: nghttp2_nv on an LP64 ABI (40 bytes)
_NV_PACKED = (
    ffi.sizeof("nghttp2_nv") == struct.calcsize("=" + _NV_FORMAT)
    and ffi.sizeof("void *") == 8
    and [ffi.offsetof("nghttp2_nv", f) for f in ("name", "value", "namelen", "valuelen", "flags")] == [0, 8, 16, 24, 32]
)
_pack = struct.pack
_unpack_from = struct.unpack_from
_unpack_head = struct.Struct(">BHBBL").unpack_from  # a frame header: its length (high, low), type, flags, stream


def _codec_of(user_data: Any) -> NgCodec:
    codec: NgCodec = _from_handle(user_data)
    return codec


def _on_header(
    session: Any, frame: Any, name: Any, namelen: int, value: Any, valuelen: int, flags: int, user_data: Any
) -> int:
    codec: NgCodec = _from_handle(user_data)
    size = codec._block_size + namelen + valuelen + 32
    if size > codec._cap:
        codec._error = h2.exceptions.DenialOfServiceError(
            f"header block over {codec._cap} bytes decoded (an HPACK bomb?)"
        )
        return _CALLBACK_FAILURE
    if not codec._block_size:
        codec._block = []
    codec._block_size = size
    codec._block.append((_unpack(name, namelen), _unpack(value, valuelen)))
    return 0


def _on_frame_recv(session: Any, frame: Any, user_data: Any) -> int:
    hd = frame.hd
    kind = hd.type
    a = b = 0
    extra: Any = None
    if kind == 0:
        a = frame.data.padlen
    elif kind == 3:
        a = frame.rst_stream.error_code
    elif kind == 8:
        a = frame.window_update.window_size_increment
    elif kind == 4:
        settings = frame.settings
        extra = [(settings.iv[i].settings_id, settings.iv[i].value) for i in range(settings.niv)]
    elif kind == 7:
        goaway = frame.goaway
        a, b = goaway.last_stream_id, goaway.error_code
        extra = _unpack(goaway.opaque_data, goaway.opaque_data_len) if goaway.opaque_data_len else b""
    _codec_of(user_data)._frame(kind, hd.flags, hd.stream_id, hd.length, a, b, extra)
    return 0


def _on_data_chunk(session: Any, flags: int, stream_id: int, data: Any, length: int, user_data: Any) -> int:
    _from_handle(user_data)._chunks.append(_unpack(data, length))
    return 0


def _on_invalid_frame(session: Any, frame: Any, lib_error: int, user_data: Any) -> int:
    _codec_of(user_data)._invalid(frame.hd.stream_id, lib_error)
    return 0


def _on_stream_close(session: Any, stream_id: int, error_code: int, user_data: Any) -> int:
    _codec_of(user_data)._on_stream_close(stream_id, error_code)
    return 0


def _on_error(session: Any, lib_error: int, message: Any, length: int, user_data: Any) -> int:
    _codec_of(user_data)._error_message = ffi.unpack(message, length).decode(errors="replace")
    return 0


def _read(session: Any, stream_id: int, buf: Any, length: int, flags: Any, source: Any, user_data: Any) -> int:
    return _codec_of(source.ptr)._read(stream_id, buf, length, flags)


def _c(kind: str, function: Any) -> Any:
    """``function`` as a C callback of type ``kind``: an exception in it is kept (:func:`_keep_failure`)
    and the library told the callback failed, never a 0 that says it went well."""
    return ffi.callback(kind, function, error=_CALLBACK_FAILURE, onerror=_keep_failure)


def _make_callbacks() -> Any:
    pointer = ffi.new("nghttp2_session_callbacks **")
    _check(lib.nghttp2_session_callbacks_new(pointer))
    callbacks = ffi.gc(pointer[0], lib.nghttp2_session_callbacks_del)
    if SHIM:
        lib.pb_set_callbacks(callbacks)  # (recording in C: see _shim)
        return callbacks
    for setter, kind, function in (
        ("on_header_callback", "nghttp2_on_header_callback", _on_header),
        ("on_frame_recv_callback", "nghttp2_on_frame_recv_callback", _on_frame_recv),
        ("on_data_chunk_recv_callback", "nghttp2_on_data_chunk_recv_callback", _on_data_chunk),
        ("on_invalid_frame_recv_callback", "nghttp2_on_invalid_frame_recv_callback", _on_invalid_frame),
        ("on_stream_close_callback", "nghttp2_on_stream_close_callback", _on_stream_close),
        ("error_callback2", "nghttp2_error_callback2", _on_error),
    ):
        callback = _c(kind, function)
        _KEEP.append(callback)
        getattr(lib, f"nghttp2_session_callbacks_set_{setter}")(callbacks, callback)
    return callbacks


_KEEP: list[Any] = []  # the C callbacks, alive as long as the module (the library keeps only pointers)
_CALLBACKS = _make_callbacks()  # (the library copies them into each session)
_READ = _c("nghttp2_data_source_read_callback", _read)  # (each codec's provider names it)
_POINTER = ffi.new("const uint8_t **")
