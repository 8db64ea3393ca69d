"""The abuse limits of a server facing strangers, enforced as frames come in.

:class:`GuardedFrameBuffer` (h2's inbound frame buffer) caps header blocks,
frame lengths, runs of empty frames and control-frame floods, and wants the
client's preface to go on with SETTINGS; :data:`HEADER_LIST_HARD_CAP` is the
hard cap on a header block, encoded or decoded, and :data:`MAX_CONTINUATIONS`
the CONTINUATION frames one may take.
"""

from __future__ import annotations

import time
from typing import Any

import h2.exceptions
import h2.frame_buffer

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
        self.ping_acks = 0
        """PING ACKs received: the server's drain waits for the one that answers its PING (RFC 9113 6.8)."""

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
        flags = f.flags
        self.check(
            kind,
            len(f.data) if kind <= 1 or kind == 9 else 0,
            "END_STREAM" in flags or "END_HEADERS" in flags,
            "ACK" in flags if self._first or kind == 0x6 else False,
        )
        return super()._update_header_buffer(f)

    def check(self, kind: int, length: int, ends: bool, ack: bool = False) -> None:
        """One frame against the limits, from its header: its ``kind`` (type), the ``length`` of what it
        carries (a DATA payload or header-block fragment, padding and priority fields not counted),
        whether it ``ends`` a stream or a header block, whether it is an ``ack`` (a SETTINGS or PING
        ACK; a PING ACK counts in :attr:`ping_acks`).

        Every codec's server calls it once per frame received, before acting on the frame.
        """
        if self._first:
            if kind != 0x4 or ack:
                raise h2.exceptions.ProtocolError("the client's preface does not go on with SETTINGS")
            self._first = False
        if kind <= 1 or kind == 9:  # DATA, HEADERS, CONTINUATION
            if kind:
                if kind == 1:
                    self._block = length
                    self._parts = 0
                else:
                    self._block += length
                    self._parts += 1
                    if self._parts > MAX_CONTINUATIONS:
                        raise h2.exceptions.DenialOfServiceError(
                            f"header block in more than {MAX_CONTINUATIONS} CONTINUATION frames"
                        )
                if self._block > self.max_header_block:
                    raise h2.exceptions.DenialOfServiceError(f"header block over {self.max_header_block} bytes")
            if length or ends:
                self._empty = 0
            else:
                self._empty += 1
                if self._empty > self.max_empty:
                    raise h2.exceptions.DenialOfServiceError(f"more than {self.max_empty} empty frames in a row")
        elif kind in _CONTROL_FRAMES or kind > 9:
            if ack and kind == 0x6:
                self.ping_acks += 1
            self.control_frame()

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
