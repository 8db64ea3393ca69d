"""What an HTTP/2 server connection checks of each request after its head, and how a malformed one ends.

:class:`RequestChecks` is the part of
:class:`~blocks.transport._h2server.H2ServerConnection` that holds a request
body to ``max_request_body`` and to its ``content-length``, checks its
trailers, and ends a malformed request's stream in one place,
:meth:`RequestChecks.malformed` (RFC 9113 8.1.1): a 400 without END_STREAM
if no response started, then RST_STREAM(PROTOCOL_ERROR), whatever made it
malformed and whatever path it took.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from blocks.errors import BadRequest, BlocksError, PayloadTooLarge, StreamReset, error_field
from blocks.fields import ERROR_HEADER
from blocks.http import BytesBody, Response, error_response
from blocks.transport._codec import ErrorCodes, ProtocolError
from blocks.transport._h2 import H2Driver, H2Stream, acknowledge
from blocks.transport._validate import check_header_list_size, validate_trailers

if TYPE_CHECKING:
    from blocks.transport.listener import ListenerConfig

log = logging.getLogger("blocks.listener")

_STATUS = {code: b"%d" % code for code in range(100, 600)}
_PROTOCOL_ERROR = ErrorCodes.PROTOCOL_ERROR


class RequestChecks(H2Driver):
    """A server connection's checks of request bodies and trailers (see the module's docstring)."""

    config: ListenerConfig
    client: str
    body_limit: int | None

    def _count_reset(self) -> bool:
        """One more stream reset before it was finished; True if that closed the connection (the server's)."""
        raise NotImplementedError

    def body_refused(self, st: H2Stream, end: bool, size: int) -> bool:
        received = st.received
        limit = self.body_limit
        if limit is not None and received > limit and not st.tunnel:
            self._refuse_body(st, size, PayloadTooLarge(f"request body over {limit} bytes"))
            return True
        expected = st.expected
        if expected is not None and (received > expected or (end and received != expected)):
            # Malformed, and never relayed: a hop behind us would see it too.
            if size:
                acknowledge(self.h2, size, st.id)
            self.malformed(st, _length_mismatch(received, expected))
            return True
        return False

    def _refuse_body(self, st: H2Stream, size: int, error: StreamReset) -> None:
        """Stop ``st``'s request body here (over the limit, too slow): ``error``'s status downstream if no
        response started, else a reset."""
        if size:
            acknowledge(self.h2, size, st.id)
        if st.splice is not None:
            st.splice.refuse(error.status)
        elif st.body is not None and st.body.error is None:
            st.body.fail(error)

    def _on_trailers(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is None:
            if ev.stream_ended is None:  # the codec left it open for us (see malformed)
                with contextlib.suppress(ProtocolError):
                    self.h2.reset_stream(ev.stream_id, _PROTOCOL_ERROR)
            return
        try:
            if ev.stream_ended is None:
                raise BadRequest("a HEADERS frame after the request head without END_STREAM")
            config = self.config
            check_header_list_size(ev.headers, config.max_header_list_size, config.max_header_count)
            validate_trailers(ev.headers)
            if st.expected is not None and st.received != st.expected:
                raise _length_mismatch(st.received, st.expected)
        except BlocksError as exc:
            if exc.status == 431:
                # Well-formed, only too big: refused as an oversized body is (a 431 if no
                # response started, else a reset), its upstream stream cancelled.
                self._refuse_body(st, 0, StreamReset(str(exc), status=431))
            else:
                self.malformed(st, exc)
            return
        self.on_trailers(ev)

    def malformed(self, st: H2Stream, error: BlocksError) -> None:
        """End a malformed request's stream (RFC 9113 8.1.1): a 400 if none started, then RST_STREAM(PROTOCOL_ERROR).

        Invariant: a malformed request's stream ends with RST_STREAM(PROTOCOL_ERROR)
        at the edge, whatever made it malformed and whatever path it took. This
        is the one place that ends one. What makes a request malformed: its
        head (:func:`validate_request_head`'s 400s, or END_STREAM on a head
        whose ``content-length`` promises a body), a body that disagrees with
        its ``content-length`` (DATA past it, or an end short of it), its
        trailers (:func:`validate_trailers`, or a body short of its length),
        a HEADERS frame after its head without END_STREAM (the codec reports
        it as trailers whose ``stream_ended`` is None). The path it took:
        none yet (its head), a handler, which is cancelled as if the client
        had reset the stream, or a splice, whose upstream stream is cancelled.
        Nothing of it goes further: the frame that made it malformed is not
        relayed, the request body fails for whoever reads it, and what a hop
        behind already has is cancelled.

        Unless the response head already went, a 400 goes first, saying why
        (``proxyblocks-error: bad_request; hop=NAME``), without END_STREAM: the
        reset, not the 400, ends the stream. Its body goes if the stream's send
        window takes it now; else the head alone.
        """
        if st.closed or self.closed:
            return
        log.debug("malformed request from %s on stream %d: %s", self.client, st.id, error)
        hop = self.config.hop
        splice = st.splice
        answer: Response | None = None
        if splice is not None:
            reason = BadRequest.error_reason
            why = error_field(reason, hop) if hop is not None else (ERROR_HEADER, reason.encode())
            answer = splice.malformed([why])
        elif st.head is None:
            answer = error_response(400, hop=hop)
        body = st.body
        if body is not None:
            body.fail(error if isinstance(error, StreamReset) else StreamReset(str(error), status=400))
        if answer is not None:
            self._send_malformed_answer(st, answer)
        self.reset(st, _PROTOCOL_ERROR)
        # "MadeYouReset" (CVE-2025-8671): a reset the client provokes with a
        # malformed request frees its stream slot as its own reset would.
        self._count_reset()

    def _send_malformed_answer(self, st: H2Stream, answer: Response) -> None:
        """``answer``'s head, and its body if the windows take it now, neither with END_STREAM."""
        conn = self.h2
        data = answer.body.data if isinstance(answer.body, BytesBody) else b""
        try:
            conn.send_headers(st.id, [(b":status", _STATUS[answer.status]), *answer.headers])
            if data and len(data) <= min(conn.local_flow_control_window(st.id), conn.max_outbound_frame_size):
                conn.send_data(st.id, data)
                st.sent += len(data)
        except ProtocolError:
            pass  # the reset that follows ends the stream all the same


def _length_mismatch(received: int, expected: int) -> StreamReset:
    return StreamReset(f"body of {received}+ bytes where content-length says {expected}", status=400)
