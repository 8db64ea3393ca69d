"""HTTP/1.1 server connections (the listener's h11 side).

One task per connection, one request at a time (pipelined requests wait in
h11's buffer). The request body is pulled from the socket as the handler
(or whoever it handed the body to) reads it, so an upload streams with
back-pressure and a handler may answer before reading it all. A connection
whose request body was not read to its end is closed after the response,
never reused.
"""

from __future__ import annotations

import http
import logging
from typing import TYPE_CHECKING, Any

import h11
import trio

from blocks._h1 import H1Body, H1Stream
from blocks._validate import check_header_list_size
from blocks.errors import BadRequest, StreamReset
from blocks.http import (
    HOP_BY_HOP,
    Body,
    BytesBody,
    Handler,
    Headers,
    Request,
    Response,
    empty_body,
    error_response,
    respond,
)
from blocks.timing import Timing

if TYPE_CHECKING:
    from blocks.listener import ListenerConfig

log = logging.getLogger("blocks.listener")

_REASONS: dict[int, bytes] = {}


class H1RequestBody(H1Body):
    """A request body read from the connection on demand (``100 Continue`` first if asked)."""

    __slots__ = ()

    peer = "client"

    async def receive(self) -> bytes:
        h1 = self._h1
        if not self._done and h1.conn.they_are_waiting_for_100_continue:
            await h1.stream.send_all(h1.conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        return await super().receive()


def _request_from(event: h11.Request, reader: H1Stream, client: str, scheme: bytes, max_size: int) -> Request:
    check_header_list_size(event.headers, max_size)  # type: ignore[arg-type]
    headers: Headers = []
    authority = b""
    length: int | None = None
    has_body = False
    for name, value in event.headers:
        if name == b"host":
            authority = value
            continue
        if name == b"content-length":
            length = int(value)
            has_body = length > 0
        elif name == b"transfer-encoding":
            has_body = True
        headers.append((name, value))
    target = event.target
    if target[:1] != b"/" and b"://" in target:
        # absolute-form (RFC 9112 3.2.2): its authority wins over Host.
        scheme, _, rest = target.partition(b"://")
        authority, slash, path = rest.partition(b"/")
        target = slash + path or b"/"
    if not authority:
        raise BadRequest("no host")
    body: Body
    if has_body:
        body = H1RequestBody(reader, length)
    else:
        # h11 has the (empty) end of this message already: take it now, so the
        # connection is ready for the next request once the response is out.
        reader.conn.next_event()
        body = empty_body()
    return Request(
        event.method,
        scheme,
        authority.lower(),
        target,
        headers,
        body,
        client,
        event.http_version.decode(),
        Timing(),
    )


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
    while True:
        request: Request | None = None
        error: int | None = None
        if drain.draining and conn.their_state is h11.IDLE and not conn.trailing_data[0]:
            return
        with trio.move_on_after(config.h1_idle_timeout) as idle:
            drain.idle_scope = idle
            try:
                event = await reader.next_event()
            except h11.RemoteProtocolError as exc:
                error = exc.error_status_hint
                event = None
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            finally:
                drain.idle_scope = None
        if idle.cancelled_caught:
            if drain.draining and conn.their_state is h11.IDLE:
                return  # drained while idle: nothing half-read to answer
            # Quiet keep-alive connections just close; a half-sent head gets 408.
            if conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                return
            error = 408
            event = None
        if type(event) is h11.ConnectionClosed or (event is None and error is None):
            return
        if type(event) is h11.Request:
            try:
                request = _request_from(event, reader, client, scheme, config.max_header_list_size)
            except BadRequest as exc:
                error = exc.status
            except ValueError:
                error = 400
        response: Response | None = None
        if request is not None:
            response = await respond(handler, request)
        else:
            response = error_response(error or 400)
        if request is not None and request.method == b"HEAD" and not response.body.ended:
            await response.body.aclose()
            response.body = empty_body()
        close = drain.draining or request is None
        try:
            await _send_response(stream, conn, response, close)
        except (StreamReset, h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            if not response.body.ended:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await response.body.aclose()
            response.closed()
        if request is not None and not request.body.ended:
            await request.body.aclose()
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE and not close:
            conn.start_next_cycle()
            continue
        return


async def _send_response(stream: trio.abc.Stream, conn: h11.Connection, response: Response, close: bool) -> None:
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
        await stream.send_all(out)
        return
    await stream.send_all(out)
    while chunk := await body.receive():
        await stream.send_all(conn.send(h11.Data(data=chunk)))
    await stream.send_all(conn.send(h11.EndOfMessage(headers=body.trailers if chunked and body.trailers else [])))
