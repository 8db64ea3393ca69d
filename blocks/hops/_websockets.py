"""The worker's WebSockets, kept by replica, so that the worker can end them with a Close frame rather than cut them.

A WebSocket holds its session (and its replica) for as long as it lives.
When the worker must end it (its replica is drained past its time and its
sessions end, or the worker itself drains), resetting its streams would
give the client close code 1006 (abnormal) and no reason. Instead each
WebSocket the worker relays gets a :class:`~blocks.transport.WebSocketEnd`
as its exchange's tee, which watches the replica -> client frames and can
put a Close frame between two of them (docs/websocket.md, "Ending a
WebSocket"). The close code is **1001 (going away)**: the endpoint the
client reached is leaving, and a new session (a new connection) is what
to do next. It is a code of RFC 6455 itself, which every client library
accepts; 1012 (service restart) is only in IANA's registry, and a client
that knows only the RFC's codes fails a connection closed with it (a
protocol error, 1002) instead of reporting it.

Cost: one ``dispatched`` call per request, a comparison for the ones that
are not WebSockets. The frames of a WebSocket are tracked on its replica
-> client direction only (a header parsed per frame, no payload copied).
"""

from __future__ import annotations

import logging

import trio

from blocks.hops._hop import Exchange, Feature, Forward
from blocks.transport.streams import WebSocketEnd

__all__ = ["END_TIMEOUT", "GOING_AWAY", "WebSockets"]

log = logging.getLogger("blocks.hops")

GOING_AWAY = 1001
"""The close code the worker ends a WebSocket with (RFC 6455 7.4.1: the endpoint is going away)."""

END_TIMEOUT = 2.0
"""Seconds a WebSocket being ended gets to reach a frame boundary and send its Close frame; then it is reset."""


class WebSockets(Feature):
    """dispatched: a WebSocket (``request.protocol == b"websocket"``) is kept, by replica, until it ends.

    Last in the worker's stack, so that a tee a feature before it put on
    the exchange is kept (fed through the WebSocket's). :meth:`end` ends
    them with a Close frame (code :data:`GOING_AWAY`), ``open`` holds those
    relayed now; ``ended`` counts those ended so, ``cut`` those that had to
    be reset (no frame boundary or no room for the Close within
    :data:`END_TIMEOUT`).
    """

    def __init__(self) -> None:
        self.open: dict[str, set[WebSocketEnd]] = {}
        self.ended = 0
        self.cut = 0

    def __repr__(self) -> str:
        return f"<WebSockets open={sum(map(len, self.open.values()))} ended={self.ended} cut={self.cut}>"

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        request = exchange.request
        if request.protocol == b"websocket":
            replica = exchange.replica or ""
            ws = WebSocketEnd(
                request.wire, inner=exchange.tee, on_closed=self._closed, replica=replica, session=exchange.session
            )
            exchange.tee = ws
            group = self.open.get(replica)
            if group is None:
                group = self.open[replica] = set()
            group.add(ws)

    def _closed(self, ws: WebSocketEnd) -> None:
        group = self.open.get(ws.replica or "")
        if group is not None:
            group.discard(ws)
            if not group:
                del self.open[ws.replica or ""]

    def count(self, replica: str | None = None) -> int:
        """WebSockets relayed now: to ``replica``, or in all."""
        if replica is None:
            return sum(map(len, self.open.values()))
        return len(self.open.get(replica, ()))

    async def end(
        self, replica: str | None, reason: str, *, session_reason: str | None = None, timeout: float = END_TIMEOUT
    ) -> tuple[int, int]:
        """End the WebSockets to ``replica`` (None: all of them) with a Close frame; ``(closed, cut)``.

        ``reason`` is the Close frame's reason (at most 123 bytes of UTF-8);
        ``session_reason``, if given, that of a WebSocket of a session. Waits
        up to ``timeout`` for them to close, then resets those left.
        """
        if replica is None:
            ending = [ws for group in self.open.values() for ws in group]
        else:
            ending = list(self.open.get(replica, ()))
        if not ending:
            return 0, 0
        for ws in ending:
            ws.end(GOING_AWAY, session_reason if session_reason is not None and ws.session is not None else reason)
        with trio.move_on_after(timeout):
            for ws in ending:
                await ws.wait_closed()
        cut = 0
        for ws in ending:
            if not ws.is_closed:
                cut += 1
                ws.cut()
        self.ended += len(ending) - cut
        self.cut += cut
        if cut:
            log.warning("%d of %d WebSockets had no Close frame within %gs: reset", cut, len(ending), timeout)
        return len(ending) - cut, cut
