"""The record of closed streams, bounded: how many a connection remembers (:data:`CLOSED_STREAMS`),
and how a stream it forgot is taken (for one we reset)."""

from __future__ import annotations

from typing import Any

CLOSED_STREAMS = 256
"""Closed streams a connection remembers (h2: 65,536, 7.5 MiB per busy connection; here about 17 KiB).

Remembering a closed stream only decides how a late HEADERS frame on it is
answered: a connection error if the peer had ended the stream, else a
stream error. A forgotten stream is taken for one we reset (see
:class:`_ClosedStreams`), so any late frame on it is a stream error or
ignored, and its DATA still counted and given back (docs/limits.md).
"""


class _ClosedStreams(dict[int, Any]):
    """h2's record of how each closed stream closed (``H2Connection._closed_streams``), bounded.

    Past ``limit`` the oldest close is forgotten, and ``forgotten`` keeps the
    highest id forgotten so far, per parity: an id at or under it that is not
    remembered may be a stream we reset, whose late frames RFC 9113 5.1 says
    to ignore, not one never opened. A dict: two thirds of h2's OrderedDict.
    """

    __slots__ = ("forgotten", "limit")

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.forgotten = [0, 0]

    def __setitem__(self, stream_id: int, closed_by: Any) -> None:
        super().__setitem__(stream_id, closed_by)
        if len(self) > self.limit:
            oldest = next(iter(self))
            del self[oldest]
            parity = oldest & 1
            if oldest > self.forgotten[parity]:
                self.forgotten[parity] = oldest
