"""The HTTP/2 codec seam: the contract the h2 driver holds a codec to, and the hyper-h2 codec.

Every line of proxyblocks that knows hyper-h2 (or hpack, or hyperframe) is in
this package; the driver (:mod:`blocks.transport._h2`), the server connection,
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
- ``TERMINATED`` (a GOAWAY received): ``error_code``, ``last_stream_id``;
- ``PING_ACK`` (the ACK of a PING we sent): nothing more (the upstream pool,
  the one sender, has one PING out at a time and writes it beside the
  state machine: see ``H2ClientConnection.ping``).

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

Where each piece is
-------------------

- ``_contract``: the contract (:class:`Codec`, :class:`CodecSettings`,
  :class:`EventKind`, :data:`ProtocolError`, :data:`ErrorCodes`);
- ``_h2codec``: the hyper-h2 codec, :class:`H2Codec` (its DATA fast paths
  are its own methods), and :func:`make_h2`, which makes and configures one;
- ``_fastpath``: what those DATA fast paths use beside the class (the
  states they take, the joining of a read's runs per stream);
- ``_guard``: the abuse limits of a server (:class:`GuardedFrameBuffer`,
  :data:`HEADER_LIST_HARD_CAP`, :data:`MAX_CONTINUATIONS`);
- ``_hpack``: header blocks (:class:`PlainEncoder`, :class:`CheckedDecoder`);
- ``_stream``: a validating listener's streams, where a malformed request is
  its stream's error;
- ``_closed``: the bounded record of closed streams (:data:`CLOSED_STREAMS`);
- ``_settings``: the settings table (:class:`CompactSettings`).
"""

from blocks.transport._codec._choice import CODECS, CodecUnavailable, codec_in_use, make_h2, use_codec
from blocks.transport._codec._closed import CLOSED_STREAMS
from blocks.transport._codec._closed import _ClosedStreams as ClosedStreams
from blocks.transport._codec._contract import Codec, CodecSettings, ErrorCodes, EventKind, ProtocolError
from blocks.transport._codec._guard import HEADER_LIST_HARD_CAP, MAX_CONTINUATIONS, GuardedFrameBuffer
from blocks.transport._codec._h2codec import H2Codec, make_hyper_h2
from blocks.transport._codec._hpack import CheckedDecoder, CompressionError, PlainEncoder
from blocks.transport._codec._settings import CompactSettings

__all__ = [
    "CLOSED_STREAMS",
    "CODECS",
    "HEADER_LIST_HARD_CAP",
    "MAX_CONTINUATIONS",
    "CheckedDecoder",
    "ClosedStreams",
    "Codec",
    "CodecUnavailable",
    "CodecSettings",
    "CompactSettings",
    "CompressionError",
    "ErrorCodes",
    "EventKind",
    "GuardedFrameBuffer",
    "H2Codec",
    "PlainEncoder",
    "ProtocolError",
    "codec_in_use",
    "make_h2",
    "make_hyper_h2",
    "use_codec",
]
