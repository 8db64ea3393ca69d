"""What the hyper-h2 codec's DATA fast paths use beside the class.

The fast paths themselves are :class:`~blocks.transport._codec.H2Codec`'s
methods (``receive_data``, ``send_data``, ``acknowledge_received_data``;
its docstring says when they apply). Here: the h2 states they take,
compared by identity; the DATA flags they leave to h2; the joining of a
read's runs per stream (:func:`_per_stream`); a WINDOW_UPDATE frame's bytes.
"""

from __future__ import annotations

from typing import Any

import h2.connection
import h2.events
import h2.stream

# The states the DATA fast paths take (compared by identity: an enum's hash is a Python call).
_CLIENT_OPEN = h2.connection.ConnectionState.CLIENT_OPEN
_SERVER_OPEN = h2.connection.ConnectionState.SERVER_OPEN
_STREAM_OPEN = h2.stream.StreamState.OPEN  # a stream takes and sends DATA without END_STREAM, and stays so
_HALF_CLOSED_LOCAL = h2.stream.StreamState.HALF_CLOSED_LOCAL  # takes DATA, and stays so
_HALF_CLOSED_REMOTE = h2.stream.StreamState.HALF_CLOSED_REMOTE  # sends DATA, and stays so
_PADDED_OR_END = 0x08 | 0x01  # DATA flags the fast path leaves to h2


def _per_stream(events: list[Any]) -> list[Any]:
    """A read's events, each stream's DATA events joined into its first, where nothing of that stream
    (its end, a reset, trailers, a window update) or of the connection came between.

    Streams sharing a connection interleave their frames (a replica streaming
    tokens to many clients at once), and a run is one stream's frames in a
    row; this joins the rest. Order within a stream is kept, and so is order
    against everything that concerns it; only one stream's bytes may come
    before another's, which streams allow (RFC 9113 5.1: each is its own).
    """
    joined: list[Any] = []
    into: dict[int, Any] = {}  # stream id -> its DATA event that may take more
    parts: dict[int, tuple[Any, list[bytes]]] = {}  # id of an event that took more -> it, and its data in pieces
    for ev in events:
        sid = getattr(ev, "stream_id", 0)
        if type(ev) is h2.events.DataReceived and ev.stream_ended is None:
            first = into.get(sid)
            if first is not None:
                if id(first) in parts:
                    parts[id(first)][1].append(ev.data)
                else:
                    parts[id(first)] = (first, [first.data, ev.data])
                first.flow_controlled_length += ev.flow_controlled_length
                continue
            into[sid] = ev
        elif sid:
            into.pop(sid, None)  # the stream's other news stays after its bytes
        else:
            into.clear()  # the connection's (SETTINGS, GOAWAY, a window update of its own): after everything
        joined.append(ev)
    for ev, pieces in parts.values():
        ev.data = b"".join(pieces)
    return joined


def _window_update(stream_id: int, increment: int) -> bytes:
    """A WINDOW_UPDATE frame: length 4, type 8, no flags, the stream id; the increment."""
    return (4 << 48 | 8 << 40 | stream_id).to_bytes(9) + increment.to_bytes(4)
