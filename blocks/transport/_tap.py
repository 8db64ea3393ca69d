"""Taps: watching an exchange go by without touching it.

A hop may give a :class:`~blocks.hops.Forward` a :class:`Tee`: an observer
of that one exchange (the mirror tee is one). On either path the hop feeds
it the request body as it goes upstream, the response head and body as
they come back, and tells it once when the exchange is over:

- on the splice fast path, :func:`tap_splice` hangs ``tee.request`` and
  ``tee.response`` on the splice's two pipes (``Pipe.tap``), which call
  them with each chunk they relay;
- on the task path, :class:`TappedBody` wraps the request and response
  bodies and calls the same methods as the chunks are read
  (:func:`tap_response` for the response: a tee that ends the exchange
  itself, a WebSocket's :class:`~blocks.transport._wsend.WebSocketEnd`,
  takes the response body over instead).

Rules for a tee: every method is synchronous, never blocks, never raises,
and keeps no reference to a chunk it does not own (the chunks are the
relayed bytes themselves). A tee that cannot keep up drops its own copy;
the exchange it watches never waits for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from blocks.http import Body, Headers
from blocks.transport._pipe import Tap

if TYPE_CHECKING:
    from blocks.transport._h2 import H2Stream

__all__ = ["Tap", "TappedBody", "Tee", "tap_response", "tap_splice"]


class Tee(Protocol):
    """An observer of one exchange; see the module docstring for the rules."""

    def request(self, data: bytes, end: bool, trailers: Headers | None) -> None:
        """A chunk of the request body on its way upstream; ``end`` with the last (and its trailers)."""

    def response(self, data: bytes, end: bool, trailers: Headers | None) -> None:
        """A chunk of the response body on its way downstream; ``end`` with the last."""

    def head(self, status: int, headers: Headers) -> None:
        """The upstream's response head, as it arrived (before this hop's own fields)."""

    def abort(self) -> None:
        """The request body broke on its way (the client went away): the exchange will not complete."""

    def closed(self) -> None:
        """The exchange is over, however it ended. Called exactly once, last."""


def tap_splice(down_st: H2Stream, tee: Tee, request_ended: bool) -> None:
    """Hang ``tee`` on the splice that ``down_st`` (the downstream stream) was just joined to."""
    splice = down_st.splice
    real = getattr(splice, "splice", splice)  # a retry stand-in holds the splice it replays into
    assert real is not None
    if request_ended:
        tee.request(b"", True, None)
    else:
        real.request.tap = tee.request
    real.response.tap = tee.response


class BodyTaker(Protocol):
    """A tee that reads the task path's response body itself (to end it its own way): :meth:`take` gives
    the body to send in its place."""

    def take(self, body: Body) -> Body: ...


def tap_response(body: Body, tee: Tee) -> Body:
    """The task path's response ``body`` as ``tee`` watches it: a :class:`TappedBody`, or, for a tee
    with a ``take`` method (:class:`BodyTaker`), the body it gives."""
    take = getattr(type(tee), "take", None)
    if take is not None:
        taken: Body = take(tee, body)
        return taken
    return TappedBody(body, tee.response)


class TappedBody(Body):
    """``inner``, whose chunks also go to ``tap`` as they are read (the task path's tap)."""

    __slots__ = ("_done", "_inner", "_on_error", "_tap")

    def __init__(self, inner: Body, tap: Tap, on_error: Callable[[], None] | None = None) -> None:
        super().__init__(inner.length)
        self._inner = inner
        self._tap = tap
        self._on_error = on_error
        self._done = False
        self.trailers = inner.trailers
        if inner.ended:  # nothing to read (a GET): whoever sends it may never call receive
            self._done = True
            tap(b"", True, inner.trailers)

    @property
    def ended(self) -> bool:
        return self._inner.ended

    async def receive(self) -> bytes:
        try:
            chunk = await self._inner.receive()
        except BaseException:
            if not self._done:
                self._done = True
                if self._on_error is not None:
                    self._on_error()
            raise
        if not self._done:
            if chunk:
                self._tap(chunk, False, None)
            # A sender may stop at the last chunk once ``ended`` says so, never asking for b"".
            if not chunk or self._inner.ended:
                self._done = True
                self.trailers = self._inner.trailers
                self._tap(b"", True, self.trailers)
        elif not chunk:
            self.trailers = self._inner.trailers
        return chunk

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            if self._on_error is not None:
                self._on_error()
        await self._inner.aclose()

    def discard(self) -> None:
        self._inner.discard()

    def claim(self) -> None:
        self._inner.claim()
