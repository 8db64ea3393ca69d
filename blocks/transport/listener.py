"""The listener: one port, HTTP/1.1 and HTTP/2, cleartext or TLS.

:func:`serve_http` accepts connections and serves each with a handler
(``async def handler(request) -> Response``). Every connection is sniffed
once: TLS connections pick their protocol by ALPN (``h2`` or
``http/1.1``); cleartext ones that open with the HTTP/2 preface are h2c
(prior knowledge), anything else is HTTP/1.1 through h11. Bytes that begin
like the preface (``PRI *``) and then leave it are a broken HTTP/2 preface,
answered in HTTP/2: GOAWAY(PROTOCOL_ERROR). Both protocols produce the same
:class:`~blocks.http.Request`.

Guarantees:

- A handler's exception never reaches the wire as a traceback: a
  :class:`~blocks.errors.BlocksError` becomes its status, anything else a
  500; after the response started, the stream is reset (h2) or the
  connection closed (h1).
- Nothing one connection does can stop the listener, and nothing one
  stream does can break its connection's other streams.
- :meth:`HTTPServer.drain` stops accepting, sends h2 clients a GOAWAY and
  h1 clients ``connection: close``, lets requests in flight finish, and
  cancels what is left at the deadline. A connection accepted is always
  answered, and what waits in a listening socket's queue when the drain
  begins is accepted and answered before the socket closes (docs/listener.md).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
from typing import TYPE_CHECKING, Any

import attrs
import trio

from blocks._meta import fixup_module_metadata
from blocks.errors import BadRequest
from blocks.http import Handler
from blocks.transport._h1server import serve_h1
from blocks.transport._h2 import H2ConnectionStatistics, Relay
from blocks.transport._h2server import PREFACE as _PREFACE
from blocks.transport._h2server import H2ServerConnection
from blocks.transport._validate import check_authority

if TYPE_CHECKING:
    from blocks.transport.multiplexer import Upstreams

log = logging.getLogger("blocks.listener")

# Where a cleartext connection becomes HTTP/2: the preface, or bytes that begin like
# it and then leave it (a broken preface, which the h2 side refuses with
# GOAWAY(PROTOCOL_ERROR), RFC 9113 3.4). No HTTP/1.1 request begins so: PRI is
# the preface's method alone (RFC 9113 11.6), and only OPTIONS takes the target "*".
_H2_START = b"PRI *"


def _none_or_at_least(minimum: float) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and value < minimum:
            raise ValueError(f"{attribute.name} must be None or >= {minimum}, not {value}")

    return check


_none_or_positive = _none_or_at_least(0)


def _optional_authority(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None:
        try:
            check_authority(value.encode("ascii"))
        except (BadRequest, UnicodeEncodeError):
            raise ValueError(f"{attribute.name} must be a plain host[:port], not {value!r}") from None


@attrs.frozen(kw_only=True)
class ListenerConfig:
    """How a listener treats its peers. Durations in seconds.

    ``validate``: check every inbound head fully (RFC 9113 field and
    pseudo-header rules, the header-list cap, one canonical authority; see
    docs/listener.md). On for anything a stranger can reach; internal
    hops that only hear from a validating hop turn it off, which is where a
    chain's speed comes from.
    """

    validate: bool = True
    max_concurrent_streams: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    stream_window: int = attrs.field(
        default=256 * 1024, validator=[attrs.validators.ge(65535), attrs.validators.le(2**31 - 1)]
    )
    connection_window: int = attrs.field(
        default=16 * 1024 * 1024, validator=[attrs.validators.ge(65535), attrs.validators.le(2**31 - 1)]
    )
    max_header_list_size: int = attrs.field(default=64 * 1024, validator=attrs.validators.ge(1024))
    max_header_count: int = attrs.field(default=100, validator=attrs.validators.ge(8))
    max_request_body: int | None = attrs.field(default=256 * 1024 * 1024, validator=_none_or_positive)
    max_client_resets: int | None = attrs.field(default=200, validator=_none_or_at_least(1))
    flood_limit: int | None = attrs.field(default=1000, validator=_none_or_at_least(10))
    flood_window: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    max_empty_frames: int | None = attrs.field(default=8, validator=_none_or_at_least(1))
    max_outbound_buffer: int = attrs.field(default=1024 * 1024, validator=attrs.validators.ge(64 * 1024))
    h1_header_timeout: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    stall_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    request_body_timeout: float | None = attrs.field(default=None, validator=_none_or_positive)
    h2_idle_timeout: float = attrs.field(default=300.0, validator=attrs.validators.gt(0))
    tls_handshake_timeout: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    first_bytes_timeout: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    h1_idle_timeout: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    close_timeout: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    drain_goaway_delay: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    """h2 drain: the longest the final GOAWAY waits for the client's ACK of the PING sent with the
    first GOAWAY (RFC 9113 6.8: the ACK comes after every stream the client opened in the race); a
    client that answers is sent it one round trip after the first, one that does not, after this."""
    hpack_huffman: bool = False
    enable_connect_protocol: bool = True
    """h2: advertise ``SETTINGS_ENABLE_CONNECT_PROTOCOL`` (RFC 8441), so that
    clients may open WebSockets (and other tunnels) with extended CONNECT."""
    hop: str | None = None
    """The hop this listener serves (each hop sets its name): the listener's own answers to a
    malformed request or a refused upload carry ``proxyblocks-error: REASON; hop=NAME``."""
    max_target: int = attrs.field(default=16 * 1024, validator=attrs.validators.ge(1024))
    """The longest request target (h1, as on the request line) or ``:path`` (h2) taken: a longer
    one is answered 414 (nginx answers past 8 KiB, a CDN past 16 KiB). A target also counts
    against ``max_header_list_size``, as h2 counts ``:path``, so what passes fits every hop."""
    default_authority: str | None = attrs.field(default=None, validator=_optional_authority)
    """The authority of an HTTP/1.0 request without ``Host`` (RFC 9112 3.2 asks it only of
    HTTP/1.1): ``host[:port]``. ``None``: the address the client reached, ``IP:PORT``."""
    reuse_port: bool = False
    """Bind with ``SO_REUSEPORT`` (Linux, the BSDs): several processes, each with a listener of its
    own on the same port, share its connections (the kernel spreads them across the processes that
    accept). Every socket bound to the port must set it; the first address ``host`` resolves to is
    bound (one listener, not one per address). A socket handed down by :func:`inherit_listener`
    and bound to that address is served instead of a new one (a supervising parent's)."""


@attrs.frozen
class ServerStatistics:
    """A listener's connections (h1 and h2), how many it accepted, and each h2 connection's books.

    ``abuse``: h2 connections closed with ENHANCE_YOUR_CALM, by reason
    (``rapid_reset``, ``control_flood``, ``empty_frames``, ``header_flood``;
    docs/limits.md), since the listener started.
    """

    connections: int
    accepted: int
    draining: bool
    h2: tuple[H2ConnectionStatistics, ...] = ()
    abuse: dict[str, int] = attrs.field(factory=dict)


@attrs.define(eq=False)
class HTTPServer:
    """A running listener. Obtain one from ``await nursery.start(serve_http, ...)``."""

    handler: Handler
    config: ListenerConfig
    ssl_context: ssl.SSLContext | None
    relay: Relay | None = None
    upstreams: Upstreams | None = None
    """The pools of the hop serving on this listener (set by ``serve_edge``,
    ``serve_proxy`` and ``serve_worker``), for their statistics."""
    port: int = 0
    host: str = ""
    draining: bool = False
    _accepted: int = 0
    _abuse: dict[str, int] = attrs.field(factory=dict)
    _connections: set[Any] = attrs.field(factory=set)
    _accept_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    _conn_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    _idle: trio.Event = attrs.field(factory=trio.Event)
    _drain_begun: trio.Event = attrs.field(factory=trio.Event)
    _accept_done: bool = False

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def statistics(self) -> ServerStatistics:
        h2 = tuple(c.proto.statistics() for c in self._connections if isinstance(c.proto, H2ServerConnection))
        return ServerStatistics(
            connections=len(self._connections),
            accepted=self._accepted,
            draining=self.draining,
            h2=h2,
            abuse=dict(self._abuse),
        )

    def drain(self) -> None:
        """Stop accepting and ask every connection to finish what it has."""
        if self.draining:
            return
        self.draining = True
        self._drain_begun.set()
        self._accept_scope.cancel()
        for conn in list(self._connections):
            conn.drain()
        self._check_idle()

    async def wait_draining(self) -> None:
        """Return once a drain has begun (:meth:`drain`), at once if it had."""
        await self._drain_begun.wait()

    async def aclose(self, grace: float = 10.0) -> None:
        """Drain, wait up to ``grace`` seconds for requests in flight, then cancel the rest."""
        self.drain()
        with trio.move_on_after(grace):
            await self._idle.wait()
        self._conn_scope.cancel()

    def _check_idle(self) -> None:
        # Idle: draining, no connection, and the accept loops are over (no connection accepted just
        # as the drain began is still on its way to its handler).
        if self.draining and self._accept_done and not self._connections:
            self._idle.set()

    async def _serve(self, listeners: list[trio.SocketListener], task_status: trio.TaskStatus[HTTPServer]) -> None:
        with self._conn_scope:
            async with trio.open_nursery() as conn_nursery:
                try:
                    with self._accept_scope:
                        async with trio.open_nursery() as accept_nursery:
                            for listener in listeners:
                                accept_nursery.start_soon(self._accept, listener, conn_nursery)
                            task_status.started(self)
                finally:
                    for listener in listeners:  # (each closed by its loop, or here if it never ran)
                        await trio.aclose_forcefully(listener)
                # Draining: the listeners are closed; the nursery returns once every connection has finished.
                self._accept_done = True
                self._check_idle()

    async def _accept(self, listener: trio.SocketListener, conn_nursery: trio.Nursery) -> None:
        """Accept on ``listener`` until the drain cancels it (then close it).

        Each connection is counted the moment it is accepted, in this task, not once its handler
        runs: a drain that begins in between still finds it, drains it as it starts (its first
        request is served: h2 answers it with GOAWAY, h1 with ``connection: close``), and waits for
        it. A connection accepted is never dropped unanswered. Capacity errors (out of file
        descriptors, of memory) wait 0.1 s and try again, as ``trio.serve_listeners`` does.

        Closing a listening socket resets the connections waiting in its accept queue (when it is
        the socket's last descriptor), so the drain first accepts every one of them (:meth:`_sweep`),
        with nothing between that and the close. A socket shared with a replacement (inherited from
        a supervising parent) would keep them; sweeping it too costs a few connections a GOAWAY, and
        saves them when the whole command stops.
        """
        async with listener:
            try:
                while True:
                    try:
                        stream = await listener.accept()
                    except OSError as exc:
                        if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                            raise
                        log.warning("accept failed (%s); trying again in 0.1 s", os.strerror(exc.errno))
                        await trio.sleep(0.1)
                        continue
                    self._adopt(stream, conn_nursery)
            except trio.Cancelled:
                if self.draining:
                    self._sweep(listener, conn_nursery)
                raise

    def _adopt(self, stream: trio.SocketStream, conn_nursery: trio.Nursery) -> None:
        self._accepted += 1
        handle = _Connection(self, stream)
        self._connections.add(handle)
        if self.draining:
            handle.drain()
        conn_nursery.start_soon(self._handle, handle)

    def _sweep(self, listener: trio.SocketListener, conn_nursery: trio.Nursery) -> None:
        """Accept, without waiting, every connection in ``listener``'s queue (at most its backlog):
        each is served as a drained one."""
        queue = socket.socket(fileno=os.dup(listener.socket.fileno()))  # (a descriptor of our own, to accept on)
        with queue:
            while True:
                try:
                    accepted, _ = queue.accept()
                except OSError:  # (BlockingIOError: nothing left)
                    return
                self._adopt(trio.SocketStream(trio.socket.from_stdlib_socket(accepted)), conn_nursery)

    async def _handle(self, handle: _Connection) -> None:
        try:
            await handle.run()
        except Exception:
            log.exception("connection failed")
        finally:
            self._connections.discard(handle)
            self._check_idle()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(handle.stream)


_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class _Connection:
    """Sniffs one accepted connection and runs its protocol."""

    def __init__(self, server: HTTPServer, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.proto: Any = None
        self._draining = False

    def drain(self) -> None:
        self._draining = True
        if self.proto is not None:
            self.proto.drain()

    async def run(self) -> None:
        server = self.server
        config = server.config
        try:
            peer = self.stream.socket.getpeername()
            client = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        except OSError:
            client = ""
        transport: trio.abc.Stream = self.stream
        initial = b""
        if server.ssl_context is not None:
            tls = trio.SSLStream(self.stream, server.ssl_context, server_side=True, https_compatible=True)
            with trio.move_on_after(config.tls_handshake_timeout) as scope:
                try:
                    await tls.do_handshake()
                except trio.BrokenResourceError:
                    return
            if scope.cancelled_caught:
                return
            transport = tls
            is_h2 = tls.selected_alpn_protocol() == "h2"
            scheme = b"https"
        else:
            scheme = b"http"
            with trio.move_on_after(config.first_bytes_timeout) as sniffing:
                while len(initial) < len(_PREFACE):
                    data = await transport.receive_some(65536)
                    if not data:
                        return
                    initial += data
                    if not _PREFACE.startswith(initial[: len(_PREFACE)]):
                        break
            if not initial or (sniffing.cancelled_caught and _PREFACE.startswith(initial)):
                return  # nothing, or a preface too slow to finish: close silently
            is_h2 = initial.startswith(_H2_START)  # the preface, or a broken one (the h2 side refuses it)
        if is_h2:
            self.proto = H2ServerConnection(
                transport,
                server.handler,
                config,
                client=client,
                scheme=scheme,
                relay=server.relay,
                abuse=server._abuse,
            )
            if self._draining:
                self.proto.drain()
            await self.proto.run(initial)
        else:
            self.proto = _H1Drain()
            if self._draining:
                self.proto.drain()
            await serve_h1(
                transport,
                server.handler,
                config,
                client=client,
                scheme=scheme,
                initial=initial,
                drain=self.proto,
            )


class _H1Drain:
    """Drain for an HTTP/1.1 connection: finish the request in flight, then close.

    A connection idling between requests is closed at once: its wait for the
    next head runs in ``idle_scope``.
    """

    def __init__(self) -> None:
        self.draining = False
        self.idle_scope: trio.CancelScope | None = None

    def drain(self) -> None:
        self.draining = True
        if self.idle_scope is not None:
            self.idle_scope.cancel()


async def serve_http(
    handler: Handler,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    config: ListenerConfig | None = None,
    relay: Relay | None = None,
    upstreams: Upstreams | None = None,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on ``host:port`` until cancelled or drained.

    Start it with ``server = await nursery.start(serve_http, handler)``;
    ``server.port`` is the bound port (``port=0`` picks a free one). With an
    ``ssl_context``, ALPN offers ``h2`` and ``http/1.1`` (set here, on the caller's
    context). Returns once a drain has finished.

    ``relay`` is a hop's optional fast path for HTTP/2 requests (see
    docs/listener.md, splicing): tried first, synchronously, for every h2 request
    with a valid head; when it declines, ``handler`` serves the request.
    ``upstreams``: the hop's pools, kept on the server for their statistics.
    """
    config = config or ListenerConfig()
    if ssl_context is not None:
        ssl_context.set_alpn_protocols(["h2", "http/1.1"])
    try:
        inherited = _take_inherited(host, port) if config.reuse_port else None
        if inherited is not None:
            listeners = [inherited]
        elif config.reuse_port:
            listeners = [await _open_shared_listener(host, port, backlog=1024)]
        else:
            listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
    except OSError as exc:  # say where: a command prints this one line (a port in use)
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sockname = listeners[0].socket.getsockname()
    server = HTTPServer(handler, config, ssl_context, relay, upstreams, port=sockname[1], host=host)
    log.info("%s listening on %s", config.hop or "server", server.url)
    await server._serve(listeners, task_status)


_inherited: list[socket.socket] = []


def inherit_listener(sock: socket.socket) -> None:
    """Hand this process a listening socket it inherited (a supervising parent's, see
    docs/scale.md): the first listener with ``reuse_port`` on the address it is bound to serves it
    instead of binding a socket of its own, and closes it when it stops accepting. The socket's
    accept queue is then shared with every other process that holds it: what one stops accepting,
    another accepts, and nothing queued is reset while one of them holds it."""
    _inherited.append(sock)


def _take_inherited(host: str, port: int) -> trio.SocketListener | None:
    """The inherited listening socket bound to the first address ``host:port`` resolves to, if any."""
    if not _inherited:
        return None
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    for sock in _inherited:
        try:
            bound = sock.getsockname()
        except OSError:
            continue
        if sock.family == family and bound[:2] == address[:2]:
            _inherited.remove(sock)
            return trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    return None


async def _open_shared_listener(host: str, port: int, *, backlog: int) -> trio.SocketListener:
    """One listening socket on ``host:port`` bound with ``SO_REUSEPORT`` (and ``SO_REUSEADDR``,
    as trio's own listeners): what ``ListenerConfig.reuse_port`` asks for, unless a socket bound
    there was inherited."""
    found = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE)
    if not found:  # (getaddrinfo raises instead, in practice)
        raise OSError(f"no address for {host}")
    family, kind, proto, _, address = found[0]
    sock = trio.socket.socket(family, kind, proto)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEPORT, 1)
        if family == trio.socket.AF_INET6:
            sock.setsockopt(trio.socket.IPPROTO_IPV6, trio.socket.IPV6_V6ONLY, 1)
        await sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


__all__ = [
    "HTTPServer",
    "ListenerConfig",
    "ServerStatistics",
    "inherit_listener",
    "serve_http",
]

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
