"""Writing an HTTP/1.1 response: its head, then its body, every write on the connection's stall clock
(:class:`_Clock`), a piece at a time."""

from __future__ import annotations

import http
import math

import h11
import trio

from blocks._sync import one_error
from blocks.http import HOP_BY_HOP, Body, BytesBody, Response, Wire

_REASONS: dict[int, bytes] = {}
# A write to a client is on the stall clock (stall_timeout, see _Clock), which
# restarts with every piece of at most _PIECE bytes written: a reader that
# takes a piece per stall_timeout is never cut, and a big chunk is no one long
# write. A response's first _DEADLINE_WRITES writes are timed by moving a
# deadline (two moves a write, each about half a checkpoint); a longer one is
# watched by a task from there on (a nursery and a task once, about a dozen
# checkpoints, then two attribute writes a write).
_PIECE = 64 * 1024
_DEADLINE_WRITES = 16


def _response_head(response: Response, close: bool) -> h11.Response:
    headers = [(n, v) for n, v in response.headers if n not in HOP_BY_HOP]
    if close:
        headers.append((b"connection", b"close"))
    reason = _REASONS.get(response.status)
    if reason is None:
        try:
            reason = http.HTTPStatus(response.status).phrase.encode()
        except ValueError:
            reason = b""
        _REASONS[response.status] = reason
    return h11.Response(status_code=response.status, headers=headers, reason=reason)


class _Clock:
    """The stall clock of one connection's response writes.

    :meth:`arm` as a write starts (and at each piece of it), :meth:`disarm`
    once it is done: while it is armed and no piece has gone for ``stall``
    seconds (a client that stopped reading), the connection's ``scope`` is
    cancelled. Disarmed, nothing runs out: waiting for the body (a stream of
    events between events) is no stall of the client's.

    Two ways to keep time: the scope's deadline, moved at every arm and
    disarm (nothing to start, and exact); or, while ``watched``, a
    :meth:`watch` task, which a long response runs in a nursery of its own:
    a write costs two attribute writes, and the task looks every quarter of
    ``stall`` whether the same piece is still waiting (so a stall is cut
    within a quarter more, as on h2).
    """

    __slots__ = ("pieces", "reading", "scope", "stall", "watched", "writing")

    def __init__(self, scope: trio.CancelScope, stall: float) -> None:
        self.scope = scope
        self.stall = stall
        self.watched = False
        self.writing = False  # a write is waiting (watched)
        self.pieces = 0  # pieces started (watched): progress, for the watchdog
        self.reading = False  # in _read_head, whose waits end on the scope too

    def arm(self) -> None:
        if self.watched:
            self.pieces += 1
            self.writing = True
        else:
            self.scope.deadline = trio.current_time() + self.stall

    def disarm(self) -> None:
        if self.watched:
            self.writing = False
        else:
            self.scope.deadline = math.inf

    async def watch(self) -> None:
        """Cancel the scope once one piece has been waiting ``stall`` seconds (while ``watched``)."""
        period = self.stall / 4
        seen = -1  # the piece waiting at the last look
        looks = 0  # looks in a row that found it still waiting
        while True:
            await trio.sleep(period)
            if self.writing and self.pieces == seen:
                looks += 1
                if looks >= 4:  # waiting since before the first of them: over stall seconds
                    self.scope.cancel()
                    return
            else:
                seen = self.pieces if self.writing else -1
                looks = 0


async def _send_pieces(stream: trio.abc.Stream, data: bytes, clock: _Clock) -> None:
    """Write ``data`` (over ``_PIECE`` bytes) a piece at a time, the clock restarting at each."""
    view = memoryview(data)
    for start in range(0, len(view), _PIECE):
        clock.arm()
        await stream.send_all(view[start : start + _PIECE])
    clock.disarm()


async def _send_response(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    response: Response,
    close: bool,
    wire: Wire | None,
    clock: _Clock,
) -> None:
    """The response on the wire; ``wire`` (the request's, if one came) counts its body bytes as they go.

    Every write is on the stall ``clock``: its deadline for the head and the
    first ``_DEADLINE_WRITES`` writes of the body, its watchdog for the rest
    of a longer one.
    """
    head = _response_head(response, close)
    out = conn.send(head)
    # Trailers travel only in chunked framing, which h11 picks when no length is set.
    chunked = conn.their_http_version == b"1.1" and not any(n == b"content-length" for n, _ in head.headers)
    body = response.body
    if type(body) is BytesBody:
        data = await body.receive()
        if data:
            out += conn.send(h11.Data(data=data))
        out += conn.send(h11.EndOfMessage(headers=body.trailers if chunked and body.trailers else []))
        if len(out) <= _PIECE:
            clock.arm()
            await stream.send_all(out)
            clock.disarm()
        else:
            await _send_pieces(stream, out, clock)
        if wire is not None:
            wire.sent += len(data)
        return
    clock.arm()
    await stream.send_all(out)
    clock.disarm()
    if await _send_body(stream, conn, body, chunked, wire, clock, _DEADLINE_WRITES):
        return
    clock.watched = True
    try:
        with one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(clock.watch)
                await _send_body(stream, conn, body, chunked, wire, clock, None)
                nursery.cancel_scope.cancel()
    finally:
        clock.watched = clock.writing = False


async def _send_body(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    body: Body,
    chunked: bool,
    wire: Wire | None,
    clock: _Clock,
    writes: int | None,
) -> bool:
    """``body`` and the end of the message on the wire, True; False if it stopped after ``writes`` writes.

    The last chunk of a body that knows it has ended goes with the end of
    the message, in one write.
    """
    while True:
        chunk = await body.receive()
        ended = not chunk or body.ended
        out = conn.send(h11.Data(data=chunk)) if chunk else b""
        if ended:
            out += conn.send(h11.EndOfMessage(headers=body.trailers if chunked and body.trailers else []))
        if len(out) <= _PIECE:
            if out:
                clock.arm()
                await stream.send_all(out)
                clock.disarm()
        else:
            await _send_pieces(stream, out, clock)
        if wire is not None:
            wire.sent += len(chunk)
        if ended:
            return True
        if writes is not None:
            writes -= 1
            if not writes:
                return False
