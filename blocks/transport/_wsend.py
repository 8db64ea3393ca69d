"""Ending a relayed WebSocket cleanly: a Close frame to the client, between two of the server's frames.

A hop relays a WebSocket as bytes; when it must end one itself (its
session was drained, the hop drains), cutting the streams would leave the
client with code 1006 and no reason. :class:`WebSocketEnd` is what the hop
keeps per WebSocket to do better. It is a :class:`~blocks.transport.Tee`
on the exchange, so the hop's existing tee hooks put it in place, on either
path, at no cost to any other request:

- spliced (:func:`~blocks.transport.tap_splice`): it watches the response
  pipe's chunks with a :class:`~blocks.transport._wsframes.FrameTracker`;
  :meth:`WebSocketEnd.end` hands the splice the Close frame and where to put
  it (:meth:`~blocks.transport._splice.Splice.end_response`);
- on a task (:func:`~blocks.transport._tap.tap_response`): it takes the
  response body over (:class:`_EndableBody`), tracks its chunks, and on
  :meth:`WebSocketEnd.end` wakes a read that waits and ends the body with
  the Close frame.

Either way the Close frame follows the last whole frame the server sent
(a frame half-sent is relayed to its end first: a Close may sit between
two fragments of a message, RFC 6455 5.4), the response stream ends cleanly
(END_STREAM on h2: the hops in front end the client's stream or close its
h1 connection after it), and the server's side is cancelled (an h2 stream
reset, an h1 connection closed). A server that already sent its own Close
is left to finish. :meth:`WebSocketEnd.cut` is the bounded fallback: the
tunnel is reset, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from blocks.errors import StreamReset
from blocks.http import Body, Headers, Wire
from blocks.transport._h2 import H2Stream
from blocks.transport._tap import TappedBody, Tee
from blocks.transport._wsframes import FrameTracker, close_frame

__all__ = ["WebSocketEnd"]


class WebSocketEnd:
    """One relayed WebSocket that its hop can end with a Close frame; the exchange's tee.

    ``wire``: the tunnel request's downstream stream (``request.wire``: an
    :class:`~blocks.transport.H2Stream` when the hop's client speaks h2,
    whose splice is found there). ``inner``: a tee that was on the exchange before, fed
    everything this one is (until an end takes the response over).
    ``on_closed(self)`` runs once, when the exchange is over. ``replica`` and
    ``session``: what the hop keeps it by.
    """

    __slots__ = (
        "_body",
        "_closed",
        "_refused",
        "_tail",
        "frames",
        "inner",
        "on_closed",
        "replica",
        "session",
        "wire",
    )

    def __init__(
        self,
        wire: Wire | None,
        *,
        inner: Tee | None = None,
        on_closed: Callable[[WebSocketEnd], None] | None = None,
        replica: str | None = None,
        session: str | None = None,
    ) -> None:
        self.wire = wire
        self.inner = inner
        self.on_closed = on_closed
        self.replica = replica
        self.session = session
        self.frames = FrameTracker()  # the server -> client direction
        self._body: _EndableBody | None = None
        self._tail: bytes | None = None  # the Close frame, once ended
        self._refused = False  # the server answered the handshake with anything but a 200: no tunnel
        self._closed = trio.Event()

    def __repr__(self) -> str:
        state = "closed" if self._closed.is_set() else "ending" if self._tail is not None else "open"
        return f"<WebSocketEnd {self.replica} session={self.session} {state} {self.frames!r}>"

    @property
    def ending(self) -> bool:
        """:meth:`end` was called."""
        return self._tail is not None

    @property
    def is_closed(self) -> bool:
        """The exchange is over, however it ended."""
        return self._closed.is_set()

    # -- the tee ----------------------------------------------------------------------------------

    def request(self, data: bytes, end: bool, trailers: Headers | None) -> None:
        if self.inner is not None:
            self.inner.request(data, end, trailers)

    def response(self, data: bytes, end: bool, trailers: Headers | None) -> None:
        if data:
            self.frames.feed(data)
        if self.inner is not None:
            self.inner.response(data, end, trailers)

    def head(self, status: int, headers: Headers) -> None:
        if status != 200:
            self._refused = True  # its body is an answer, not frames: nothing to end
        if self.inner is not None:
            self.inner.head(status, headers)

    def abort(self) -> None:
        if self.inner is not None:
            self.inner.abort()

    def closed(self) -> None:
        self._closed.set()
        try:
            if self.inner is not None:
                self.inner.closed()
        finally:
            callback, self.on_closed = self.on_closed, None
            if callback is not None:
                callback(self)

    def take(self, body: Body) -> Body:
        """The task path's response body: this one reads it (:func:`~blocks.transport.streams.tap_response`)."""
        if self.inner is not None:
            body = TappedBody(body, self.inner.response)
        if self._refused:
            return body
        self._body = _EndableBody(body, self)
        return self._body

    # -- ending it ---------------------------------------------------------------------------------

    def end(self, code: int, reason: str) -> None:
        """End the WebSocket: a Close frame with ``code`` and ``reason`` to the client, as soon as the frames allow.

        Synchronous, never blocks; idempotent. :meth:`wait_closed` says
        when the exchange is over.
        """
        if self._tail is not None or self._closed.is_set() or self._refused:
            return
        self._tail = tail = close_frame(code, reason)
        if self.frames.closed:
            return  # the server closes already: its Close, not ours, ends it
        if self._body is not None:
            self._body.end()
            return
        st = self.wire
        splice = st.splice if isinstance(st, H2Stream) else None
        if splice is None:
            return  # no answer yet on the task path: the body, when it comes, ends at once (take)
        real = getattr(splice, "splice", splice)  # (a retry's stand-in holds the splice)
        until = None if self.frames.at_boundary else self.frames.until_boundary
        if not real.end_response(tail, until):
            splice.refuse(503)  # not accepted yet: the tunnel is refused instead

    def cut(self) -> None:
        """Reset the tunnel now (the fallback when :meth:`end` could not finish in time)."""
        if self._closed.is_set():
            return
        st = self.wire
        if isinstance(st, H2Stream):
            if st.splice is not None:
                st.splice.refuse(502)  # a splice whose head went resets the stream
                return
            if st.cancel_scope is not None:
                st.cancel_scope.cancel()  # the stream's task: it resets the stream on its way out
                return
        if self._body is not None:
            self._body.cut()

    async def wait_closed(self) -> None:
        """Return once the exchange is over, however it ended."""
        await self._closed.wait()


class _EndableBody(Body):
    """A WebSocket's response body on the task path: the server's bytes, tracked, until the end's Close frame.

    An end wakes a read that waits by cancelling it: the inner body's
    ``receive`` must lose nothing when cancelled before it returns, as a
    pool's bodies do (an h2 stream's :class:`~blocks.http.StreamBody`, an
    h1 tunnel's socket read).
    """

    __slots__ = ("_broken", "_done", "_inner", "_owner", "_scope")

    def __init__(self, inner: Body, owner: WebSocketEnd) -> None:
        super().__init__(inner.length)
        self._inner = inner
        self._owner = owner
        self._done = False
        self._broken = False
        self._scope: trio.CancelScope | None = None

    @property
    def ended(self) -> bool:
        return self._done and not self._broken

    def end(self) -> None:
        scope = self._scope
        if scope is not None:
            scope.cancel()  # a read waiting for the server: look at the end now

    def cut(self) -> None:
        self._done = self._broken = True
        self.end()

    async def receive(self) -> bytes:
        owner = self._owner
        frames = owner.frames
        while True:
            if self._done:
                if self._broken:
                    raise StreamReset("the WebSocket was cut")
                return b""
            tail = owner._tail
            if tail is not None and frames.at_boundary and not frames.closed:
                self._done = True
                await self._inner.aclose()  # the server's side: its stream reset, its connection closed
                return tail
            with trio.CancelScope() as scope:
                self._scope = scope
                try:
                    chunk = await self._inner.receive()
                finally:
                    self._scope = None
            if scope.cancelled_caught:
                continue  # end() or cut(): look again
            if not chunk:
                self._done = True
                self.trailers = self._inner.trailers
                return b""
            if owner._tail is not None and not frames.closed:
                at = frames.until_boundary(chunk)
                if at >= 0:
                    return chunk[:at]  # the rest of the frame; the Close comes next
                return chunk
            frames.feed(chunk)
            return chunk

    async def aclose(self) -> None:
        self._done = True
        await self._inner.aclose()

    def discard(self) -> None:
        self._inner.discard()

    def claim(self) -> None:
        self._inner.claim()
