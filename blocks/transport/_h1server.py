"""HTTP/1.1 server connections (the listener's h11 side).

One task per connection, one request at a time (pipelined requests wait in
h11's buffer). The request body is pulled from the socket as the handler
(or whoever it handed the body to) reads it, so an upload streams with
back-pressure and a handler may answer before reading it all. A connection
whose request body was not read to its end is closed after the response,
never reused.

What an h1 request must be to get past here, on top of h11's syntax checks,
because this is where h1 framing ends and every later hop re-frames the
request (RFC 9112 6.3, 11.2): one framing (``content-length`` or
``transfer-encoding: chunked``, never both), no obs-fold, one
``host[:port]`` authority (an absolute-form target's wins over ``Host``; an
HTTP/1.0 request may have neither, and gets ``default_authority``, else the
address the client reached), an origin-form target (or ``*`` for
``OPTIONS``) within ``max_target`` (else 414), a head within the size and
field-count caps (the target counted in, as h2 carries it on as ``:path``),
a body within ``max_request_body``. A request that fails is answered here
and never handed on, and its connection is closed.

Two clocks bound a head (slowloris): a kept-alive connection waits at most
``h1_idle_timeout`` for the first byte of its next request, and a head must
be complete within ``h1_header_timeout`` of its first byte (of the
connection's start for the first request), else 408. One bounds a response:
a write that makes no progress for ``stall_timeout`` (a client that stopped
reading) ends the connection, and the response body is abandoned, which
cancels whatever feeds it upstream. That clock runs only while a write
waits, and restarts with every piece written (``_PIECE``).

WebSockets (RFC 6455). A bodiless request with ``Upgrade: websocket`` is
checked here (``GET``, HTTP/1.1, ``Connection: upgrade``, version 13 else
426, a key of 16 base64 bytes else 400) and handed on as a tunnel: a
``CONNECT`` with ``protocol = b"websocket"``, as it would come on h2 (RFC
8441), without the fields that tie it to this connection. Nothing the client
sends after the head is read until the handler accepts with a 200: then
``101 Switching Protocols`` goes out, and the connection becomes two pipes
(the client's bytes are the request body, the response body goes to the
client) until either side ends. A refusal is an ordinary response, and the
connection closes after it. Ordinary requests pay one look at h11's state.
"""

from __future__ import annotations

import http
import logging
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import h11
import trio

from blocks._sync import one_error
from blocks.errors import BadRequest, BlocksError, PayloadTooLarge, StreamReset
from blocks.http import (
    HOP_BY_HOP,
    Body,
    BytesBody,
    Handler,
    Headers,
    Request,
    Response,
    Wire,
    abandon,
    empty_body,
    error_response,
    respond,
    strip_hop_by_hop,
)
from blocks.timing import Timing
from blocks.transport._h1 import H1Body, H1Stream
from blocks.transport._upgrade import KEY_FIELDS, WEBSOCKET_VERSION, accept_token, comma_tokens, valid_key
from blocks.transport._validate import check_authority, check_header_list_size, target_too_long, upgrade_required

if TYPE_CHECKING:
    from blocks.transport.listener import ListenerConfig

log = logging.getLogger("blocks.listener")

_REASONS: dict[int, bytes] = {}
_PATH = re.compile(rb"/[\x21-\x7e]*\Z")
# The first line start that is either the end of the head or an obs-fold.
_END_OR_FOLD = re.compile(rb"\n(?:\r?\n|[ \t])")
_ABSOLUTE = re.compile(rb"([A-Za-z][A-Za-z0-9+\-.]*)://([^/?#]*)(.*)\Z", re.DOTALL)
# After an answer that leaves the client's input unread, how long its input is
# read and dropped before closing: at most _LINGER_SECONDS and _LINGER_BYTES in
# all, and until _LINGER_IDLE seconds pass without any (nginx's lingering_time
# and lingering_timeout; see _linger).
_LINGER_SECONDS = 10.0
_LINGER_IDLE = 1.0
_LINGER_BYTES = 64 * 1024 * 1024
# A write to a client is on the stall clock (stall_timeout, see _Clock), which
# restarts with every piece of at most _PIECE bytes written: a reader that
# takes a piece per stall_timeout is never cut, and a big chunk is no one long
# write. A response's first _DEADLINE_WRITES writes are timed by moving a
# deadline (two moves a write, each about half a checkpoint); a longer one is
# watched by a task from there on (a nursery and a task once, about a dozen
# checkpoints, then two attribute writes a write).
_PIECE = 64 * 1024
_DEADLINE_WRITES = 16
# Where h11 holds a request that asked to Upgrade (a documented state, left out of h11.__all__).
_MIGHT_SWITCH = h11.MIGHT_SWITCH_PROTOCOL  # type: ignore[attr-defined]


class H1RequestBody(H1Body):
    """A request body read from the connection on demand (``100 Continue`` first if asked).

    It never returns more than ``limit`` bytes in all (``None``: no limit):
    the read that would cross it raises
    :class:`~blocks.errors.PayloadTooLarge` (a
    :class:`~blocks.errors.StreamReset` too) instead. ``status`` is set when
    the body broke through the client's fault (400 for bad chunked framing,
    413 for the limit): that, not whatever a relay made of the cut upload,
    is the answer. With a ``deadline`` (``request_body_timeout``), a body
    still unfinished then fails with 408.
    """

    __slots__ = ("_deadline", "_limit", "_wire", "status")

    peer = "client"

    def __init__(self, h1: H1Stream, length: int | None, limit: int | None, deadline: float | None, wire: Wire) -> None:
        super().__init__(h1, length)
        self._limit = limit
        self._wire = wire  # counts what was received
        self._deadline = deadline
        self.status: int | None = None

    async def receive(self) -> bytes:
        h1 = self._h1
        if not self._done and h1.conn.they_are_waiting_for_100_continue:
            await h1.stream.send_all(h1.conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        try:
            if self._deadline is None:
                data = await super().receive()
            else:
                with trio.move_on_at(self._deadline) as late:
                    data = await super().receive()
                if late.cancelled_caught:
                    self.finished(False)
                    self.status = 408
                    raise StreamReset("request body too slow", status=408)
        except StreamReset as exc:
            cause = exc.__cause__
            if isinstance(cause, h11.RemoteProtocolError) and self.status is None:
                self.status = cause.error_status_hint
            raise
        wire = self._wire
        wire.received += len(data)
        if self._limit is not None and wire.received > self._limit:
            self.finished(False)
            self.status = 413
            raise PayloadTooLarge(f"request body over {self._limit} bytes")
        return data


def _request_from(event: h11.Request, reader: H1Stream, client: str, scheme: bytes, config: ListenerConfig) -> Request:
    target = event.target
    if len(target) > config.max_target:
        raise target_too_long(target, config.max_target)
    # The target counts as h2 carries it on (":path" and 32), so a head taken here fits every hop's cap.
    check_header_list_size(
        event.headers,  # type: ignore[arg-type]
        config.max_header_list_size,
        config.max_header_count,
        len(target) + 37,
    )
    headers: Headers = []
    authority = b""
    length: int | None = None
    chunked = False
    for name, value in event.headers:
        if name == b"host":  # h11 refuses a second one
            authority = value
            continue
        if name == b"content-length":
            length = int(value)  # h11 checked: digits, one value
        elif name == b"transfer-encoding":
            chunked = True  # h11 checked: exactly "chunked"
        headers.append((name, value))
    if chunked and length is not None:
        # Two framings: the classic smuggling shape (RFC 9112 6.1). h11 would
        # go by the chunks and the content-length would travel on, so refuse it.
        raise BadRequest("content-length and transfer-encoding together")
    if chunked and event.http_version == b"1.0":
        raise BadRequest("transfer-encoding in HTTP/1.0")  # RFC 9112 6.1: faulty framing
    method = event.method
    if method == b"CONNECT":
        raise BadRequest("CONNECT is not supported", status=501)  # as on h2
    absolute = None
    if target[:1] != b"/":
        absolute = _ABSOLUTE.match(target)
        if absolute is not None:
            # absolute-form (RFC 9112 3.2.2): its authority wins over Host. The
            # scheme stays the connection's, which is what the client really used.
            if absolute[1].lower() not in (b"http", b"https"):
                raise BadRequest("absolute-form target with a scheme other than http(s)")
            authority = absolute[2]
            target = absolute[3]
            if target[:1] != b"/":
                target = b"/" + target
        elif not (target == b"*" and method == b"OPTIONS"):
            raise BadRequest("request target is not origin-form")
    if target != b"*" and not _PATH.match(target):
        raise BadRequest("bad request target")
    if not authority:
        # Host is HTTP/1.1's (RFC 9112 3.2); an http URI with an empty host is invalid (RFC 9110 4.2.1).
        if event.http_version != b"1.0" or absolute is not None:
            raise BadRequest("no host")
        authority = _default_authority(reader.stream, config)
    authority = check_authority(authority)
    limit = config.max_request_body
    if length is not None and limit is not None and length > limit:
        raise PayloadTooLarge(f"declared body of {length} bytes is over {limit}")
    body: Body
    wire = Wire()
    if chunked or length:
        timeout = config.request_body_timeout
        deadline = None if timeout is None else trio.current_time() + timeout
        body = H1RequestBody(reader, length, limit, deadline, wire)
    else:
        # h11 has the (empty) end of this message already: take it now, so the
        # connection is ready for the next request once the response is out.
        reader.conn.next_event()
        body = empty_body()
        if reader.conn.their_state is _MIGHT_SWITCH:  # it asked to Upgrade
            tunnel = _websocket(event, method, headers, reader, config, wire)
            if tunnel is not None:
                return Request(
                    b"CONNECT",
                    scheme,
                    authority,
                    target,
                    tunnel[0],
                    tunnel[1],
                    client,
                    "1.1",
                    Timing(),
                    protocol=b"websocket",
                    wire=wire,
                )
    return Request(
        method,
        scheme,
        authority,
        target,
        headers,
        body,
        client,
        event.http_version.decode(),
        Timing(),
        wire=wire,
    )


def _default_authority(stream: trio.abc.Stream, config: ListenerConfig) -> bytes:
    """The authority of an HTTP/1.0 request that names none: the configured one, else the
    address the client reached (``IP:PORT``, the listening socket's own end)."""
    if config.default_authority is not None:
        return config.default_authority.encode("ascii")
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if not isinstance(stream, trio.SocketStream):
        raise BadRequest("no host")
    try:
        host, port = stream.socket.getsockname()[:2]
    except (OSError, ValueError) as exc:
        raise BadRequest("no host") from exc
    host = str(host).partition("%")[0]  # an IPv6 zone is no part of an authority
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode("ascii")


class H1TunnelBody(Body):
    """The client's bytes once its WebSocket is accepted: h11's leftovers, then the socket.

    Nothing is read before :meth:`open` (the 101 is out), so a refused
    upgrade leaves the connection's input untouched. The socket is read only
    as the consumer asks: back-pressure is the socket's. The end of the
    client's input is the end of the body; a broken socket, or an
    :meth:`aclose` while a read waits, is a :class:`~blocks.errors.StreamReset`.
    """

    __slots__ = ("_broken", "_done", "_gate", "_initial", "_stream", "_wire", "accept", "on_eof")

    def __init__(self, stream: trio.abc.Stream, accept: bytes, wire: Wire) -> None:
        super().__init__(None)
        self._stream = stream
        self._wire = wire  # counts what was received
        self._gate = trio.Event()
        self._initial = b""
        self._done = False
        self._broken = False
        self.accept = accept
        self.on_eof: Callable[[], None] | None = None  # called once the client's input has ended

    @property
    def ended(self) -> bool:
        return self._done and not self._broken

    def open(self, initial: bytes) -> None:
        """The 101 went out: the client's bytes may flow (``initial``: what h11 read past the head)."""
        self._initial = initial
        self._gate.set()

    async def receive(self) -> bytes:
        if not self._gate.is_set():
            await self._gate.wait()
        if self._done:
            if self._broken:
                raise StreamReset("the client's tunnel closed")
            return b""
        if self._initial:
            data, self._initial = self._initial, b""
            self._wire.received += len(data)
            return data
        try:
            data = bytes(await self._stream.receive_some(65536))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._done = self._broken = True
            raise StreamReset("the client's tunnel broke") from exc
        self._wire.received += len(data)
        if not data:
            self._done = True
            if self.on_eof is not None:
                self.on_eof()
        return data

    async def aclose(self) -> None:
        if not self._done:
            self._done = self._broken = True
        self._gate.set()


def _websocket(
    event: h11.Request, method: bytes, headers: Headers, reader: H1Stream, config: ListenerConfig, wire: Wire
) -> tuple[Headers, H1TunnelBody] | None:
    """A WebSocket upgrade as a tunnel's fields and body; None for another Upgrade (served as before)."""
    if b"websocket" not in comma_tokens(headers, b"upgrade"):
        return None  # h2c and the like: an ordinary request, the upgrade ignored
    if method != b"GET":
        raise BadRequest("a WebSocket upgrade on a method other than GET")
    if event.http_version != b"1.1":
        raise BadRequest("a WebSocket upgrade on HTTP/1.0")
    if b"upgrade" not in comma_tokens(headers, b"connection"):
        raise BadRequest("Upgrade: websocket without Connection: upgrade")
    versions = [value for name, value in headers if name == b"sec-websocket-version"]
    if versions != [WEBSOCKET_VERSION]:
        raise upgrade_required()
    keys = [value for name, value in headers if name == b"sec-websocket-key"]
    if len(keys) != 1 or not valid_key(keys[0]):
        raise BadRequest("a missing or malformed sec-websocket-key")
    fields = [
        (name, value)
        for name, value in strip_hop_by_hop(headers)
        if name not in KEY_FIELDS and name != b"content-length"
    ]
    return fields, H1TunnelBody(reader.stream, accept_token(keys[0]), wire)


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


async def _read_head(
    reader: H1Stream, config: ListenerConfig, drain: Any, clock: _Clock, *, first: bool
) -> tuple[Any, int | None]:
    """The next request head as an h11 event, or why there is none.

    Returns ``(event, None)``; ``(None, status)`` to answer ``status`` and
    close; ``(None, None)`` to close quietly. A connection may idle up to
    ``h1_idle_timeout`` before a head's first byte (the first request skips
    that: its bytes are here, or due, already), then the head must be done
    within ``h1_header_timeout``: if not, 408 if any of it came, a quiet
    close if none did. A drain cancels the wait, and what is half-read is
    not answered then.

    The idle wait and the drain are the connection's own scope (the stall
    clock's): its deadline, and its cancellation, which end the connection
    quietly. That costs no scope of their own per request.
    """
    conn = reader.conn
    stream = reader.stream
    scope = clock.scope
    # The head's raw bytes, for what h11 would silently accept: obs-fold.
    raw = bytearray(conn.trailing_data[0])
    clock.reading = True
    drain.idle_scope = scope
    try:
        event = conn.next_event()
        if event is h11.NEED_DATA and not first and not raw:
            scope.deadline = trio.current_time() + config.h1_idle_timeout
            data = await stream.receive_some(65536)
            scope.deadline = math.inf
            raw += data
            conn.receive_data(data)  # type: ignore[arg-type]  # b"": the client closed, h11 says so
            event = conn.next_event()
        if event is h11.NEED_DATA:
            with trio.move_on_after(config.h1_header_timeout):
                while event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    raw += data
                    conn.receive_data(data)  # type: ignore[arg-type]
                    event = conn.next_event()
            if event is h11.NEED_DATA:
                return None, (408 if raw else None)
    except h11.RemoteProtocolError as exc:
        if exc.error_status_hint == 431 and b"\n" not in raw:
            # h11's buffer filled up inside the request line: its target alone is over the cap.
            return None, 414
        return None, exc.error_status_hint
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return None, None
    finally:
        drain.idle_scope = None
    if type(event) is h11.Request:
        # h11 unfolds obs-fold (RFC 9112 5.2 allows that or a 400): refused
        # here, so that no parser downstream ever has a fold to disagree on.
        end = _END_OR_FOLD.search(raw)
        if end is not None and end[0][1:2] in b" \t":
            return None, 400
    return event, None


async def _linger(stream: trio.abc.Stream, drain: Any) -> None:
    """Shut our side, then drop what the client still sends, until it stops.

    Closing a socket with unread input makes the kernel reset it, which can
    destroy the answer still on its way to the client (RFC 9112 9.6): a
    client still sending a body it was told not to (or answered before it
    finished) would get a reset instead of its answer. So the input is read
    and dropped until the client closes or goes quiet, within bounds of time
    and bytes (what is in flight on a fast link is megabytes). A drain cuts
    it short. A relay's read of the body may still be leaving the socket (its
    body was closed under it): the linger takes its turn after it.
    """
    if not isinstance(stream, trio.abc.HalfCloseableStream):
        return
    left = _LINGER_BYTES
    with trio.move_on_after(_LINGER_SECONDS) as lingering:
        drain.idle_scope = lingering
        try:
            await stream.send_eof()
            while left > 0:
                with trio.move_on_after(_LINGER_IDLE):
                    try:
                        data = await stream.receive_some(65536)
                    except trio.BusyResourceError:
                        await trio.sleep(0.01)
                        continue
                    if not data:
                        return
                    left -= len(data)
                    continue
                return  # quiet: whatever it still had to read, it has had the time to
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            drain.idle_scope = None


async def serve_h1(
    stream: trio.abc.Stream,
    handler: Handler,
    config: ListenerConfig,
    *,
    client: str,
    scheme: bytes,
    initial: bytes,
    drain: Any,
) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=config.max_header_list_size)
    if initial:
        conn.receive_data(initial)
    reader = H1Stream(stream, conn)
    # The connection's scope: when the stall clock runs out (_Clock), the idle
    # clock runs out or a drain comes between requests (_read_head), the
    # connection ends here.
    with trio.CancelScope() as scope:
        clock = _Clock(scope, config.stall_timeout)
        first = True
        while True:
            request: Request | None = None
            if drain.draining and conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                return
            event, error = await _read_head(reader, config, drain, clock, first=first)
            clock.reading = False
            error_headers: Headers | None = None
            first = False
            if type(event) is h11.ConnectionClosed or (event is None and error is None):
                return
            if type(event) is h11.Request:
                try:
                    request = _request_from(event, reader, client, scheme, config)
                except BlocksError as exc:
                    error = exc.status
                    error_headers = exc.headers
                except ValueError:
                    error = 400
            broken: int | None = None  # why the client's own upload broke, if it did
            if request is not None:
                response = await respond(handler, request)
                if request.protocol is not None and response.status == 200:
                    await _serve_tunnel(stream, conn, request, response, config)
                    return
                body = request.body
                if type(body) is H1RequestBody and body.status is not None:
                    broken = body.status
                    # Nothing of the handler's answer has been sent: the client's
                    # fault is the answer, not what a relay made of the cut upload.
                    await abandon(response.body)
                    response.closed()
                    response = error_response(broken, hop=config.hop)
            else:
                response = error_response(error or 400, error_headers, hop=config.hop)
            if request is not None and request.method == b"HEAD" and not response.body.ended:
                await response.body.aclose()
                response.body = empty_body()
            # (A refused upgrade closes too: the client may have sent tunnel bytes we will not read.)
            close = drain.draining or request is None or broken is not None or request.protocol is not None
            try:
                await _send_response(
                    stream, conn, response, close, request.wire if request is not None else None, clock
                )
            except (StreamReset, h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                return
            finally:
                if not response.body.ended:
                    await abandon(response.body)  # (a stall too: whatever feeds it upstream is cancelled)
                response.closed()
            early = request is not None and not request.body.ended  # answered before the upload ended
            if request is not None and early:
                await request.body.aclose()  # (whoever relayed it stops here)
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE and not close:
                conn.start_next_cycle()
                continue
            if request is None or broken is not None or early:
                # The client may still be sending what we will not read: closing
                # now would reset the connection under the answer it has yet to read.
                await _linger(stream, drain)
            return
    if scope.cancelled_caught and not clock.reading:  # (else: idle, or drained, between requests)
        log.debug("the client %s stopped reading its response; closed", client)


_NOT_IN_101 = frozenset({b"content-length", *KEY_FIELDS})


async def _serve_tunnel(
    stream: trio.abc.Stream, conn: h11.Connection, request: Request, response: Response, config: ListenerConfig
) -> None:
    """The handler accepted a WebSocket: 101, then the response body to the client until it ends.

    The client's bytes flow meanwhile through ``request.body``, pulled by
    whoever the handler gave it to. A write to the client that makes no
    progress for ``stall_timeout`` ends the tunnel (a client that stopped
    reading); once the client's input has ended, the upstream has
    ``close_timeout`` to end its side too. Whichever way it ends, both
    bodies are closed and the connection with them.
    """
    body = request.body
    assert type(body) is H1TunnelBody
    out = response.body
    wire = body._wire
    try:
        head = [(b"upgrade", b"websocket"), (b"connection", b"Upgrade"), (b"sec-websocket-accept", body.accept)]
        head += [(n, v) for n, v in response.headers if n not in HOP_BY_HOP and n not in _NOT_IN_101]
        switch = h11.InformationalResponse(status_code=101, headers=head, reason=b"Switching Protocols")
        await stream.send_all(conn.send(switch))
        body.open(conn.trailing_data[0])
        with trio.CancelScope() as scope:

            def client_done() -> None:
                scope.deadline = min(scope.deadline, trio.current_time() + config.close_timeout)

            body.on_eof = client_done
            while chunk := await out.receive():
                with trio.move_on_after(config.stall_timeout) as stalled:
                    await stream.send_all(chunk)
                    wire.sent += len(chunk)
                if stalled.cancelled_caught:
                    log.debug("the WebSocket client %s stopped reading; closing", request.client)
                    return
            if isinstance(stream, trio.abc.HalfCloseableStream):
                await stream.send_eof()
    except (StreamReset, h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        if not out.ended:
            await abandon(out)
        response.closed()
        await body.aclose()


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
