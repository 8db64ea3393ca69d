"""Splicing: one downstream h2 stream joined to one upstream h2 stream.

The fast path of every h2 -> h2 hop. When a hop can decide where a request
goes without waiting (route in memory, a pooled connection with a free
stream slot), the listener does not start a task for it: the request head is
sent upstream at once, and from then on each frame is relayed by the reader
that receives it, straight into the other connection's state machine. No
task, no cancel scope, no queue per request; the hop's work is the two h2
state machines and nothing else. Anything that has to wait (a connection
being opened, a queue) takes the task path instead.

Invariants:

- Flow control is end to end. Data received on one side is acknowledged to
  its sender only once it has been handed to the other side's state
  machine; what the other side's window cannot take yet waits in
  ``Pipe.pending`` and goes when that window opens. So each splice holds at
  most one stream window of data per direction, and a slow reader throttles
  only its own sender.
- Every byte received is acknowledged exactly once (see :mod:`blocks.transport._h2`):
  as it is relayed, or, when the splice closes with bytes still pending
  (either side failed, or the exchange was refused), by ``_close``, which
  every way of ending goes through.
- A splice ends exactly once (``on_close`` runs once): when both directions
  delivered their end, or when either side fails. A failure on one side
  resets the other; an upstream failure before the response head becomes an
  error response (502, or 504 for a timeout) instead. A request the listener
  finds malformed (a body that disagrees with its ``content-length``, bad
  trailers) cancels the upstream stream and goes no further; the listener
  ends the downstream stream (:meth:`Splice.malformed`).
- An upstream that ends its response and then resets with ``NO_ERROR``
  (RFC 9113 8.1: it answered early and wants no more of the request) has
  not failed: what it sent is delivered in full, then the downstream
  stream ends and is reset with ``NO_ERROR`` in turn if its request had not.
  So is any end of the upstream stream once its END_STREAM came (another
  reset, the connection lost), as on the task path, where a response body
  that ended is delivered whatever follows.
- The hop may end an exchange cleanly itself (:meth:`Splice.end_response`:
  a WebSocket's Close frame): its own bytes go last in the response pipe,
  acknowledged to nobody, with END_STREAM, and the upstream stream is
  cancelled, which the splice then treats as the early answer above.
  What the upstream sent past the end is acknowledged and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from blocks.errors import BlocksError
from blocks.fields import ERROR_HEADER
from blocks.http import BytesBody, Headers, Response, error_response
from blocks.transport._codec import ErrorCodes, ProtocolError
from blocks.transport._h2 import acknowledge
from blocks.transport._pipe import EndingPipe, Pipe, Until

if TYPE_CHECKING:
    from blocks.transport._h2 import H2Driver, H2Stream

log = logging.getLogger("blocks.h2")

_CANCEL = ErrorCodes.CANCEL
_NO_ERROR = ErrorCodes.NO_ERROR
_STATUS = {code: b"%d" % code for code in range(100, 600)}

HeadFilter = Callable[[int, Headers], "Headers | None"]
"""Rewrites the response head on its way downstream (Server-Timing, ...); None: the
hop took the exchange over (it sent the request again elsewhere), drop this head. On the
hop's own error answer, a ``:status`` field first in what it returns changes that
answer's status (the hop re-classified its error)."""


class Sink(Protocol):
    """The reader of an upstream stream that no downstream stream waits on (a mirror's shadow).

    The request went up whole with its head, and the connection's reader
    hands the response to the sink as it would to a splice, in its batch,
    with no task: ``head``, then ``data`` (``end`` with the last frame) or
    ``ended`` (trailers, or a bare END_STREAM), or ``failed`` (reset, timed
    out, connection lost). The sink gives each DATA frame's window back and
    ends the stream (``finish_stream``, or ``reset``) when it is done with it.
    """

    head_sent: bool  # the response head came (the stream was processed: never sent again)

    def opened(self, conn: H2Driver, st: H2Stream) -> None:
        """The request went up on ``st`` of ``conn``."""

    def head(self, status: int, headers: Headers, ended: bool) -> None: ...

    def data(self, driver: H2Driver, st: H2Stream, data: bytes, size: int, end: bool) -> None: ...

    def ended(self, st: H2Stream, trailers: Headers | None = None) -> None: ...

    def window(self, st: H2Stream) -> None: ...

    def failed(self, driver: H2Driver, error: BaseException) -> None: ...


class Splice:
    """A downstream (server) stream joined to an upstream (client) stream."""

    __slots__ = (
        "closed",
        "cut",
        "down",
        "down_st",
        "head_filter",
        "head_sent",
        "on_close",
        "request",
        "response",
        "up",
    )

    def __init__(
        self,
        down: H2Driver,
        down_st: H2Stream,
        up: H2Driver,
        up_st: H2Stream,
        *,
        request_ended: bool,
        head_filter: HeadFilter | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.down = down
        self.down_st = down_st
        self.up = up
        self.request = Pipe(down, down_st, up, up_st)
        self.response = Pipe(up, up_st, down, down_st)
        self.head_filter = head_filter
        self.on_close = on_close
        self.head_sent = False
        self.closed = False
        self.cut = False  # the upstream refused the rest of the request: reset downstream with NO_ERROR at the end
        if request_ended:
            self.request.ended = self.request.done = True
            up_st.local_ended = True
        down_st.splice = self
        up_st.splice = self

    # -- events, called by the driver that received them ---------------------------------

    def data(self, driver: H2Driver, st: H2Stream, data: bytes, size: int, end: bool) -> None:
        pipe = self.request if st is self.down_st else self.response
        if self.closed or pipe.done:
            if self.cut and not self.closed:
                # The upstream refused the rest of the request: kept until our reset
                # (then only the connection's window reopens), so the client stops.
                pipe.held += size
            else:
                acknowledge(driver.h2, size, st.id)
            return
        try:
            pipe.feed(data, size, end)
        except ProtocolError:
            self._abort()
            return
        # (_kick, inlined: a token stream comes here once per read)
        self.down.mark()
        self.up.mark()
        if pipe.done:  # (nothing else can complete the exchange)
            self._maybe_complete()

    def ended(self, st: H2Stream, trailers: Headers | None = None) -> None:
        pipe = self.request if st is self.down_st else self.response
        if self.closed or pipe.done:
            self._maybe_complete()
            return
        try:
            pipe.end(trailers)
        except ProtocolError:
            self._abort()
            return
        self._kick()
        self._maybe_complete()

    def window(self, st: H2Stream) -> None:
        """``st``'s send window may have opened: flush the pipe that writes to it."""
        pipe = self.response if st is self.down_st else self.request
        if self.closed or not pipe.pending:
            return
        try:
            pipe.flush()
        except ProtocolError:
            # h2 read the whole batch before we see its events: it has closed
            # ``st`` for a RST_STREAM whose event comes later in this batch, and
            # that event decides (an early answer is no failure). What did not
            # go stays pending until then.
            return
        self._kick()
        self._maybe_complete()

    def head(self, status: int, headers: Headers, ended: bool) -> None:
        """The upstream's response head arrived."""
        if self.closed:
            return
        if self.head_filter is not None:
            filtered = self.head_filter(status, headers)
            if filtered is None:
                return  # the hop sends the request elsewhere instead (Upstreams.resplice)
            headers = filtered
        head = [(b":status", _STATUS.get(status) or b"%d" % status)]
        head += headers
        try:
            self.down.h2.send_headers(self.down_st.id, head, end_stream=ended)
        except ProtocolError:
            self._abort()
            return
        self.head_sent = True
        if ended:
            if self.response.tap is not None:
                self.response.tap(b"", True, None)
            self.response.ended = self.response.done = True
            self.down_st.local_ended = True
        self.down.mark()
        self._maybe_complete()

    def failed(self, driver: H2Driver, error: BaseException) -> None:
        """One side's stream died (reset by its peer, timed out, connection lost)."""
        if self.closed:
            return
        if driver is self.up and self.response.ended:
            self._answered_early()
            return
        self.closed = True
        if driver is self.up:
            self._upstream_failed(error)
        else:
            self.up.reset(self.response.src_st, _CANCEL)
        self._close()

    def fail_with(self, error: BaseException, headers: Headers) -> None:
        """As :meth:`failed` for the upstream side, answering ``headers`` as they are: the error head the
        hop's ``head_filter`` already made for ``error`` (it is not filtered twice)."""
        if self.closed:
            return
        self.head_filter = lambda status, fields: headers
        self.failed(self.up, error)

    def refuse(self, status: int) -> None:
        """End the exchange from our side: cancel the upstream stream, answer ``status`` downstream.

        If the response head already went, the downstream stream is reset instead.
        """
        if self.closed:
            return
        self.closed = True
        self.up.reset(self.response.src_st, _CANCEL)
        self._answer(status, BlocksError(status=status).error_reason)
        self._close()

    def end_response(self, tail: bytes, until: Until | None = None) -> bool:
        """End the exchange from our side, cleanly: ``tail`` (bytes of the hop's own) ends the response.

        For a tunnel the hop must close itself (a WebSocket's Close frame,
        :mod:`blocks.transport._wsend`). With ``until``, the upstream's bytes
        go on until the point it finds; without, the response ends after
        what was received so far. Then ``tail`` and END_STREAM go
        downstream (as the window allows), the upstream stream is
        cancelled, and the downstream stream, if its request had not ended,
        is reset with NO_ERROR after the END_STREAM (RFC 9113 8.1), as for
        an upstream that answered early. False, having done nothing, before
        the response head went downstream (nothing to end cleanly yet); True
        too if the response had ended or the splice closed already.
        """
        if self.closed or self.response.ended or type(self.response) is EndingPipe:
            return True
        if not self.head_sent:
            return False
        pipe = self.response = EndingPipe(self.response, tail, until)
        try:
            if until is None:
                pipe.stop()
        except ProtocolError:
            self._abort()
        self.down.kick()  # (outside any reader's batch: a task asked)
        return True

    def malformed(self, headers: Headers) -> Response | None:
        """The request is malformed: cancel the upstream stream; the 400 to send downstream, if any.

        Only the listener calls it (``RequestChecks.malformed``, the one
        place that ends a malformed request's stream, which then sends the
        400 and the RST_STREAM). ``headers`` say why (``proxyblocks-error``);
        the 400's head goes through ``head_filter``. None once the response
        head went: then the reset alone ends the stream.
        """
        if self.closed:
            return None
        self.closed = True
        self.up.reset(self.response.src_st, _CANCEL)
        answer = None if self.head_sent else self._error(400, headers)
        self._close()
        return answer

    # -- internals ---------------------------------------------------------------------

    def _answered_early(self) -> None:
        """The upstream sent its whole response, then its stream went: RST_STREAM(NO_ERROR) (RFC 9113
        8.1: it wants no more of the request), or any reset or loss once its END_STREAM came.

        What it sent is ours to deliver: the response pipe goes on as the
        downstream window allows, as the task path delivers a response that
        ended. The request ends here; the downstream stream is reset with
        NO_ERROR after the response's end if its request had not ended, and
        what the client sent meanwhile is given back only then.
        """
        request = self.request
        if not request.done:
            request.done = True
            self.cut = not request.ended
        self._maybe_complete()

    def _upstream_failed(self, error: BaseException) -> None:
        down, st = self.down, self.down_st
        if st.closed or down.closed:
            return
        if isinstance(error, BlocksError):
            self._answer(error.status, error.error_reason)
        else:
            self._answer(502, "upstream_reset")

    def _answer(self, status: int, reason: str) -> None:
        """An error response downstream in place of the upstream's (a reset if its head went).

        Its head goes through ``head_filter`` with ``proxyblocks-error: REASON``
        (the hop adds its name and its Server-Timing entries).
        """
        down, st = self.down, self.down_st
        if st.closed or down.closed:
            return
        if self.head_sent:
            down.reset(st, _CANCEL)
            return
        response = self._error(status, [(ERROR_HEADER, reason.encode())])
        assert isinstance(response.body, BytesBody)
        head = [(b":status", _STATUS[response.status]), *response.headers]
        try:
            down.h2.send_headers(st.id, head)
            down.h2.send_data(st.id, response.body.data, end_stream=True)
            st.sent += len(response.body.data)
        except ProtocolError:
            down.reset(st, _CANCEL)
            return
        # This may run outside any reader's batch (the timeout sweeper): flush now.
        down.kick()
        if self.request.done:
            down.finish_stream(st)
        else:
            down.reset(st, _NO_ERROR)

    def _error(self, status: int, headers: Headers) -> Response:
        """This hop's error answer in place of the upstream's, its head through ``head_filter``."""
        if self.head_filter is not None:
            headers = self.head_filter(status, headers) or headers
            if headers and headers[0][0] == b":status":
                status, headers = int(headers[0][1]), headers[1:]
        return error_response(status, headers)

    def _abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.down.reset(self.down_st, _CANCEL)
        self.up.reset(self.response.src_st, _CANCEL)
        self._close()

    def _kick(self) -> None:
        # Always called from a reader's batch: flushed when the batch ends.
        self.down.mark()
        self.up.mark()

    def _maybe_complete(self) -> None:
        if self.closed or not (self.request.done and self.response.done):
            return
        # Both ends delivered; the upstream's own end arrived (response done), ours was sent.
        self.closed = True
        if self.cut:
            self.down.reset(self.down_st, _NO_ERROR)  # after the END_STREAM it queued: RFC 9113 8.1
        else:
            self.down.finish_stream(self.down_st)
        self.up.finish_stream(self.response.src_st)
        self._close()

    def _close(self) -> None:
        self.request.release()
        self.response.release()
        callback, self.on_close = self.on_close, None
        if callback is not None:
            try:
                callback()
            except Exception:  # (it may run a user's tee): the splice is closed all the same
                log.exception("a splice's close callback failed")
