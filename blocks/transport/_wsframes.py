"""Where the WebSocket frames end in a byte stream: enough to put a frame of our own between two of them.

A hop relays a WebSocket as bytes (docs/websocket.md) and never parses
its messages. To end one cleanly it must send the client a Close frame
(RFC 6455 5.5.1), and a frame can only go *between* two frames of the
server's: :class:`FrameTracker` watches the server -> client bytes and
knows, after any chunk, whether the stream stands at a frame boundary, and
if not, where in the next chunks the current frame ends.

Rules: sans-IO (bytes in, positions out, no trio); a payload is counted,
never copied or unmasked; a header split across chunks (2 to 14 bytes,
RFC 6455 5.2) is kept until it is whole, the only bytes ever copied; one
``int`` per frame of work. Extensions (permessage-deflate) change payloads,
not frame headers, so they change nothing here; a Close frame (opcode 8)
is noted, so that a tunnel whose server already closes is not sent a
second one.
"""

from __future__ import annotations

__all__ = ["FrameTracker", "close_frame"]

_CLOSE = 0x8
_MAX_HEAD = 14  # 2 bytes, 8 of extended length, 4 of mask


class FrameTracker:
    """The frame boundaries of one direction of a WebSocket, fed its bytes in order.

    ``at_boundary``: the bytes fed so far end exactly where a frame ended
    (true before the first byte). ``closed``: a Close frame's header went
    by. :meth:`feed` takes a chunk whole; :meth:`until_boundary` takes a
    chunk only up to the first boundary in it, and says where that is.
    """

    __slots__ = ("_head", "_left", "closed", "frames")

    def __init__(self) -> None:
        self._left = 0  # payload bytes of the current frame still to come
        self._head = b""  # the start of a header that a chunk cut short
        self.closed = False
        self.frames = 0  # frames whose header went by

    def __repr__(self) -> str:
        where = "at a boundary" if self.at_boundary else f"{self._left} payload bytes to go"
        return f"<FrameTracker frames={self.frames} {where}{' closed' if self.closed else ''}>"

    @property
    def at_boundary(self) -> bool:
        return not self._left and not self._head

    def feed(self, data: bytes) -> None:
        """Take ``data``, the next bytes of the stream, whole."""
        left = self._left
        if left >= len(data):  # (the common case: a chunk inside one frame's payload)
            self._left = left - len(data)
            return
        self._scan(data, left, stop=False)

    def until_boundary(self, data: bytes) -> int:
        """Take ``data`` up to the first frame boundary in it: that boundary's offset (1 to ``len(data)``),
        or -1 if ``data`` ends inside a frame (then all of it was taken).

        Meant for a stream that is not :attr:`at_boundary` (at a boundary,
        the first one in ``data`` is the end of its first frame).
        """
        left = self._left
        if left > len(data):
            self._left = left - len(data)
            return -1
        if left and not self._head:
            self._left = 0
            return left
        return self._scan(data, left, stop=True)

    def _scan(self, data: bytes, pos: int, *, stop: bool) -> int:
        """Walk the frames of ``data`` from ``pos`` (the end of the current payload); see :meth:`until_boundary`."""
        end = len(data)
        if self._head:  # a header cut short: complete it from this chunk (at most 14 bytes copied)
            kept = self._head
            buf = kept + data[: _MAX_HEAD - len(kept)]
            header = _header(buf, 0)
            if header is None:
                self._head = buf  # (all of data: it was shorter than what the header lacks)
                return -1
            need, size = header
            if buf[0] & 0x0F == _CLOSE:
                self.closed = True
            self.frames += 1
            self._head = b""
            pos = need - len(kept)
            if size >= end - pos:
                self._left = size - (end - pos)
                return end if stop and not self._left else -1
            pos += size
            if stop:
                self._left = 0
                return pos
        while pos < end:
            header = _header(data, pos)
            if header is None:
                self._head = bytes(data[pos:])
                self._left = 0
                return -1
            need, size = header
            if data[pos] & 0x0F == _CLOSE:
                self.closed = True
            self.frames += 1
            pos += need
            if size >= end - pos:
                self._left = size - (end - pos)
                return end if stop and not self._left else -1
            pos += size
            if stop:
                self._left = 0
                return pos
        self._left = 0
        return -1


def _header(buf: bytes, at: int) -> tuple[int, int] | None:
    """The frame header at ``buf[at:]``: its size and its payload's length; None if it is not all there."""
    avail = len(buf) - at
    if avail < 2:
        return None
    b1 = buf[at + 1]
    size = b1 & 0x7F
    need = 2 + (4 if b1 & 0x80 else 0)
    if size == 126:
        need += 2
        if avail < need:
            return None
        size = (buf[at + 2] << 8) | buf[at + 3]
    elif size == 127:
        need += 8
        if avail < need:
            return None
        size = int.from_bytes(buf[at + 2 : at + 10], "big")
    elif avail < need:
        return None
    return need, size


def close_frame(code: int, reason: str) -> bytes:
    """A server's Close frame (unmasked): ``code`` and ``reason`` (at most 123 bytes of UTF-8)."""
    payload = code.to_bytes(2, "big") + reason.encode()
    if len(payload) > 125:
        raise ValueError(f"a close reason is at most 123 bytes of UTF-8, not {len(payload) - 2}")
    return bytes((0x80 | _CLOSE, len(payload))) + payload
