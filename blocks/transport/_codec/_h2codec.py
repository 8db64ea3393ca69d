"""The hyper-h2 codec: :class:`H2Codec`, an ``H2Connection`` with what :class:`Codec` adds and the
DATA fast paths, and :func:`make_hyper_h2`, which makes one for one side of one hop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
import hyperframe.exceptions
import hyperframe.frame

from blocks.transport._codec._closed import CLOSED_STREAMS, _ClosedStreams
from blocks.transport._codec._contract import EventKind
from blocks.transport._codec._fastpath import (
    _CLIENT_OPEN,
    _HALF_CLOSED_LOCAL,
    _HALF_CLOSED_REMOTE,
    _PADDED_OR_END,
    _SERVER_OPEN,
    _STREAM_OPEN,
    _per_stream,
    _window_update,
)
from blocks.transport._codec._guard import GuardedFrameBuffer
from blocks.transport._codec._hpack import CheckedDecoder, PlainEncoder
from blocks.transport._codec._settings import CompactSettings, _StreamsUncountedSettings
from blocks.transport._codec._stream import _LengthUncheckedStream


class H2Codec(h2.connection.H2Connection):
    """The hyper-h2 codec: an ``H2Connection`` with the few members :class:`Codec` adds. Made by :func:`make_hyper_h2`.

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

    name = "h2"
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
        h2.events.PingAckReceived: EventKind.PING_ACK,
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


def make_hyper_h2(
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
