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

Where each piece is:

- ``_connection``: :func:`serve_h1`, a connection's loop over its requests,
  and the linger after an answer that leaves the client's input unread;
- ``_request``: reading a request: its head (and the clocks that bound it)
  and what it must be (``_request_from``), its body (:class:`H1RequestBody`);
- ``_response``: writing a response on the stall clock (``_Clock``);
- ``_tunnel``: the WebSocket upgrade, checked, then served as a tunnel
  (:class:`H1TunnelBody`).
"""

from blocks.transport._h1server._connection import serve_h1
from blocks.transport._h1server._request import H1RequestBody, _request_from
from blocks.transport._h1server._tunnel import H1TunnelBody

__all__ = ["H1RequestBody", "H1TunnelBody", "_request_from", "serve_h1"]
