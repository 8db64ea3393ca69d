"""The pipes of a splice: one direction each, ``src`` -> ``dst``, DATA and the end of stream.

:class:`Pipe` relays what one side's stream receives into the other side's
state machine as the windows allow (the splice's flow-control invariants
are :mod:`blocks.transport._splice`'s); :class:`EndingPipe` takes a
response pipe's place when the hop ends the exchange itself
(:meth:`~blocks.transport._splice.Splice.end_response`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

from blocks.http import Headers
from blocks.transport._codec import ErrorCodes, ProtocolError
from blocks.transport._h2 import BACKLOG_HIGH, acknowledge

if TYPE_CHECKING:
    from blocks.transport._h2 import H2Driver, H2Stream

__all__ = ["EndingPipe", "Pipe", "Tap", "Until"]

_CANCEL = ErrorCodes.CANCEL

Tap = Callable[[bytes, bool, "Headers | None"], None]
"""Watches a pipe's chunks go by: ``tap(data, end, trailers)`` (see :mod:`blocks.transport._tap`)."""


class Pipe:
    """One direction of a splice: DATA and the end of stream, ``src`` -> ``dst``."""

    __slots__ = ("done", "dst", "dst_st", "ended", "held", "pending", "src", "src_st", "tap", "trailers")

    def __init__(self, src: H2Driver, src_st: H2Stream, dst: H2Driver, dst_st: H2Stream) -> None:
        self.src = src
        self.src_st = src_st
        self.dst = dst
        self.dst_st = dst_st
        self.pending: collections.deque[bytes] = collections.deque()
        self.held = 0  # bytes received after the pipe was cut, kept unacknowledged until the splice closes
        self.ended = False
        self.done = False
        self.trailers: Headers | None = None
        self.tap: Tap | None = None  # sees each chunk as it is relayed (blocks.transport._tap); never blocks

    def feed(self, data: bytes, size: int, end: bool) -> None:
        # The bytes are the pipe's (relayed, or pending) before a tap, which may
        # be a user's and raise, sees them: a failure then leaves nothing unowned.
        try:
            padding = size - len(data)
            if padding:
                acknowledge(self.src.h2, padding, self.src_st.id)
            if end:
                self.ended = True
            if data:
                if self.pending:
                    self.pending.append(data)
                    return
                if not self._push(data):
                    return
            if self.ended and not self.done and not self.pending:
                self._finish()
        finally:
            if self.tap is not None:
                self.tap(data, end, None)

    def _push(self, data: bytes) -> bool:
        """Send as much of ``data`` as the windows allow; keep the rest. True if all went.

        If h2 refuses (the destination stream is gone), what was not sent
        goes back to ``pending`` before the error goes on: the splice's close
        gives it back (every byte received is acknowledged once).
        """
        dst = self.dst.h2
        sid = self.dst_st.id
        src = self.src.h2
        src_sid = self.src_st.id
        progressed = False
        try:
            while data:
                if self.dst.backlog + self.dst.pushed >= BACKLOG_HIGH:
                    # Counting what this batch already gave h2: a writer that drains
                    # wakes every waiting splice at once, and together they must not
                    # overshoot.
                    self.dst.backlogged = True  # its writer wakes the windows when it drains
                    room = 0
                else:
                    room = min(dst.local_flow_control_window(sid), dst.max_outbound_frame_size)
                if room <= 0:
                    self.pending.appendleft(data)
                    if progressed or self.dst_st.stalled_since is None:
                        self.dst.stalled(self.dst_st)  # stalled since the last progress
                    return False
                if len(data) <= room:
                    # The common case: the whole chunk, with END_STREAM when it is the last.
                    last = self.ended and not self.pending and self.trailers is None
                    dst.send_data(sid, data, end_stream=last)
                    self.dst.pushed += len(data)
                    self.dst_st.sent += len(data)
                    acknowledge(src, len(data), src_sid)
                    if last:
                        self.done = True
                        self.dst.local_end(self.dst_st)
                    return True
                dst.send_data(sid, data[:room])
                self.dst.pushed += room
                self.dst_st.sent += room
                acknowledge(src, room, src_sid)
                data = data[room:]
                progressed = True
        except ProtocolError:
            self.pending.appendleft(data)
            raise
        return True

    def flush(self) -> None:
        """The destination's window may have opened."""
        pending = self.pending
        moved = False
        while pending:
            if not self._push(pending.popleft()):
                if moved:
                    self.dst.stalled(self.dst_st)
                return
            moved = True
        self.dst_st.stalled_since = None
        if self.ended and not self.done:
            self._finish()

    def end(self, trailers: Headers | None) -> None:
        if self.tap is not None:
            self.tap(b"", True, trailers)
        self.ended = True
        if trailers:
            self.trailers = trailers
        if not self.pending and not self.done:
            self._finish()

    def release(self) -> None:
        """Give back what is pending or held: it will never be relayed."""
        pending = self.pending
        if pending or self.held:
            size = sum(map(len, pending)) + self.held
            pending.clear()
            self.held = 0
            src = self.src
            if not src.closed:
                acknowledge(src.h2, size, self.src_st.id)
                src.send_soon()

    def _finish(self) -> None:
        self.done = True
        self.dst.local_end(self.dst_st)
        if self.trailers:
            self.dst.h2.send_headers(self.dst_st.id, self.trailers, end_stream=True)
        else:
            self.dst.h2.end_stream(self.dst_st.id)


Until = Callable[[bytes], int]
"""Where a response may end within its upstream's next chunk: the offset (1 to ``len(chunk)``) of the
first point there, or -1 to relay the whole chunk and look at the next (a WebSocket's frame boundaries:
:meth:`~blocks.transport._wsframes.FrameTracker.until_boundary`)."""


class EndingPipe(Pipe):
    """A response pipe being ended by the hop: the upstream's bytes up to a cut, then ``tail``, then END_STREAM.

    It takes the place of the splice's response pipe (:meth:`Splice.end_response`),
    with its state as it was. ``tail`` is the hop's own bytes (a WebSocket's
    Close frame): they go after everything pending, as the window allows,
    and are acknowledged to nobody; the last of them carries END_STREAM.
    Until ``until`` finds its point, the upstream's chunks are relayed whole;
    the chunk it finds the point in is relayed up to it, the rest given back
    unrelayed, and the upstream stream cancelled.
    """

    __slots__ = ("tail", "until")

    def __init__(self, pipe: Pipe, tail: bytes, until: Until | None) -> None:
        super().__init__(pipe.src, pipe.src_st, pipe.dst, pipe.dst_st)
        self.pending = pipe.pending
        self.held = pipe.held
        self.ended = pipe.ended
        self.done = pipe.done
        self.trailers = pipe.trailers
        self.tail = tail
        self.until = until  # (no tap: ``until`` watches the bytes from here on)

    def feed(self, data: bytes, size: int, end: bool) -> None:
        until = self.until
        at = until(data) if until is not None and data else -1
        if at < 0:
            super().feed(data, size, end)
            return
        if size > at:
            acknowledge(self.src.h2, size - at, self.src_st.id)  # past the cut (and padding): never relayed
        super().feed(data[:at], at, False)
        self.stop()

    def stop(self) -> None:
        """End here: ``tail`` after what is pending, and the upstream stream cancelled (its end is ours now)."""
        self.until = None
        self.ended = True
        self.pending.append(self.tail)
        if len(self.pending) == 1:
            self.flush()
        self.src.reset(self.src_st, _CANCEL)  # -> Splice.failed: the response ended, so an early answer

    def _push(self, data: bytes) -> bool:
        if data is not self.tail:
            return super()._push(data)
        dst = self.dst.h2
        sid = self.dst_st.id
        room = min(dst.local_flow_control_window(sid), dst.max_outbound_frame_size)
        if room < len(data):
            if room > 0:
                dst.send_data(sid, data[:room])
                self.dst.pushed += room
                self.dst_st.sent += room
                data = self.tail = data[room:]
            self.pending.appendleft(data)
            self.dst.stalled(self.dst_st)
            return False
        last = self.ended and not self.pending
        dst.send_data(sid, data, end_stream=last)
        self.dst.pushed += len(data)
        self.dst_st.sent += len(data)
        if last:
            self.done = True
            self.dst.local_end(self.dst_st)
        return True

    def release(self) -> None:
        pending = self.pending
        if pending and pending[-1] is self.tail:
            pending.pop()  # ours: nothing to give back for it
        super().release()
