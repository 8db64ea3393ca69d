"""Reading an HTTP/1.1 request: its head within its clocks (``_read_head``), what the head must be to
get past the listener (``_request_from``), and its body, pulled from the connection on demand
(:class:`H1RequestBody`)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import h11
import trio

from blocks.errors import BadRequest, PayloadTooLarge, StreamReset
from blocks.http import Body, Headers, Request, Wire, empty_body
from blocks.timing import Timing
from blocks.transport._h1 import H1Body, H1Stream
from blocks.transport._h1server._tunnel import _websocket
from blocks.transport._validate import check_authority, check_header_list_size, target_too_long

if TYPE_CHECKING:
    from blocks.transport._h1server._response import _Clock
    from blocks.transport.listener import ListenerConfig

_PATH = re.compile(rb"/[\x21-\x7e]*\Z")
# The first line start that is either the end of the head or an obs-fold.
_END_OR_FOLD = re.compile(rb"\n(?:\r?\n|[ \t])")
_ABSOLUTE = re.compile(rb"([A-Za-z][A-Za-z0-9+\-.]*)://([^/?#]*)(.*)\Z", re.DOTALL)
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
