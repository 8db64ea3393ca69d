"""What the HTTP/1.1 client and server sides share: h11 on a trio stream."""

from __future__ import annotations

from typing import Any

import h11
import trio

from blocks.errors import StreamReset
from blocks.http import Body


class H1Stream:
    """An ``h11.Connection`` on a trio stream, read one event at a time."""

    __slots__ = ("conn", "stream")

    def __init__(self, stream: trio.abc.Stream, conn: h11.Connection) -> None:
        self.stream = stream
        self.conn = conn

    async def next_event(self) -> Any:
        """The next h11 event, reading from the stream as h11 needs more bytes."""
        conn = self.conn
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await self.stream.receive_some(65536))  # type: ignore[arg-type]


class H1Body(Body):
    """A message body read from an h1 connection as its consumer asks.

    Subclasses say who is on the other end (``peer``) and what happens when
    the body is over (:meth:`finished`: ``complete`` is False when it broke
    or was abandoned, and the connection cannot be reused).
    """

    __slots__ = ("_broken", "_done", "_h1")

    peer = "peer"

    def __init__(self, h1: H1Stream, length: int | None) -> None:
        super().__init__(length)
        self._h1 = h1
        self._done = False
        self._broken = False

    @property
    def ended(self) -> bool:
        return self._done and not self._broken

    def finished(self, complete: bool) -> None:
        self._done = True
        self._broken = not complete

    async def receive(self) -> bytes:
        if self._done:
            if self._broken:
                # Never b"" after a break: that would pass a cut body off as whole.
                raise StreamReset(f"the body from the {self.peer} was cut short")
            return b""
        try:
            event = await self._h1.next_event()
        except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.finished(False)
            raise StreamReset(f"{self.peer} broke the body: {exc!r}") from exc
        if type(event) is h11.Data:
            return bytes(event.data)
        if type(event) is h11.EndOfMessage:
            self.trailers = list(event.headers) or None
            self.finished(True)
            return b""
        self.finished(False)
        raise StreamReset(f"{self.peer} closed the connection mid-body")

    async def aclose(self) -> None:
        if not self._done:
            self.finished(False)
