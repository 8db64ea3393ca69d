"""One HTTP/1.1 server connection: :func:`serve_h1`, its requests one at a time, and the linger after
an answer that leaves the client's input unread (``_linger``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import h11
import trio

from blocks.errors import BlocksError, StreamReset
from blocks.http import Handler, Headers, Request, abandon, empty_body, error_response, respond
from blocks.transport._h1 import H1Stream
from blocks.transport._h1server._request import H1RequestBody, _read_head, _request_from
from blocks.transport._h1server._response import _Clock, _send_response
from blocks.transport._h1server._tunnel import _serve_tunnel

if TYPE_CHECKING:
    from blocks.transport.listener import ListenerConfig

log = logging.getLogger("blocks.listener")

# After an answer that leaves the client's input unread, how long its input is
# read and dropped before closing: at most _LINGER_SECONDS and _LINGER_BYTES in
# all, and until _LINGER_IDLE seconds pass without any (nginx's lingering_time
# and lingering_timeout; see _linger).
_LINGER_SECONDS = 10.0
_LINGER_IDLE = 1.0
_LINGER_BYTES = 64 * 1024 * 1024


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
