"""The stream-level pieces of the transport that blocks and hops build on, under public names.

- the HTTP/2 driver both sides share (:class:`H2Driver`, its streams
  :class:`H2Stream`, their books :class:`H2ConnectionStatistics`), the one
  function that acknowledges received DATA (:func:`acknowledge`), and the
  codec contract the driver holds (:class:`Codec`, :class:`CodecSettings`,
  :class:`EventKind`), and the choice of codec (:func:`use_codec`,
  :func:`codec_in_use`, :data:`CODECS`, :class:`CodecUnavailable`);
- the fast path: :data:`Relay` (a hop's ``relay``), :data:`HeadFilter` (a
  splice's rewrite of the response head), :class:`Sink` (what an upstream
  stream's frames are relayed into);
- watching an exchange go by: :class:`Tee`, :class:`TappedBody`,
  :func:`tap_splice`, :func:`tap_response`;
- ending a relayed WebSocket with a Close frame: :class:`WebSocketEnd`,
  and its frame boundaries, :class:`FrameTracker`, :func:`close_frame`;
- an HTTP/1.1 stream (:class:`H1Stream`) and the WebSocket upgrade helpers
  (:data:`KEY_FIELDS`, :data:`WEBSOCKET_VERSION`, :func:`new_key`).

They live in private modules of :mod:`blocks.transport`; import them from here.
"""

from blocks.transport._codec import CODECS, Codec, CodecSettings, CodecUnavailable, EventKind, codec_in_use, use_codec
from blocks.transport._h1 import H1Stream
from blocks.transport._h2 import H2ConnectionStatistics, H2Driver, H2Stream, Relay, acknowledge
from blocks.transport._splice import HeadFilter, Sink
from blocks.transport._tap import TappedBody, Tee, tap_response, tap_splice
from blocks.transport._upgrade import KEY_FIELDS, WEBSOCKET_VERSION, new_key
from blocks.transport._wsend import WebSocketEnd
from blocks.transport._wsframes import FrameTracker, close_frame

__all__ = [
    "CODECS",
    "KEY_FIELDS",
    "WEBSOCKET_VERSION",
    "Codec",
    "CodecSettings",
    "CodecUnavailable",
    "EventKind",
    "FrameTracker",
    "H1Stream",
    "H2ConnectionStatistics",
    "H2Driver",
    "H2Stream",
    "HeadFilter",
    "Relay",
    "Sink",
    "TappedBody",
    "Tee",
    "WebSocketEnd",
    "acknowledge",
    "close_frame",
    "codec_in_use",
    "new_key",
    "tap_response",
    "tap_splice",
    "use_codec",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
