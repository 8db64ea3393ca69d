"""What the HTTP/2 drivers keep per stream, and the books of what they received.

:class:`H2Stream` is a stream's state beside the codec's; :func:`acknowledge`
the one way a received DATA byte goes back to the peer; :class:`H2ConnectionStatistics`
a connection's inbound books; :data:`Relay` the fast path a hop offers its
listener. The invariants they keep are the package's (:mod:`blocks.transport._h2`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from blocks._sync import Signal
from blocks.http import StreamBody, Wire
from blocks.transport._codec import Codec, ProtocolError

if TYPE_CHECKING:
    from blocks.http import Request
    from blocks.transport._h2._driver import H2Driver
    from blocks.transport._splice import Splice


def acknowledge(conn: Codec, size: int, sid: int) -> None:
    """Give ``size`` received DATA bytes of stream ``sid`` back to the peer.

    The one way proxyblocks acknowledges what it received: the connection's
    window always, the stream's too while the stream is open (the codec skips
    it for a closed stream). The caller sees to it that the bytes go out
    (``kick``, ``mark`` or :meth:`H2Driver.send_soon`).
    """
    try:
        conn.acknowledge_received_data(size, sid)
    except ProtocolError:
        pass  # only for a stream id the codec never saw, which received DATA cannot name


@attrs.frozen
class H2ConnectionStatistics:
    """One HTTP/2 connection's streams and inbound flow-control books.

    ``inbound_window`` is what the peer may still send before it waits for
    a WINDOW_UPDATE (h2 batches them, so it dips to half the window in
    normal use). ``unacknowledged`` is what was received and not yet given
    back: bytes held by bodies and splices. Once the connection has no
    streams it is 0, or the connection leaks window.
    """

    streams: int
    inbound_window: int
    unacknowledged: int


class H2Stream(Wire):
    """Per-stream state the drivers keep beside h2's own; the :class:`~blocks.http.Wire` of its body
    bytes: ``received`` (DATA from the peer, counted as it arrives), ``sent`` (DATA handed to the codec)."""

    __slots__ = (
        "body",
        "body_deadline",
        "cancel_scope",
        "closed",
        "error",
        "expected",
        "head",
        "id",
        "local_ended",
        "remote_ended",
        "signal",
        "splice",
        "stalled_since",
        "timed",
        "tunnel",
        "window",
    )

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        self.body: StreamBody | None = None  # inbound body, fed by the reader
        self.head: Any = None  # client: the response head once it arrived; server: the one being sent
        self.error: BaseException | None = None  # client: why no head will come
        self.signal: Signal | None = None  # client: woken when the head arrives or the stream dies
        self.window: Signal | None = None  # woken when send window may have opened
        self.cancel_scope: trio.CancelScope | None = None
        self.closed = False
        self.local_ended = False
        self.remote_ended = False
        self.received = 0
        self.sent = 0
        self.tunnel = False  # server side: an extended CONNECT (its bytes are a stream, not a body)
        self.expected: int | None = None  # the declared content-length (server side, when counted)
        self.stalled_since: float | None = None  # since when sending on it waits for a window or the writer
        self.body_deadline: float | None = None  # server side: when its request body must have ended
        self.splice: Splice | None = None  # set when the stream is joined to another (fast path)
        self.timed = False  # client: the pool's response clock starts when the request ends (local_end)


Relay = Callable[["Request", "H2Driver", H2Stream, bool], bool]
"""The fast path a hop may offer its listener: ``relay(request, driver, stream,
request_ended)`` splices the stream upstream and returns True, or returns
False (nothing done) to let the handler task take the request."""
