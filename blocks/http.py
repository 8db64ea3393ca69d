"""Request and response types shared by every block.

A handler is ``async def handler(request: Request) -> Response``. Heads are
plain data; bodies are :class:`Body` objects that stream with back-pressure in
both directions at once: a handler may return its :class:`Response` (and the
listener starts sending it) while it is still reading ``request.body``, which
is what bidirectional streaming (gRPC, an echo, a proxy) needs.

Header names are lowercase ``bytes``; values are ``bytes``; a header list is
an ordinary ``list`` of pairs so that building and forwarding one costs no
conversions. Pseudo-headers never appear in ``headers``: they are the
request's ``method``/``scheme``/``authority``/``path`` and the response's
``status``.

Flow control lives in the bodies. A :class:`StreamBody` fed by a connection
returns flow-control credit to the peer only as its consumer reads, so a slow
reader holds back its own sender and nobody else.
"""

from __future__ import annotations

import collections
import http
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import trio

from blocks import fields
from blocks._common import Headers as Headers
from blocks._sync import Signal
from blocks.errors import BlocksError, StreamReset, error_field, status_reason

if TYPE_CHECKING:
    from blocks.hops import Exchange
    from blocks.timing import Timing

log = logging.getLogger("blocks.listener")


class Body:
    """A stream of byte chunks, optionally followed by trailers.

    ``receive()`` returns the next non-empty chunk, or ``b""`` once the body
    has ended; after that ``trailers`` holds the trailing header fields (or
    ``None``). ``length`` is the declared length when one is known.
    ``aclose()`` abandons the body early: the producer is told to stop (an h2
    stream is reset, an h1 connection is not reused).
    """

    __slots__ = ("length", "trailers")

    def __init__(self, length: int | None = None) -> None:
        self.length = length
        self.trailers: Headers | None = None

    @property
    def ended(self) -> bool:
        """True when nothing more will come: ``receive()`` would return ``b""``."""
        return False

    @property
    def untouched(self) -> bool:
        """True while no upstream has taken any of it, so that it can still go elsewhere (False when
        that cannot be known: a body that says nothing is treated as taken)."""
        return False

    async def receive(self) -> bytes:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None

    def discard(self) -> None:
        """Nobody will read this body any more: drop what it holds (its window goes back). Never blocks.

        Unlike :meth:`aclose`, it does not tell the producer to stop.
        """

    def claim(self) -> None:
        """A reader that outlives the handler takes the body over (a relay's pump in a pool's nursery).

        From then on that reader reads the body to its end, closes it, or
        discards what it leaves: the listener no longer discards a body that
        arrived whole once the handler is done. Never blocks.
        """

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        while chunk := await self.receive():
            yield chunk

    async def read_all(self, limit: int = 16 * 1024 * 1024) -> bytes:
        """Collect the whole body (tests and small control bodies only)."""
        parts = []
        size = 0
        while chunk := await self.receive():
            size += len(chunk)
            if size > limit:
                await self.aclose()
                raise ValueError(f"body larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)


class BytesBody(Body):
    """A body whose bytes are all known up front."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes = b"", trailers: Headers | None = None) -> None:
        super().__init__(len(data))
        self._data = data
        self.trailers = trailers

    @property
    def ended(self) -> bool:
        return not self._data

    @property
    def data(self) -> bytes:
        """What ``receive()`` has yet to return."""
        return self._data

    async def receive(self) -> bytes:
        data, self._data = self._data, b""
        return data


SAFE_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})
"""RFC 9110 9.2.1's safe methods: a hop sends one again, once, when its upstream connection was lost
before any byte of the response came (RFC 9110 9.2.2 lets a client retry such a request)."""


def empty_body() -> BytesBody:
    """An ended body: what a GET carries."""
    return BytesBody()


class IterBody(Body):
    """A body produced by an async iterator (a handler streaming its output).

    ``trailers`` may be set by the producer before its iterator finishes.
    """

    __slots__ = ("_iterator",)

    def __init__(self, chunks: AsyncIterator[bytes], length: int | None = None) -> None:
        super().__init__(length)
        self._iterator = chunks

    async def receive(self) -> bytes:
        async for chunk in self._iterator:
            if chunk:
                return chunk
        return b""

    async def aclose(self) -> None:
        aclose = getattr(self._iterator, "aclose", None)
        if aclose is not None:
            await aclose()


class StreamBody(Body):
    """A body pushed by a connection driver, pulled by one consumer.

    The driver calls :meth:`feed`, :meth:`end` or :meth:`fail`; none of them
    block. ``on_consumed(n)`` is called as the consumer takes ``n`` bytes:
    that is where an h2 driver returns stream window to the peer, so what
    sits in the buffer is bounded by the window the driver advertised.
    ``on_abandon()`` is called once if the consumer closes the body before
    its end.

    Invariant: every byte fed goes to ``on_consumed`` exactly once, whether
    the consumer reads it or it is dropped: by :meth:`fail` (a failed body
    delivers nothing more), by :meth:`aclose`, or by :meth:`discard` (its
    owner knows nobody will read it). A body that ended cleanly keeps its
    bytes for the consumer, so whoever owns it reads it to the end, closes
    it, or discards it: the listener discards a request body once its
    handler is done, unless a reader that outlives the handler took it over
    (:meth:`claim`: a relay's body pump), which then discards what it leaves
    when it stops.
    """

    __slots__ = ("_chunks", "_claimed", "_ended", "_error", "_signal", "on_abandon", "on_consumed")

    def __init__(
        self,
        length: int | None = None,
        *,
        on_consumed: Callable[[int], None] | None = None,
        on_abandon: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(length)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._claimed = False  # a reader that outlives the handler took it over (claim)
        self._ended = False
        self._error: BaseException | None = None
        self._signal = Signal()
        self.on_consumed = on_consumed
        self.on_abandon = on_abandon

    # -- producer side -------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if not data:
            return
        if self._ended:
            if self.on_consumed is not None:
                self.on_consumed(len(data))  # nobody will read it
            return
        self._chunks.append(data)
        self._signal.set()

    def end(self, trailers: Headers | None = None) -> None:
        if not self._ended:
            self._ended = True
            self.trailers = trailers
            self._signal.set()

    def fail(self, error: BaseException) -> None:
        """The producer broke: the consumer gets ``error`` (as a StreamReset), and nothing buffered."""
        if not self._ended:
            self._ended = True
            self._error = error
            self._signal.set()
            self._drop()

    def discard(self) -> None:
        """Nobody will read this body any more: give back what it buffers.

        The owner's last word (a stream whose handler is done). Reading it
        afterwards fails, unless it had ended and been read to the end.
        """
        if self._chunks or not self._ended:
            if self._error is None:
                self._error = StreamReset("body discarded")
            self._ended = True
            self._signal.set()
            self._drop()

    def _drop(self) -> None:
        chunks = self._chunks
        if chunks:
            size = sum(map(len, chunks))
            chunks.clear()
            if self.on_consumed is not None:
                self.on_consumed(size)

    # -- consumer side -------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self._ended and not self._chunks and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the body failed, if it did."""
        return self._error

    @property
    def received_all(self) -> bool:
        """The producer ended the body cleanly: every byte has been fed (some may wait to be read)."""
        return self._ended and self._error is None

    @property
    def claimed(self) -> bool:
        """Whether a reader that outlives the handler took it over (:meth:`claim`)."""
        return self._claimed

    @property
    def untouched(self) -> bool:
        """No pool claimed it (a pool claims a body before it reads the first byte of it)."""
        return not self._claimed

    def claim(self) -> None:
        self._claimed = True

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet received."""
        return sum(map(len, self._chunks))

    async def receive(self) -> bytes:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                if self.on_consumed is not None:
                    self.on_consumed(len(chunk))
                return chunk
            if self._ended:
                if self._error is not None:
                    if isinstance(self._error, StreamReset):
                        raise self._error
                    raise StreamReset(str(self._error)) from self._error
                return b""
            await self._signal.wait()

    async def aclose(self) -> None:
        if not self._ended:
            self._ended = True
            if self.on_abandon is not None:
                self.on_abandon()  # first: what is given back below then credits the connection only
        self.discard()


class Wire:
    """The body bytes of one request as its listener moved them: ``received`` from the client, ``sent`` to it.

    The listener counts each body byte once, as it takes it from the
    connection or hands it to the connection, on every path (spliced,
    handled, HTTP/1.1, a tunnel); padding and framing are not body bytes.
    An HTTP/2 stream is its own :class:`Wire`, so counting costs one
    addition per frame and nothing per request.
    """

    __slots__ = ("received", "sent")

    def __init__(self) -> None:
        self.received = 0
        self.sent = 0

    def __repr__(self) -> str:
        return f"<Wire received={self.received} sent={self.sent}>"


@attrs.define(eq=False)
class Request:
    """An HTTP request head and its body, whatever the protocol it came in on.

    ``authority`` is the canonical authority (``:authority``, or ``Host`` on
    HTTP/1.1), lowercase. ``client`` is the peer's address as text.
    ``timing`` collects this hop's Server-Timing phases.
    """

    method: bytes
    scheme: bytes
    authority: bytes
    path: bytes
    headers: Headers = attrs.field(factory=list)
    body: Body = attrs.field(factory=empty_body)
    client: str = ""
    http_version: str = "2"
    timing: Timing | None = None
    exchange: Exchange | None = None
    """This request at the hop that serves it (:class:`~blocks.hops.Exchange`):
    what its features decided and noted (the app, verified claims, the
    route), from the moment the hop sees it."""
    protocol: bytes | None = None
    """The RFC 8441 ``:protocol`` of an extended CONNECT (``b"websocket"``), or
    None for an ordinary request. Such a request is a tunnel: ``method`` is
    ``b"CONNECT"``, ``body`` is the bytes from the client for as long as the
    tunnel lives, and a handler accepts it with a 200 whose body is the bytes
    to the client (any other status refuses it). A WebSocket that came in as
    an HTTP/1.1 ``Upgrade`` arrives in the same form (see :mod:`blocks.websocket`)."""
    wire: Wire | None = None
    """The body bytes the listener received and sent for it so far (:class:`Wire`); None for a
    request no listener serves (one a program made)."""

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """The first value of header ``name`` (lowercase), or ``default``."""
        for key, value in self.headers:
            if key == name:
                return value
        return default


@attrs.define(eq=False)
class Response:
    """A response head and its body. Trailers travel on the body."""

    status: int
    headers: Headers = attrs.field(factory=list)
    body: Body = attrs.field(factory=empty_body)
    _on_close: list[Callable[[], None]] | None = attrs.field(default=None, alias="on_close")

    def call_on_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the response has been sent in full, or abandoned.

        This is where a layer releases what it holds for the request's whole
        life (an in-flight count, a scheduler slot): the listener calls every
        callback exactly once, in the order they were added, on every path.
        """
        if self._on_close is None:
            self._on_close = [callback]
        else:
            self._on_close.append(callback)

    def closed(self) -> None:
        """Called by the listener when the response is done; runs the callbacks.

        Every callback runs, even when one before it raises (that is logged
        with its traceback): each releases something of its own.
        """
        callbacks, self._on_close = self._on_close, None
        if callbacks:
            for callback in callbacks:
                try:
                    callback()
                except Exception:
                    log.exception("a response's close callback failed")

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return default


async def abandon(body: Body) -> None:
    """Close a body its holder is done with, on every path: shielded, within a second, a failure logged.

    For ``finally`` blocks: it runs even while the caller is being
    cancelled, and whatever the body's own ``aclose`` raises (a user's
    iterator) is logged, never passed on to the cleanup around it.
    """
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await body.aclose()
        except Exception:
            log.exception("closing an abandoned body failed")


async def respond(handler: Handler, request: Request) -> Response:
    """``await handler(request)``, with every failure turned into an error response.

    A :class:`~blocks.errors.BlocksError` becomes its status; anything else is
    logged and becomes a 500. Cancellation passes through. This is how every
    listener calls its handler: no traceback ever reaches the wire.
    """
    try:
        return await handler(request)
    except BlocksError as exc:
        log.debug("%r %r -> %d: %s", request.method, request.path, exc.status, exc)
        return error_response(exc.status, exc.headers)
    except Exception:
        log.exception("handler failed for %r %r", request.method, request.path)
        return error_response(500)


def error_response(status: int, headers: Headers | None = None, *, hop: str | None = None) -> Response:
    """The body-and-head every hop answers an error with: the status and its phrase, and why.

    When ``headers`` has a ``proxyblocks-error`` field (``REASON; hop=NAME``,
    see :func:`blocks.errors.error_field`), the one-line body says it too:
    ``502 Bad Gateway: replica_unreachable; hop=worker``. Without one, ``hop``
    (a listener's own answer to a malformed request) adds it, with the
    reason the status means (:func:`blocks.errors.status_reason`).
    """
    if hop is not None and not any(name == fields.ERROR_HEADER for name, _ in headers or ()):
        headers = [*(headers or ()), error_field(status_reason(status), hop)]
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    why = b""
    for name, value in headers or ():
        if name == fields.ERROR_HEADER:
            why = value
            break
    if why:
        return text_response(status, f"{status} {phrase}: {why.decode('latin-1')}\n", headers)
    return text_response(status, f"{status} {phrase}\n", headers)


def json_response(status: int, body: bytes) -> Response:
    """A small JSON answer a hop makes itself (a load report, a session start): never cached."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"cache-control", b"no-store"),
    ]
    return Response(status, headers, BytesBody(body))


_TEXT_PLAIN = (b"content-type", b"text/plain; charset=utf-8")


def text_response(status: int, text: str, headers: Headers | None = None) -> Response:
    """A small text response (error pages, demo endpoints), with its ``content-length`` and ``headers``.

    One of each, whatever ``headers`` hold: a ``content-type`` there replaces
    ``text/plain; charset=utf-8`` (the last one, if several), and a
    ``content-length`` there is dropped, since only the text's own length
    frames it. Names are matched, and passed on, in lowercase.
    """
    data = text.encode()
    length = (b"content-length", b"%d" % len(data))
    if not headers:
        return Response(status, [_TEXT_PLAIN, length], BytesBody(data))
    kind = _TEXT_PLAIN
    head: Headers = [length]
    for field in headers:
        lower = field[0].lower()
        given = field if lower == field[0] else (lower, field[1])  # (as given: a never-indexed field stays one)
        if lower == b"content-type":
            kind = given
        elif lower != b"content-length":
            head.append(given)
    head.insert(0, kind)
    return Response(status, head, BytesBody(data))


Handler = Callable[[Request], Awaitable[Response]]
"""What a listener serves: ``async def handler(request) -> Response``."""

# Hop-by-hop fields (RFC 9110 7.6.1) and the h1-only framing fields that must
# never be forwarded as they are: each hop frames its own messages.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"transfer-encoding",
        b"upgrade",
        b"http2-settings",
    }
)


def strip_hop_by_hop(headers: Headers, *, te_trailers: bool = False) -> Headers:
    """``headers`` without hop-by-hop fields (:data:`HOP_BY_HOP`), nor the fields ``connection`` names.

    With ``te_trailers``, a ``te: trailers`` field stays: the one ``te``
    value HTTP/2 allows, which gRPC requires of a request. Returns the same
    list object when there is nothing to drop, which is the common case.
    """
    drop: set[bytes] | frozenset[bytes] = HOP_BY_HOP
    found = False
    for name, value in headers:
        if name in HOP_BY_HOP:
            found = True
            if name == b"connection":
                drop = drop | {token.strip().lower() for token in value.split(b",")}
    if not found:
        return headers
    if te_trailers:
        return [
            field
            for field in headers
            if field[0] not in drop or (field[0] == b"te" and field[1].strip().lower() == b"trailers")
        ]
    return [field for field in headers if field[0] not in drop]


__all__ = [
    "SAFE_METHODS",
    "Body",
    "BytesBody",
    "IterBody",
    "StreamBody",
    "Request",
    "Wire",
    "Response",
    "Headers",
    "Handler",
    "HOP_BY_HOP",
    "abandon",
    "empty_body",
    "error_response",
    "json_response",
    "respond",
    "strip_hop_by_hop",
    "text_response",
]
