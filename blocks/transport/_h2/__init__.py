"""The part of an HTTP/2 connection that clients and servers share.

Theory of operation. One :class:`H2Driver` owns one HTTP/2 codec (a
:class:`~blocks.transport._codec.Codec`: hyper-h2's state machine, behind a
seam that a second codec can fill) on one trio stream, and two tasks: the role's reader loop (bytes in, events
out) and :meth:`H2Driver.writer`, which sends what the state machine queued.
Stream tasks never touch the socket: they call into the state machine (which
never blocks) and ``kick()`` the writer, so no stream ever waits on another
stream's bytes. Readers go one better: at the end of each batch they write
every connection the batch touched with one non-blocking ``os.write``
(:func:`flush_marked`), and only what the socket does not take goes to the
writer task. Bytes are never reordered: a direct write happens only while
the writer has nothing pending. When the other end of a direct write is a
connection of this process whose reader waits (hops sharing a process),
that end is read and dispatched at once, in the same batch
(:meth:`H2Driver._take_local`), instead of after its reader's wake-up.

Invariants:

- Outbound DATA never exceeds the stream's or the connection's send window:
  :meth:`H2Driver.send_data` waits on a per-stream signal that window
  updates, settings changes and stream closes all set.
- Every DATA byte received is acknowledged exactly once, whatever becomes
  of its stream, and always through :func:`acknowledge`. A byte is held by
  exactly one owner until then: the stream's
  :class:`~blocks.http.StreamBody` (given back as the consumer reads it, or
  when the body fails or is discarded), a splice's pipe (given back as the
  other side's window takes it, or when the splice closes), a parked retry,
  or nobody (given back at once). So a slow reader holds at most its own
  stream window, and a dead stream holds nothing:
  :meth:`H2Driver.statistics` shows ``unacknowledged`` back at 0 once a
  connection's streams are gone.
- The connection window is opened wide at start (``connection_window``),
  so that streams do not compete for it.

Where each piece is:

- ``_driver``: :class:`H2Driver`, its reader and writer, and the batch a
  reader ends with (:func:`flush_marked`, :func:`in_batch`), whose state
  the driver's methods write;
- ``_stream``: what the drivers keep per stream (:class:`H2Stream`), the one
  way received DATA goes back (:func:`acknowledge`), a connection's books
  (:class:`H2ConnectionStatistics`), and a hop's fast path (:data:`Relay`).
"""

from blocks.transport._h2._driver import BACKLOG_HIGH, MAX_WINDOW, RECEIVE_SIZE, H2Driver, flush_marked, in_batch
from blocks.transport._h2._stream import H2ConnectionStatistics, H2Stream, Relay, acknowledge

__all__ = [
    "BACKLOG_HIGH",
    "MAX_WINDOW",
    "RECEIVE_SIZE",
    "H2ConnectionStatistics",
    "H2Driver",
    "H2Stream",
    "Relay",
    "acknowledge",
    "flush_marked",
    "in_batch",
]
