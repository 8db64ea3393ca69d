"""Safe retry of an upstream stream the upstream did not answer (RFC 9113 8.7): what a request keeps so
that it can be sent again, and when it is.

The invariant, enforced here and in the connection's two places that end a
stream unanswered (``H2ClientConnection._refuse``, ``stream_lost``):

- **never processed**: a stream reset with ``REFUSED_STREAM`` before its
  response head, or above the last stream id of a GOAWAY, whatever its
  error code. It is sent again at once on another connection, whatever its
  method, if none of its body went up (:class:`_Refused`, status 503 when
  it cannot be).
- **cut**: a stream whose connection ended (the upstream closed it after a
  GOAWAY or while idle, reset it, stopped answering PINGs) before any byte
  of its response. The upstream may have processed it (a server that
  accepted it and then closed, as hypercorn does past
  ``keep_alive_max_requests``), so it is sent again at once only if its
  method is safe (``GET``, ``HEAD``, ``OPTIONS``, ``TRACE``, as the h1
  pool's stale-connection retry) and none of its body went up; otherwise it fails at once
  (:class:`_Refused` with ``maybe_processed``, status 502).
- **answered, then lost**: a stream whose response head came and whose
  connection ended before its body did fails at once (``StreamReset``,
  502): its head is on its way downstream, nothing can be sent again.

"At once" is the point: a connection's end fails every stream on it in the
same step (``H2Driver.mark_closed``), and a GOAWAY that leaves streams
waiting is followed by a PING (``H2ClientConnection._on_terminated``), so
a server that said GOAWAY and then neither answers them nor closes (one
whose state machine closed with its GOAWAY) is found out within
``h2_ping_timeout``, or at once when the PING makes it close.

A request goes again at most once. Two things make it possible:

- :class:`_Upload`, on the awaiting path: the request body's pump, which
  outlives the refused stream and carries on on the retry's;
- :class:`_Replay`, on the spliced path: a stand-in for the splice on the
  downstream stream, which keeps the downstream's events while the retry
  finds a connection, then replays them on the new stream.

Invariants:

- A request goes again at most once, and only while no request body byte
  has gone upstream (``_Upload.sent``; a :class:`_Replay` hands the stream
  back to its splice with the first body byte, and then no retry is
  possible). A refusal (:class:`_Refused`) after that, or a second one,
  fails the request (503 on the awaiting path, 502 for a cut stream; 502
  spliced, as any failure before the head).
- Every byte received while parked is acknowledged exactly once: relayed by
  the new splice (which acknowledges it as it goes), or given back by
  ``_release`` when the retry is given up.
- Nothing here costs the steady state anything: once the first body byte,
  the trailers, or a window update after the response head came, the
  splice is back on the downstream stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from blocks._sync import Signal
from blocks.errors import StreamReset, UpstreamConnectError, UpstreamProtocolError
from blocks.fields import ERROR_HEADER
from blocks.transport._h2 import H2Driver, H2Stream, acknowledge, flush_marked
from blocks.transport._splice import Splice

if TYPE_CHECKING:
    from blocks.http import Body, Headers, Request
    from blocks.transport.multiplexer._h2pool import H2ClientConnection


SAFE = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})
"""RFC 9110 9.2.1: the methods a cut stream's request may be sent again with (the h1 pool's set too)."""


class _Refused(UpstreamProtocolError):
    """The upstream did not answer the stream: it never processed it (RFC 9113 8.7: refused with
    ``REFUSED_STREAM``, or above the last stream id of its GOAWAY), or, with ``maybe_processed``, its
    connection ended before any byte of the response. Safe to send again if none of the request body
    went with it, and, if ``maybe_processed``, its method is safe (see the module docstring)."""

    status = 503

    def __init__(self, message: str, *, maybe_processed: bool = False) -> None:
        super().__init__(message, status=502 if maybe_processed else None)
        self.maybe_processed = maybe_processed

    def retryable(self, method: bytes) -> bool:
        """Whether the request (with ``method``, none of its body sent) may go again."""
        return not self.maybe_processed or method in SAFE


class _Upload:
    """A request body on its way upstream. It outlives a refused first stream.

    ``sent`` turns true with the first body byte handed to a stream: from
    then on the request can never be retried. While a refused stream may
    still be retried, the pump waits (holding the chunk it read, if any)
    until the requester moves it to the new stream or gives up.
    """

    __slots__ = ("_moved", "body", "broken", "conn", "finished", "scope", "sent", "st")

    def __init__(self, body: Body, conn: H2ClientConnection, st: H2Stream) -> None:
        body.claim()  # the pump, in the pool's nursery, reads it to the end or discards what it leaves
        self.body = body
        self.conn = conn
        self.st = st
        self.sent = False
        self.finished = False  # the end of the body (or its trailers) was sent
        self.broken = False  # the pump gave up: the body cannot be sent again
        self.scope = st.cancel_scope = trio.CancelScope()
        self._moved = Signal()

    @property
    def replayable(self) -> bool:
        """Nothing of the body went upstream, and it can still be sent in full."""
        return not self.sent and not self.broken

    def move(self, conn: H2ClientConnection, st: H2Stream) -> None:
        """Carry on on ``st``: the retry of a refused stream."""
        self.conn = conn
        self.st = st
        st.cancel_scope = self.scope
        self._moved.set()

    def abandon(self) -> None:
        self.scope.cancel()

    async def target(self) -> tuple[H2ClientConnection, H2Stream]:
        """The stream to send on, once there is one; StreamReset if there never will be."""
        while True:
            st = self.st
            if not st.closed:
                return self.conn, st
            if self.sent or type(st.error) is not _Refused:
                raise StreamReset("the upstream stream closed while its request body was being sent")
            await self._moved.wait()


class _Replay:
    """A spliced request that may still be retried, as its downstream stream sees it.

    It stands in for the :class:`Splice` on the downstream stream (the drivers
    call ``data``, ``ended``, ``window``, ``failed`` and ``refuse`` on
    whatever is there; anything else hands the stream back to the splice
    first) while no request body byte has gone upstream and no response head
    has come back. Until then it passes every event on; the first body byte or
    trailers, or a window update after the head, put the splice back, so
    the steady state costs nothing.

    When the upstream refuses the stream it is *parked*: the downstream's
    events are kept, unacknowledged (the client's stream window bounds them),
    until :meth:`resume` splices a new upstream stream and replays them, or
    :meth:`give_up` answers the error.
    """

    __slots__ = ("elsewhere", "events", "headers", "origin", "request_ended", "splice")

    def __init__(self, splice: Splice, origin: Request, headers: Headers, ended: bool) -> None:
        self.splice = splice
        self.origin = origin
        self.headers = headers
        self.request_ended = ended  # the request ended without a body byte
        self.events: list[tuple[bytes | None, int, bool, Headers | None]] | None = None
        self.elsewhere = False  # parked, and offered to the hop to send elsewhere (give_up)
        # Duck-typed: the drivers only call the four methods below.
        splice.down_st.splice = self  # type: ignore[assignment]

    def _detach(self) -> None:
        self.splice.down_st.splice = self.splice

    def data(self, driver: H2Driver, st: H2Stream, data: bytes, size: int, end: bool) -> None:
        if self.events is not None:
            self.events.append((data, size, end, None))
            return
        if data:
            self._detach()  # the body has started: no retry from now on
        elif end:
            self.request_ended = True
        self.splice.data(driver, st, data, size, end)

    def ended(self, st: H2Stream, trailers: Headers | None = None) -> None:
        if self.events is not None:
            self.events.append((None, 0, True, trailers))
            return
        if trailers:
            self._detach()
        else:
            self.request_ended = True
        self.splice.ended(st, trailers)

    def window(self, st: H2Stream) -> None:
        if self.events is None:
            if self.splice.head_sent:
                self._detach()
            self.splice.window(st)

    def failed(self, driver: H2Driver, error: BaseException) -> None:
        self._release()
        self.splice.failed(driver, error)

    def refuse(self, status: int) -> None:
        self._release()
        self._detach()
        self.splice.refuse(status)

    def __getattr__(self, name: str) -> Any:
        # A splice method this stand-in does not know (the drivers grow): the
        # safe default is to give the retry up and let the splice answer.
        if name.startswith("_") or name in _Replay.__slots__:
            raise AttributeError(name)
        self._release()
        self._detach()
        return getattr(self.splice, name)

    def park(self) -> None:
        if self.events is None:  # (parked already: what it kept stays)
            self.events = []

    def _release(self) -> None:
        """Acknowledge whatever was kept while parked: it will never be relayed."""
        events, self.events = self.events, None
        if events:
            down = self.splice.down
            sid = self.splice.down_st.id
            for _, size, _, _ in events:
                if size:
                    acknowledge(down.h2, size, sid)
            down.kick()

    def resume(self, conn: H2ClientConnection) -> H2Stream:
        """Splice the downstream stream to a new stream on ``conn`` and replay what was kept."""
        old = self.splice
        down, down_st = old.down, old.down_st
        st = conn._send_head(self.origin, self.headers, self.request_ended)
        events, self.events = self.events or [], None
        new = Splice(
            down,
            down_st,
            conn,
            st,
            request_ended=self.request_ended,
            head_filter=old.head_filter,
            on_close=old.on_close,
        )
        old.on_close = None
        old.closed = True
        # Whoever watches the exchange (blocks.transport._tap) goes on watching it on the new stream.
        new.request.tap, new.response.tap = old.request.tap, old.response.tap
        for data, size, end, trailers in events:
            if data is None:
                new.ended(down_st, trailers)
            else:
                new.data(down, down_st, data, size, end)
        conn.mark()
        down.mark()
        flush_marked()  # not in a reader's batch: write both connections now
        return st

    def give_up(self, error: BaseException) -> None:
        """Answer the downstream stream with ``error``'s status (as a splice does).

        When the pool could not reach its upstream again (a connect that
        failed), the hop in front may still send the request elsewhere: its
        head filter hears the error while the stream stays parked, and
        either sends it on (:meth:`Upstreams.resplice` takes it as it is: the
        filter returns None) or makes the error head that is answered.
        """
        splice = self.splice
        filtered: Headers | None = None
        if isinstance(error, UpstreamConnectError) and splice.head_filter is not None and not splice.closed:
            self.elsewhere = True
            try:
                filtered = splice.head_filter(error.status, [(ERROR_HEADER, error.error_reason.encode())])
            finally:
                self.elsewhere = False
            if filtered is None:
                return  # sent elsewhere
        self._release()
        self._detach()
        if filtered is not None:
            splice.fail_with(error, filtered)
        else:
            splice.failed(splice.up, error)
