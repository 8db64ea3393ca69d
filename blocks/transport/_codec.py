"""The HTTP/2 codec seam: the contract the h2 driver holds a codec to, and the hyper-h2 codec.

Every line of proxyblocks that knows hyper-h2 (or hpack, or hyperframe) is in
this module; the driver (:mod:`blocks.transport._h2`), the server connection,
the splices, the taps, the pool and the mirror speak to a :class:`Codec`.
A second codec (libnghttp2 through cffi) is a second implementation of it,
chosen where the connection is made (:func:`make_h2`), with the same tests.

What a second codec must provide
--------------------------------

A codec is one connection's HTTP/2 state machine, sans-IO: bytes in
(``receive_data``), events out, bytes to send (``data_to_send``), and calls
that queue frames (``send_headers``, ``send_data``, ``end_stream``,
``reset_stream``, ``acknowledge_received_data``, ``close_connection``, ...).
The method names and their meaning are hyper-h2's, so the hyper-h2 codec
*is* an ``H2Connection`` (a subclass): a call through the seam costs what a
call to h2 cost before it, nothing more. :class:`Codec` lists every member
the driver side uses; nothing else may be called.

Speed is the product, so events are not wrapped. ``receive_data`` returns
the codec's own event objects, and the codec's class attribute
``event_kinds`` maps each event class it emits to an :class:`EventKind`
(classes it does not map are ignored). A driver role binds its handlers by
kind once per connection (``H2Driver.bind``) into a dict keyed by event
class, so dispatching an event is one dict lookup on ``type(ev)``, as it
was with h2 alone. The attributes a handler reads, per kind:

- every stream event: ``stream_id`` (int);
- ``REQUEST``, ``RESPONSE``: ``headers`` (a list of ``(bytes, bytes)``, as
  received: no validation, no normalisation, no decoding to str),
  ``stream_ended`` (None unless the frame ended the stream);
- ``DATA``: ``data`` (bytes), ``flow_controlled_length`` (int, padding
  included: the amount to acknowledge), ``stream_ended``; one event may
  carry several frames of one read (the hyper-h2 codec joins them: see
  :class:`H2Codec`), never across its stream's other events;
- ``TRAILERS``: ``headers``, ``stream_ended`` (None for a HEADERS frame
  after a request head that did not end the stream: see below);
- ``STREAM_ENDED``: nothing more (it follows the event that ended the stream);
- ``RESET``: ``error_code`` (an int, one of :data:`ErrorCodes`);
- ``WINDOW_UPDATED``: ``stream_id`` 0 for the connection's window;
- ``SETTINGS_CHANGED``: nothing (the driver reads ``remote_settings``);
- ``TERMINATED`` (a GOAWAY received): ``error_code``, ``last_stream_id``.

A codec also:

- raises :data:`ProtocolError` (or a subclass) for anything the peer or the
  caller got wrong, after queueing the GOAWAY it calls for; the drivers
  catch nothing else;
- uses the RFC 9113 error codes (:data:`ErrorCodes`, an ``IntEnum``);
- never validates or normalises header fields (the edge validates request
  heads once, :mod:`blocks.transport._validate`), and leaves a request's
  ``content-length`` to the listener when asked (``check_lengths=False``, a
  validating listener's);
- on a validating listener's connection, never fails the connection for
  what makes one request malformed (RFC 9113 8.1.1): a HEADERS frame after
  the request head without END_STREAM is reported as ``TRAILERS`` with
  ``stream_ended`` None, the stream left open for the listener to reset,
  and a request head is a ``REQUEST`` whatever its pseudo-headers say (a
  ``:status`` among them included);
- sends a field given as an ``hpack.NeverIndexedHeaderTuple`` (``server-timing``,
  made in :mod:`blocks.timing`) never-indexed, and literals without Huffman
  coding unless asked (``huffman``);
- enforces the abuse limits of :class:`GuardedFrameBuffer` on a server
  (``guard``), and counts what the driver reports through ``control_frame``;
- advertises SETTINGS_MAX_HEADER_LIST_SIZE and fails only past
  ``header_list_cap`` while decoding, and on a server that counts its own
  streams (``count_streams=False``) refuses none past
  SETTINGS_MAX_CONCURRENT_STREAMS itself;
- keeps a graceful GOAWAY from closing the connection: ``goaway_frame``
  makes one beside the state machine, ``reopen_after_goaway`` puts the
  state back after one is received, and ``outlive_goaway`` lets the frames
  that follow a received GOAWAY in the same read through (python-hyper/h2#1181);
- keeps the inbound window books: ``inbound_books()`` is ``(window, unacknowledged)``;
- remembers a bounded number of closed streams (:data:`CLOSED_STREAMS`), and
  answers a late frame on one it forgot as on a stream it reset: a stream
  error or nothing, never a connection error, its DATA counted against the
  connection's window and given back.

The hyper-h2 codec patches h2 internals for all that (a class swap on new
streams, whose class overrides h2's content-length checks and catches its
stream state machine's errors on HEADERS, the frame buffer's header parsing
and its buffering of a frame, the record of closed streams, the storage of
settings, the connection state machine's transitions and state, the inbound
window manager's books, where h2 reads our stream limit):
``tests/test_h2_internals.py`` checks that each one is still there and
still means what it meant, and ``pyproject.toml`` pins h2 to the minor
release they were checked against.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.settings
import h2.stream
import hpack
import hyperframe.exceptions
import hyperframe.frame

from blocks.http import Headers

# -- the contract ----------------------------------------------------------------------------

ProtocolError = h2.exceptions.ProtocolError
"""What every codec raises for a protocol error (a second codec raises a subclass)."""

ErrorCodes = h2.errors.ErrorCodes
"""The RFC 9113 (7) error codes, an ``IntEnum``: a codec takes and reports these values."""


class EventKind(enum.Enum):
    """What a codec's event is, for the driver to pick its handler (see the module docstring)."""

    REQUEST = "request"
    RESPONSE = "response"
    DATA = "data"
    TRAILERS = "trailers"
    STREAM_ENDED = "stream_ended"
    RESET = "reset"
    WINDOW_UPDATED = "window_updated"
    SETTINGS_CHANGED = "settings_changed"
    TERMINATED = "terminated"


class CodecSettings(Protocol):
    """The peer's settings, as far as the drivers read them."""

    @property
    def max_concurrent_streams(self) -> int: ...

    @property
    def enable_connect_protocol(self) -> int: ...


class Codec(Protocol):
    """One HTTP/2 connection's state machine: everything the drivers call (see the module docstring)."""

    event_kinds: ClassVar[Mapping[type, EventKind]]

    @property
    def max_outbound_frame_size(self) -> int:
        """The largest DATA payload one ``send_data`` may take."""

    @property
    def highest_inbound_stream_id(self) -> int: ...

    @property
    def remote_settings(self) -> CodecSettings: ...

    def initiate_connection(self) -> None:
        """Queue the preface (a client's) and our SETTINGS."""

    def receive_data(self, data: bytes | bytearray) -> list[Any]:
        """Feed received bytes; the events they make, in order."""

    def data_to_send(self) -> bytes:
        """Take every byte queued so far."""

    def send_headers(self, stream_id: int, headers: Headers, end_stream: bool = False) -> None:
        """A head (opening the stream if new) or, on a stream with a head, trailers."""

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """One DATA frame: ``data`` fits the stream's and the connection's send windows and the frame size."""

    def end_stream(self, stream_id: int) -> None: ...

    def reset_stream(self, stream_id: int, error_code: int = 0) -> None: ...

    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None:
        """Give received DATA bytes back (the connection's window, and the stream's while it is open)."""

    def local_flow_control_window(self, stream_id: int) -> int:
        """What may be sent on ``stream_id`` now (the smaller of its window and the connection's)."""

    def increment_flow_control_window(self, increment: int) -> None:
        """Open the connection's inbound window by ``increment``."""

    def close_connection(self, error_code: int = 0, *, last_stream_id: int | None = None) -> None:
        """Queue the final GOAWAY; the codec takes no frame after it."""

    def get_next_available_stream_id(self) -> int: ...

    def stream_is_open(self, stream_id: int) -> bool:
        """Whether the codec knows ``stream_id`` and has not closed it."""

    def inbound_books(self) -> tuple[int, int]:
        """``(window, unacknowledged)``: what the peer may still send; what was received and not given back."""

    def goaway_frame(self, last_stream_id: int) -> bytes:
        """A graceful GOAWAY(NO_ERROR) to write beside the state machine, which stays open."""

    def reopen_after_goaway(self) -> None:
        """After a received graceful GOAWAY: let the streams in flight finish."""

    def control_frame(self) -> None:
        """Count a control frame the driver saw (a window update that serves no stream); ProtocolError on a flood."""


# -- the hyper-h2 codec ------------------------------------------------------------------------


class PlainEncoder(hpack.Encoder):
    """An HPACK encoder that writes string literals without Huffman coding.

    RFC 7541 5.2 lets each literal be sent either way. Huffman saves about a
    fifth of the bytes of literal fields and costs, in pure Python, a third
    of a hop's HPACK time on both sides; between hops on a fast network the
    CPU is what counts. Indexed fields are unaffected.
    """

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        return super().encode(headers, huffman=False)


class CompressionError(h2.exceptions.ProtocolError):
    """A header block HPACK cannot decode: a connection error COMPRESSION_ERROR (RFC 9113 4.3)."""

    error_code = h2.errors.ErrorCodes.COMPRESSION_ERROR


HEADER_LIST_HARD_CAP = 4
"""The hard cap on one header block, as a multiple of ``max_header_list_size``.

``max_header_list_size`` is what SETTINGS_MAX_HEADER_LIST_SIZE advertises,
and counts a block decoded (RFC 9113 6.5.2: every field's name and value,
plus 32): over it, a validating listener answers 431 on that stream, and a pooled
upstream connection fails that response alone (502). A block over the hard
cap ends the connection with GOAWAY(ENHANCE_YOUR_CALM): counted
encoded (the HEADERS and CONTINUATION fragments, frame by frame, so a
CONTINUATION flood is cut there) or decoded (an HPACK bomb, while decoding).
Four, because HPACK spends at most 30 bits on a byte (Huffman) and a few on a
field's lengths, where the count adds 32: no encoding of a list within the
limit is longer than four times it, so only a peer over the limit can meet
the encoded cap.
"""


class CheckedDecoder(hpack.Decoder):
    """hpack's decoder, whose failures h2 reports with the right error code.

    h2 turns every decoding error into a plain PROTOCOL_ERROR; RFC 9113 4.3
    asks for COMPRESSION_ERROR. An oversized list stays h2's business (it
    answers ENHANCE_YOUR_CALM: an HPACK bomb).
    """

    def decode(self, data: bytes, raw: bool = False) -> Any:
        try:
            return super().decode(data, raw)
        except hpack.OversizedHeaderListError:
            raise
        except (hpack.HPACKError, IndexError, TypeError, UnicodeDecodeError) as exc:
            raise CompressionError(f"undecodable header block: {exc}") from exc


class GuardedFrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's inbound frame buffer, with the limits a server facing strangers needs.

    h2 buffers up to 64 CONTINUATION frames (about 1 MB of header block),
    and checks a frame's length only once the whole frame is in (up to 16 MiB
    buffered for a length it will refuse). This buffer sees every frame before
    h2 acts on it and allows:

    - a header block (HEADERS plus its CONTINUATIONs) of at most
      ``max_header_block`` encoded bytes (the sum of the fragments, padding
      and priority fields not counted), checked frame by frame, in at most
      :data:`MAX_CONTINUATIONS` CONTINUATION frames;
    - no frame longer than ``max_frame_size`` (our SETTINGS_MAX_FRAME_SIZE),
      refused from its 9-byte header, before its payload is buffered
      (FRAME_SIZE_ERROR, as h2 would have answered once it was all in);
    - at most ``max_empty`` consecutive DATA, HEADERS or CONTINUATION frames
      whose payload is empty and that end nothing;
    - a first frame that is SETTINGS (RFC 9113 3.4), else PROTOCOL_ERROR;
    - no SETTINGS ACK with a payload (6.5: FRAME_SIZE_ERROR, where
      hyperframe's parse error would make it PROTOCOL_ERROR);
    - at most ``flood_limit`` control frames per ``flood_window`` seconds:
      SETTINGS, PING, PRIORITY, frames of unknown types, and whatever the
      driver reports through :meth:`control_frame` (window updates that
      serve no stream).

    Crossing one of the counts raises h2's ``DenialOfServiceError``, which h2
    answers with GOAWAY(ENHANCE_YOUR_CALM) and the driver with closing the
    connection.
    """

    def __init__(self, *, max_header_block: int, max_empty: int, flood_limit: int, flood_window: float) -> None:
        super().__init__(server=True)
        self.max_header_block = max_header_block
        self.max_empty = max_empty
        self.flood_limit = flood_limit
        self.flood_window = flood_window
        self._block = 0  # bytes of the header block being received
        self._parts = 0  # its CONTINUATION frames
        self._empty = 0  # consecutive empty frames
        self._control = 0  # control frames since _since
        self._since = time.monotonic()
        self._first = True

    def __next__(self) -> Any:
        data = self._data
        if len(data) >= 9 and data[3] == 0x4 and data[4] & 0x1 and (data[0] or data[1] or data[2]):
            raise h2.exceptions.FrameTooLargeError("SETTINGS ACK with a payload")
        try:
            return super().__next__()
        except StopIteration:
            # A frame not all in yet: h2 would buffer all of its announced length
            # (up to 16 MiB) before refusing it.
            data = self._data
            if len(data) >= 9 and int.from_bytes(data[:3]) > self.max_frame_size:
                raise h2.exceptions.FrameTooLargeError(
                    f"a frame of {int.from_bytes(data[:3])} bytes, over {self.max_frame_size}"
                ) from None
            raise

    def _update_header_buffer(self, f: Any) -> Any:
        kind = f.type
        if self._first:
            if kind != 0x4 or "ACK" in f.flags:
                raise h2.exceptions.ProtocolError("the client's preface does not go on with SETTINGS")
            self._first = False
        if kind <= 1 or kind == 9:  # DATA, HEADERS, CONTINUATION
            data = f.data
            if kind:
                if kind == 1:
                    self._block = len(data)
                    self._parts = 0
                else:
                    self._block += len(data)
                    self._parts += 1
                    if self._parts > MAX_CONTINUATIONS:
                        raise h2.exceptions.DenialOfServiceError(
                            f"header block in more than {MAX_CONTINUATIONS} CONTINUATION frames"
                        )
                if self._block > self.max_header_block:
                    raise h2.exceptions.DenialOfServiceError(f"header block over {self.max_header_block} bytes")
            if data or "END_STREAM" in f.flags or "END_HEADERS" in f.flags:
                self._empty = 0
            else:
                self._empty += 1
                if self._empty > self.max_empty:
                    raise h2.exceptions.DenialOfServiceError(f"more than {self.max_empty} empty frames in a row")
        elif kind in _CONTROL_FRAMES or kind > 9:
            self.control_frame()
        return super()._update_header_buffer(f)

    def control_frame(self) -> None:
        """Count one control frame; raise once there are too many in the window."""
        self._control += 1
        if self._control > self.flood_limit:
            now = time.monotonic()
            if now - self._since < self.flood_window:
                raise h2.exceptions.DenialOfServiceError(
                    f"more than {self.flood_limit} control frames in {self.flood_window:g} s"
                )
            self._control = 1
            self._since = now


_CONTROL_FRAMES = frozenset({0x2, 0x4, 0x6})  # PRIORITY, SETTINGS, PING

MAX_CONTINUATIONS = h2.frame_buffer.CONTINUATION_BACKLOG - 1
"""CONTINUATION frames one header block may take (63): h2 fails the connection with
PROTOCOL_ERROR past them; :class:`GuardedFrameBuffer` names it ENHANCE_YOUR_CALM first."""


class _LengthUncheckedStream(h2.stream.H2Stream):
    """An h2 stream of a validating listener: what makes a request malformed is an error of its stream.

    h2 checks a request's ``content-length`` against its DATA itself, and a
    mismatch or a malformed value fails the whole connection; RFC 9113 8.1.1
    makes it an error of that stream alone. A validating listener checks it
    per stream instead (``H2ServerConnection``), on streams of this class.
    So it does for the HEADERS frames h2's stream state machine would fail
    the connection for (:meth:`receive_headers`).
    """

    def _initialize_content_length(self, headers: Any) -> None:
        pass

    def _track_content_length(self, length: int, end_stream: bool) -> None:
        pass

    def receive_headers(self, headers: Any, end_stream: bool, header_encoding: Any) -> Any:
        """h2's, except that a malformed request's HEADERS frame is left to the listener (RFC 9113 8.1.1).

        h2 raises a connection error for a HEADERS frame after the request
        head without END_STREAM ("trailers must end the stream"), and for a
        block whose pseudo-headers carry a ``:status`` 1xx, which it takes
        for an informational response (in a request head or in trailers).
        Both make the request malformed: a stream error. So, with h2's
        stream state put back where it was (the remote side still open):

        - after the head, the frame is reported as trailers whose
          ``stream_ended`` is None (it did not end the stream, and no
          StreamEnded follows); the listener resets the stream;
        - a request head is taken as a request, its ``:status`` emptied
          so that h2 sees no informational response; validation refuses
          it for the ``:status`` (a response pseudo-header).

        A HEADERS frame on a stream whose remote side is closed stays h2's
        own stream error (STREAM_CLOSED). The common path pays a call and
        the read of the stream's state.
        """
        machine = self.state_machine
        state = machine.state
        try:
            return super().receive_headers(headers, end_stream, header_encoding)
        except h2.exceptions.StreamClosedError:
            raise
        except h2.exceptions.ProtocolError:
            if state not in _REMOTE_OPEN:
                raise
            machine.state = state  # (h2 moved it to CLOSED on some of these)
        if machine.headers_received:
            return [], [h2.events.TrailersReceived(stream_id=self.stream_id, headers=list(headers))]
        neutral = [(name, b"") if name == b":status" else (name, value) for name, value in headers]
        return super().receive_headers(neutral, end_stream, header_encoding)


# Where a HEADERS frame h2 refuses is the stream's error, not the connection's (see receive_headers).
_REMOTE_OPEN = frozenset(
    {h2.stream.StreamState.IDLE, h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL}
)


CLOSED_STREAMS = 256
"""Closed streams a connection remembers (h2: 65,536, 7.5 MiB per busy connection; here about 17 KiB).

Remembering a closed stream only decides how a late HEADERS frame on it is
answered: a connection error if the peer had ended the stream, else a
stream error. A forgotten stream is taken for one we reset (see
:class:`_ClosedStreams`), so any late frame on it is a stream error or
ignored, and its DATA still counted and given back (docs/limits.md).
"""


class _ClosedStreams(dict[int, Any]):
    """h2's record of how each closed stream closed (``H2Connection._closed_streams``), bounded.

    Past ``limit`` the oldest close is forgotten, and ``forgotten`` keeps the
    highest id forgotten so far, per parity: an id at or under it that is not
    remembered may be a stream we reset, whose late frames RFC 9113 5.1 says
    to ignore, not one never opened. A dict: two thirds of h2's OrderedDict.
    """

    __slots__ = ("forgotten", "limit")

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.forgotten = [0, 0]

    def __setitem__(self, stream_id: int, closed_by: Any) -> None:
        super().__setitem__(stream_id, closed_by)
        if len(self) > self.limit:
            oldest = next(iter(self))
            del self[oldest]
            parity = oldest & 1
            if oldest > self.forgotten[parity]:
                self.forgotten[parity] = oldest


# The states the DATA fast paths take (compared by identity: an enum's hash is a Python call).
_CLIENT_OPEN = h2.connection.ConnectionState.CLIENT_OPEN
_SERVER_OPEN = h2.connection.ConnectionState.SERVER_OPEN
_STREAM_OPEN = h2.stream.StreamState.OPEN  # a stream takes and sends DATA without END_STREAM, and stays so
_HALF_CLOSED_LOCAL = h2.stream.StreamState.HALF_CLOSED_LOCAL  # takes DATA, and stays so
_HALF_CLOSED_REMOTE = h2.stream.StreamState.HALF_CLOSED_REMOTE  # sends DATA, and stays so
_PADDED_OR_END = 0x08 | 0x01  # DATA flags the fast path leaves to h2


class H2Codec(h2.connection.H2Connection):
    """The hyper-h2 codec: an ``H2Connection`` with the few members :class:`Codec` adds. Made by :func:`make_h2`.

    It also takes the common DATA frame off h2's general path, both ways,
    because a token stream (an LLM's, a voice agent's) is many small DATA
    frames and each one crossed every hop through all of h2's machinery:

    - **receiving** (:meth:`receive_data`), a run of DATA frames in a row on
      one stream, none padded or ending it, on a stream that takes DATA
      without changing state, becomes one ``DataReceived`` event: what one
      read brought of a stream crosses the hop as one chunk, and so leaves it
      as one DATA frame (frame boundaries carry no meaning, RFC 9113 5.1).
      Nothing waits for more: the run is what is already in the buffer. The
      books are h2's own, charged the run's length at once (the connection's
      and the stream's windows, the content-length count), so flow-control
      errors are the ones h2 raises; anything else (a padded or last frame,
      another frame type, a stream h2 would refuse DATA on, a header block
      in progress, a server's first frame) goes through h2 one frame at a
      time, as ever. When streams interleave their frames, a stream's runs
      in one read are joined too (:func:`_per_stream`), never across its
      own end, reset, trailers or window updates or the connection's frames.
    - **sending** (:meth:`send_data`), a DATA frame without END_STREAM or
      padding, within the windows and the frame size, on a stream in a state
      that sends DATA without changing, is framed here (nine bytes and the
      payload) and charged to h2's windows; anything else is h2's.

    ``tests/test_h2_internals.py`` checks the h2 internals both read.
    """

    event_kinds: ClassVar[Mapping[type, EventKind]] = {
        h2.events.RequestReceived: EventKind.REQUEST,
        h2.events.ResponseReceived: EventKind.RESPONSE,
        h2.events.DataReceived: EventKind.DATA,
        h2.events.TrailersReceived: EventKind.TRAILERS,
        h2.events.StreamEnded: EventKind.STREAM_ENDED,
        h2.events.StreamReset: EventKind.RESET,
        h2.events.WindowUpdated: EventKind.WINDOW_UPDATED,
        h2.events.RemoteSettingsChanged: EventKind.SETTINGS_CHANGED,
        h2.events.ConnectionTerminated: EventKind.TERMINATED,
    }
    guard: GuardedFrameBuffer | None = None

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        self._closed_streams: _ClosedStreams = _ClosedStreams(CLOSED_STREAMS)
        self.remote_settings = CompactSettings(client=not config.client_side)

    def _stream_closed_by(self, stream_id: int) -> Any:
        # h2 asks how a stream closed to choose between a stream error and a connection error
        # for a frame on it; None means never opened (a connection error for HEADERS).
        closed_by = super()._stream_closed_by(stream_id)
        if closed_by is None and stream_id <= self._closed_streams.forgotten[stream_id & 1]:
            return h2.stream.StreamClosedBy.SEND_RST_STREAM  # forgotten, and maybe reset by us
        return closed_by

    def receive_data(self, data: Any) -> list[Any]:
        """h2's, with runs of plain DATA frames on one stream taken as one event (see the class docstring)."""
        buffer = self.incoming_buffer
        buffer.add_data(data)
        buffer.max_frame_size = limit = self.max_inbound_frame_size
        guard = self.guard
        events: list[Any] = []
        runs: set[int] = set()  # the streams the fast path took runs of
        joinable = False  # one of them more than once: other streams' frames came between
        try:
            while True:
                raw = buffer._data
                if (
                    len(raw) > 9
                    and raw[3] == 0  # DATA
                    and not raw[4] & _PADDED_OR_END
                    and not buffer._headers_buffer
                    and (guard is None or not guard._first)
                    and ((connection := self.state_machine.state) is _CLIENT_OPEN or connection is _SERVER_OPEN)
                ):
                    event = self._data_run(raw, limit)
                    if event is not None:
                        events.append(event)
                        if event.stream_id in runs:
                            joinable = True
                        else:
                            runs.add(event.stream_id)
                        if guard is not None:
                            guard._empty = 0
                        continue
                if len(raw) < 9:
                    break  # (not even a frame header: nothing for h2 either)
                frame = next(buffer, None)
                if frame is None:
                    break
                events.extend(self._receive_frame(frame))
        except hyperframe.exceptions.InvalidPaddingError as exc:
            self._terminate_connection(h2.errors.ErrorCodes.PROTOCOL_ERROR)
            raise h2.exceptions.ProtocolError("Received frame with invalid padding.") from exc
        except h2.exceptions.ProtocolError as exc:
            self._terminate_connection(exc.error_code)
            raise
        if joinable:  # (a plain request's batch, one DATA frame a stream, skips the pass)
            return _per_stream(events)
        return events

    def _data_run(self, raw: bytearray, limit: int) -> h2.events.DataReceived | None:
        """The DATA frames at the front of ``raw`` on one stream, as one event; None to leave them to h2."""
        stream = self.streams.get(int.from_bytes(raw[5:9]) & 0x7FFFFFFF)
        if stream is None:
            return None
        machine = stream.state_machine
        state = machine.state
        if not (state is _STREAM_OPEN or state is _HALF_CLOSED_LOCAL) or not machine.headers_received:
            return None
        sid = raw[5:9]
        end = len(raw)
        pos = 0
        parts = []
        while (
            pos + 9 < end and raw[pos + 3] == 0 and not raw[pos + 4] & _PADDED_OR_END and raw[pos + 5 : pos + 9] == sid
        ):
            length = int.from_bytes(raw[pos : pos + 3])
            start = pos + 9
            if not length or length > limit or start + length > end:
                break  # (an empty frame counts for the guard; an overlong one is h2's error; a partial one waits)
            parts.append(raw[start : start + length])
            pos = start + length
        if not pos:
            return None
        size = pos - 9 * len(parts)
        del raw[:pos]
        # h2's books, as its frame-by-frame path would have kept them (a window overrun raises the same);
        # the body's length is counted only against a declared one, as h2 uses it.
        self._inbound_flow_control_window_manager.window_consumed(size)
        stream._inbound_window_manager.window_consumed(size)
        if stream._expected_content_length is not None:
            stream._track_content_length(size, False)
        payload = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        return h2.events.DataReceived(stream_id=stream.stream_id, data=payload, flow_controlled_length=size)

    def send_data(
        self, stream_id: int, data: bytes | memoryview, end_stream: bool = False, pad_length: Any = None
    ) -> None:
        """h2's, with a plain DATA frame framed here (see the class docstring)."""
        size = len(data)
        stream = self.streams.get(stream_id)
        if (
            end_stream
            or pad_length is not None
            or stream is None
            or not size
            or type(data) is not bytes
            or size > self.outbound_flow_control_window
            or size > stream.outbound_flow_control_window
            or not ((state := stream.state_machine.state) is _STREAM_OPEN or state is _HALF_CLOSED_REMOTE)
            or not ((connection := self.state_machine.state) is _CLIENT_OPEN or connection is _SERVER_OPEN)
            or size > self.max_outbound_frame_size
        ):
            super().send_data(stream_id, data, end_stream, pad_length)
            return
        stream.outbound_flow_control_window -= size
        self.outbound_flow_control_window -= size
        out = self._data_to_send
        out += (size << 48 | stream_id).to_bytes(9)  # length (3 bytes), type DATA, no flags, stream id
        out += data

    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None:
        """h2's, without its logging and frame objects: WINDOW_UPDATEs only as h2's window managers ask."""
        stream = self.streams.get(stream_id)
        if stream is None or acknowledged_size < 0:
            super().acknowledge_received_data(acknowledged_size, stream_id)  # (its errors, or nothing to do)
            return
        increment = self._inbound_flow_control_window_manager.process_bytes(acknowledged_size)
        if increment:
            self._data_to_send += _window_update(0, increment)
        state = stream.state_machine.state  # h2 gives stream window back only while the stream is ``open``:
        if state is _STREAM_OPEN or state is _HALF_CLOSED_LOCAL or state is _HALF_CLOSED_REMOTE:
            increment = stream._inbound_window_manager.process_bytes(acknowledged_size)
            if increment:
                self._data_to_send += _window_update(stream_id, increment)

    def stream_is_open(self, stream_id: int) -> bool:
        stream = self.streams.get(stream_id)
        return stream is not None and not stream.closed

    def inbound_books(self) -> tuple[int, int]:
        # h2 keeps the books; its window manager has no public reading of them.
        window = self._inbound_flow_control_window_manager
        held = window.max_window_size - window.current_window_size - window._bytes_processed
        return window.current_window_size, held

    def goaway_frame(self, last_stream_id: int) -> bytes:
        # h2 moves its state machine to CLOSED on any GOAWAY it sends, which
        # would forbid finishing the streams in flight (python-hyper/h2#1181),
        # so this one is written beside it. The final GOAWAY goes through h2.
        frame = hyperframe.frame.GoAwayFrame(stream_id=0, last_stream_id=last_stream_id, error_code=0)
        return frame.serialize()

    def reopen_after_goaway(self) -> None:
        # h2 moved to CLOSED on the GOAWAY it received (see goaway_frame): put it back.
        self.state_machine.state = (
            h2.connection.ConnectionState.CLIENT_OPEN
            if self.config.client_side
            else h2.connection.ConnectionState.SERVER_OPEN
        )

    def control_frame(self) -> None:
        if self.guard is not None:
            self.guard.control_frame()


def _per_stream(events: list[Any]) -> list[Any]:
    """A read's events, each stream's DATA events joined into its first, where nothing of that stream
    (its end, a reset, trailers, a window update) or of the connection came between.

    Streams sharing a connection interleave their frames (a replica streaming
    tokens to many clients at once), and a run is one stream's frames in a
    row; this joins the rest. Order within a stream is kept, and so is order
    against everything that concerns it; only one stream's bytes may come
    before another's, which streams allow (RFC 9113 5.1: each is its own).
    """
    joined: list[Any] = []
    into: dict[int, Any] = {}  # stream id -> its DATA event that may take more
    parts: dict[int, tuple[Any, list[bytes]]] = {}  # id of an event that took more -> it, and its data in pieces
    for ev in events:
        sid = getattr(ev, "stream_id", 0)
        if type(ev) is h2.events.DataReceived and ev.stream_ended is None:
            first = into.get(sid)
            if first is not None:
                if id(first) in parts:
                    parts[id(first)][1].append(ev.data)
                else:
                    parts[id(first)] = (first, [first.data, ev.data])
                first.flow_controlled_length += ev.flow_controlled_length
                continue
            into[sid] = ev
        elif sid:
            into.pop(sid, None)  # the stream's other news stays after its bytes
        else:
            into.clear()  # the connection's (SETTINGS, GOAWAY, a window update of its own): after everything
        joined.append(ev)
    for ev, pieces in parts.values():
        ev.data = b"".join(pieces)
    return joined


def _window_update(stream_id: int, increment: int) -> bytes:
    """A WINDOW_UPDATE frame: length 4, type 8, no flags, the stream id; the increment."""
    return (4 << 48 | 8 << 40 | stream_id).to_bytes(9) + increment.to_bytes(4)


class _LengthUncheckedCodec(H2Codec):
    def _begin_new_stream(self, stream_id: int, allowed_ids: Any) -> h2.stream.H2Stream:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        stream.__class__ = _LengthUncheckedStream  # same layout; only its overrides differ
        return stream


# h2's connection state machine, except that a GOAWAY received leaves it open.
# h2 moves to CLOSED on any GOAWAY it receives and then rejects every other
# frame, including those that came in the same read right behind it (the
# responses of the very streams the GOAWAY lets finish, a PING), before the
# reader could put the state back with ``reopen_after_goaway``: the connection
# would die with them. The pool's ``accepting`` is what stops new streams.
_OUTLIVE_GOAWAY = {
    **h2.connection.H2ConnectionStateMachine._transitions,
    (_CLIENT_OPEN, h2.connection.ConnectionInputs.RECV_GOAWAY): (None, _CLIENT_OPEN),
}


class CompactSettings(h2.settings.Settings):
    """h2's settings, each value's history in a list where h2 keeps a ``deque`` (624 bytes each).

    A connection holds two of these (ours and the peer's), some ten values
    each: h2's deques cost about 10 KiB per connection, a quarter of an idle
    one's memory; lists of one value, about 1.5 KiB.
    """

    def __init__(self, client: bool = True, initial_values: Mapping[Any, int] | None = None) -> None:
        super().__init__(client, dict(initial_values) if initial_values is not None else None)
        self._settings = cast(Any, {key: list(values) for key, values in self._settings.items()})

    def __setitem__(self, key: Any, value: int) -> None:
        super().__setitem__(key, value)  # appends to our list, or starts a deque for a new key
        values: Any = self._settings[key]
        if type(values) is not list:
            self._settings[key] = cast(Any, list(values))

    def acknowledge(self) -> dict[Any, h2.settings.ChangedSetting]:
        changed = {}
        settings: dict[Any, list[int]] = cast(Any, self._settings)
        for key, values in settings.items():
            if len(values) > 1:
                old = values.pop(0)
                changed[key] = h2.settings.ChangedSetting(key, old, values[0])
        return changed


class _StreamsUncountedSettings(CompactSettings):
    """Our settings, as sent, except that h2 reads no concurrent-stream limit from them.

    h2 answers a HEADERS frame past our SETTINGS_MAX_CONCURRENT_STREAMS with
    a connection error (PROTOCOL_ERROR); RFC 9113 5.1.2 makes it an error of
    that stream alone. A server that counts its streams itself (the listener:
    RST_STREAM(REFUSED_STREAM), which the client may retry) takes these. The
    value still goes out in the SETTINGS frame, which h2 builds from the items.
    """

    @property
    def max_concurrent_streams(self) -> int:
        return 2**31 - 1

    @max_concurrent_streams.setter
    def max_concurrent_streams(self, value: int) -> None:
        self[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = value


def make_h2(
    *,
    client_side: bool,
    max_concurrent_streams: int,
    stream_window: int,
    max_header_list_size: int,
    header_list_cap: int | None = None,
    count_streams: bool = True,
    huffman: bool = False,
    guard: GuardedFrameBuffer | None = None,
    check_lengths: bool = True,
    connect_protocol: bool = False,
    outlive_goaway: bool = False,
) -> H2Codec:
    """The hyper-h2 codec for one side of one hop, with h2's header checks off.

    h2's own header validation costs more than the rest of a hop's work and
    turns a malformed request into a connection error. Proxyblocks validates
    request heads once, at the edge, in :mod:`blocks.transport._validate` (a stream
    error); every other hop only hears from a hop that did.
    ``check_lengths=False`` (a validating server) leaves ``content-length``
    to the listener, and reports the HEADERS frames of a malformed request
    that h2 would fail the connection for as the stream's events
    (``_LengthUncheckedStream.receive_headers``).
    ``connect_protocol`` (servers) advertises ``SETTINGS_ENABLE_CONNECT_PROTOCOL``
    (RFC 8441): clients may then open WebSocket tunnels with extended CONNECT.
    ``outlive_goaway`` (clients) keeps the connection open through a GOAWAY
    received, for the frames behind it (see ``_OUTLIVE_GOAWAY``).

    ``max_header_list_size`` is what SETTINGS_MAX_HEADER_LIST_SIZE advertises;
    ``header_list_cap`` (default: the same) is where decoding a header block
    stops with ENHANCE_YOUR_CALM (an HPACK bomb), both as RFC 9113 6.5.2
    counts (every field's name and value, plus 32). A server that answers a
    list between the two itself (431) sets the cap above the limit.
    ``count_streams=False``: h2 does not refuse a stream past
    ``max_concurrent_streams`` (a connection error there); the caller does
    (see :class:`_StreamsUncountedSettings`).
    """
    config = h2.config.H2Configuration(
        client_side=client_side,
        header_encoding=None,
        validate_inbound_headers=False,
        normalize_inbound_headers=False,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
    )
    conn = (H2Codec if check_lengths else _LengthUncheckedCodec)(config)
    conn.decoder = CheckedDecoder()
    if guard is not None:
        conn.incoming_buffer = conn.guard = guard
    if outlive_goaway:
        conn.state_machine._transitions = _OUTLIVE_GOAWAY
    # h2 applies our SETTINGS to its decoder only when a change is acknowledged,
    # and initial values never change: the decoder keeps what is set here.
    conn.decoder.max_header_list_size = header_list_cap or max_header_list_size
    if not huffman:
        conn.encoder = PlainEncoder()
    codes = h2.settings.SettingCodes
    conn.local_settings = (CompactSettings if count_streams else _StreamsUncountedSettings)(
        client=client_side,
        initial_values={
            codes.MAX_CONCURRENT_STREAMS: max_concurrent_streams,
            codes.INITIAL_WINDOW_SIZE: stream_window,
            codes.MAX_HEADER_LIST_SIZE: max_header_list_size,
            codes.ENABLE_PUSH: 0,
            **({codes.ENABLE_CONNECT_PROTOCOL: 1} if connect_protocol else {}),
        },
    )
    return conn
