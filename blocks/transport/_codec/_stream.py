"""A validating listener's h2 streams: what makes a request malformed is its stream's error, not the
connection's (RFC 9113 8.1.1). The codec swaps its new streams to this class (see ``make_h2``)."""

from __future__ import annotations

from typing import Any

import h2.events
import h2.exceptions
import h2.stream


class _LengthUncheckedStream(h2.stream.H2Stream):
    """An h2 stream of a validating listener: what makes a request malformed is an error of its stream.

    h2 checks a request's ``content-length`` against its DATA itself, and a
    mismatch or a malformed value fails the whole connection; RFC 9113 8.1.1
    makes it an error of that stream alone. A validating listener checks it
    per stream instead (``H2ServerConnection``), on streams of this class.
    So it does for the HEADERS frames h2's stream state machine would fail
    the connection for (:meth:`receive_headers`).
    """

    def _initialize_content_length(self, headers: Any) -> None:
        pass

    def _track_content_length(self, length: int, end_stream: bool) -> None:
        pass

    def receive_headers(self, headers: Any, end_stream: bool, header_encoding: Any) -> Any:
        """h2's, except that a malformed request's HEADERS frame is left to the listener (RFC 9113 8.1.1).

        h2 raises a connection error for a HEADERS frame after the request
        head without END_STREAM ("trailers must end the stream"), and for a
        block whose pseudo-headers carry a ``:status`` 1xx, which it takes
        for an informational response (in a request head or in trailers).
        Both make the request malformed: a stream error. So, with h2's
        stream state put back where it was (the remote side still open):

        - after the head, the frame is reported as trailers whose
          ``stream_ended`` is None (it did not end the stream, and no
          StreamEnded follows); the listener resets the stream;
        - a request head is taken as a request, its ``:status`` emptied
          so that h2 sees no informational response; validation refuses
          it for the ``:status`` (a response pseudo-header).

        A HEADERS frame on a stream whose remote side is closed stays h2's
        own stream error (STREAM_CLOSED). The common path pays a call and
        the read of the stream's state.
        """
        machine = self.state_machine
        state = machine.state
        try:
            return super().receive_headers(headers, end_stream, header_encoding)
        except h2.exceptions.StreamClosedError:
            raise
        except h2.exceptions.ProtocolError:
            if state not in _REMOTE_OPEN:
                raise
            machine.state = state  # (h2 moved it to CLOSED on some of these)
        if machine.headers_received:
            return [], [h2.events.TrailersReceived(stream_id=self.stream_id, headers=list(headers))]
        neutral = [(name, b"") if name == b":status" else (name, value) for name, value in headers]
        return super().receive_headers(neutral, end_stream, header_encoding)


# Where a HEADERS frame h2 refuses is the stream's error, not the connection's (see receive_headers).
_REMOTE_OPEN = frozenset(
    {h2.stream.StreamState.IDLE, h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_LOCAL}
)
