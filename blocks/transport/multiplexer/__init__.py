"""The stream multiplexer, client side: pooled upstream connections.

:func:`open_upstreams` gives a service-lifetime :class:`Upstreams` whose
:meth:`~Upstreams.request` sends a request to an address and returns the
response as soon as its head arrives; the body streams after it.

HTTP/2 upstreams (the default): per address, a list of connections; a
request takes a stream slot on the first connection below the peer's
*current* ``SETTINGS_MAX_CONCURRENT_STREAMS`` (re-read on every
admission), a further connection is opened when all are full (up to
``max_connections``), and the slot is released on every path: response
done, reset, timeout, cancellation, connection loss. Connections are
opened in the pool's own nursery, never in a request's cancel scope, so a
request that gives up never leaves others waiting on a half-made connection.

GOAWAY and safe retry (RFC 9113 8.7). A connection that receives GOAWAY
takes no new stream (new requests choose or open another connection; a
draining connection does not count toward ``max_connections``); its streams
at or below the GOAWAY's last stream id finish normally, and those above it,
like a stream reset with ``REFUSED_STREAM``, were never processed. Such a
request is retried once on another connection to the same address when none
of its body has gone upstream yet, on the awaiting path and the spliced one
alike; a second refusal, or a refusal after the first body byte, is a 503
(a spliced stream answers 502, as it does any failure before the head).
A stream cut by its connection's end before any response byte (a close
after a GOAWAY, an idle close, a reset, a PING unanswered) is sent again
the same way only if its method is safe; otherwise it fails at once
(the invariant: ``_h2retry``). Nothing else is ever retried.

h2 connection lifetime: ``max_requests_per_connection`` streams at most,
``h2_idle_timeout`` without a stream, a PING after ``h2_ping_interval``
of quiet (and after a GOAWAY that leaves streams waiting) whose ACK is due
within ``h2_ping_timeout``: one keepalive task per pool looks after them.

HTTP/1.1 upstreams: a keep-alive pool of idle connections per address, one
request per connection at a time. A reused connection that turns out to be
closed is retried once on a fresh one when nothing of the request body was
sent.

TLS upstreams (``protocol="https"``): the first handshake's ALPN (``h2``,
else ``http/1.1``) makes the address's pool an h2 or an h1 one, with all of
the above; the certificate is verified against the system's trust store or
``UpstreamConfig.ca_file``, through one client context per ``Upstreams``
(see ``_tls``).

Request bodies are pumped by a task in the pool's nursery (it outlives a
refused first stream), so a handler can return the response (and a listener
start sending it) while the upload is still going: bidirectional streaming.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from blocks._meta import fixup_module_metadata
from blocks._sync import Signal
from blocks.http import Headers, Request, Response
from blocks.transport import Address
from blocks.transport._h2 import H2Driver, H2Stream
from blocks.transport._splice import HeadFilter, Sink
from blocks.transport.multiplexer._config import PoolStatistics, UpstreamConfig
from blocks.transport.multiplexer._h1pool import _H1Pool
from blocks.transport.multiplexer._h2pool import _H2Pool
from blocks.transport.multiplexer._h2retry import _Replay
from blocks.transport.multiplexer._tls import _TlsPool
from blocks.transport.tls import client_context

log = logging.getLogger("blocks.multiplexer")

__all__ = ["PoolStatistics", "UpstreamConfig", "Upstreams", "open_upstreams"]


# -- the service ----------------------------------------------------------------------


@attrs.define(eq=False)
class Upstreams:
    """Every upstream pool of one hop. Use :func:`open_upstreams`."""

    config: UpstreamConfig
    _nursery: trio.Nursery
    _pools: dict[tuple[Address, str], Any] = attrs.field(factory=dict)
    _tls: ssl.SSLContext | None = None  # made once, at the first https pool (or at open, with a ca_file)
    _deadlines: Signal = attrs.field(factory=Signal, init=False)  # set when a stream gets a deadline: the sweeper runs

    def statistics(self) -> list[PoolStatistics]:
        return [pool.statistics() for pool in self._pools.values()]

    async def _sweep(self) -> None:
        # One timer for every response-head deadline of this hop: far cheaper
        # than a cancel scope per request, at the cost of this resolution.
        # With nothing to watch it sleeps until a stream gets a deadline (``_H2Pool.watch``): an idle
        # hop, or one whose streams all have their heads (a token stream), takes no wake-ups for it.
        resolution = self.config.timeout_resolution
        deadlines = self._deadlines
        while True:
            if not any(type(pool) is _H2Pool and (pool.waiting or pool.stalled) for pool in self._pools.values()):
                await deadlines.wait()
            await trio.sleep(resolution)
            now = trio.current_time()
            for pool in self._pools.values():
                if type(pool) is _H2Pool and (pool.waiting or pool.stalled):
                    pool.expire(now)

    def splice(
        self,
        address: Address,
        request: Request,
        headers: Headers,
        down: H2Driver,
        down_st: H2Stream,
        *,
        request_ended: bool,
        head_filter: HeadFilter | None = None,
        on_close: Callable[[], None] | None = None,
        protocol: str = "h2",
    ) -> bool:
        """The fast path: join ``down_st`` to a new h2 stream to ``address``, if one is free now.

        Returns False, having done nothing, when no pooled connection has a
        free stream slot (the caller then takes the awaiting path, which may
        open one). ``on_close`` runs once when the exchange ends, however it ends.
        A stream the upstream refuses before any request body byte went up is
        spliced once more, on another connection (opened if need be).
        ``protocol`` is ``"h2"``, or ``"https"`` (spliced once the first
        handshake to ``address`` settled on h2); ``"h1"`` is never spliced.
        """
        pool = self._pools.get((address, protocol))
        if pool is None:
            return False
        done: bool = pool.splice(request, headers, down, down_st, request_ended, head_filter, on_close)
        return done

    def resplice(self, down_st: H2Stream, address: Address, headers: Headers) -> bool:
        """From a splice's ``head_filter``: send its request to ``address`` with ``headers`` instead.

        The head that came is dropped (the filter then returns None) and its
        stream cancelled; the downstream stream is spliced to a new stream to
        ``address`` (a task: it may open a connection), its own events kept
        meanwhile, as for a refused stream. Only while none of the request
        body went up: False, having done nothing, once it did.
        """
        replay: object = down_st.splice
        if not self.can_resplice(down_st):
            return False
        assert type(replay) is _Replay
        pool = self._pools.get((address, "h2"))
        if pool is None:
            pool = self._pools[(address, "h2")] = _H2Pool(address, self.config, self._nursery, watch=self._deadlines)
        old = replay.splice
        if not replay.elsewhere:  # (else its stream and connection are gone: the pool could not reach them)
            up_st = old.response.src_st
            up_st.splice = None  # its body, if any comes, is dropped with the stream
            old.up.reset(up_st)
        replay.headers = headers
        replay.park()
        self._nursery.start_soon(pool.resplice, replay, old.up)
        return True

    def can_resplice(self, down_st: H2Stream) -> bool:
        """True while :meth:`resplice` would take ``down_st``'s request: none of its body went up."""
        replay: object = down_st.splice
        return type(replay) is _Replay and (replay.events is None or replay.elsewhere) and not replay.splice.closed

    def sink(self, address: Address, request: Request, headers: Headers, sink: Sink, *, protocol: str = "h2") -> bool:
        """Send a body-less ``request`` to ``address`` now, its response to ``sink``; no task.

        Returns False, having done nothing, when no pooled h2 connection has
        a free stream slot (the caller then takes the awaiting path). The
        pool's timeout bounds the wait for the response head (``failed`` with
        :class:`~blocks.errors.UpstreamTimeout`); the sink bounds the rest.
        Nothing is sent again: a refused stream fails. ``protocol`` as for :meth:`splice`.
        """
        pool = self._pools.get((address, protocol))
        if pool is None:
            return False
        done: bool = pool.sink(request, headers, sink)
        return done

    async def request(
        self,
        address: Address,
        request: Request,
        headers: Headers,
        *,
        protocol: str = "h2",
        timeout: float | None = None,
    ) -> Response:
        """Send ``request`` (its method, scheme, authority, path and body) with ``headers``.

        ``protocol`` is ``"h2"`` (cleartext, prior knowledge), ``"h1"``, or
        ``"https"`` (TLS; ALPN settles on h2 or HTTP/1.1).

        Returns once the response head arrived. Raises
        :class:`~blocks.errors.UpstreamConnectError` (502) when the upstream
        cannot be reached or its TLS handshake fails (the message says why),
        :class:`~blocks.errors.UpstreamTimeout` (504) when no head comes
        within ``response_timeout`` of the request's end (with a ``timeout``
        of its own: of the call's start), or the upstream takes no byte of
        the request for ``stall_timeout``,
        :class:`~blocks.errors.UpstreamProtocolError` (502) when the stream
        dies before its head.

        On h2, a stream the upstream never processed (``REFUSED_STREAM``, or
        above a GOAWAY's last stream id) is sent once more on another
        connection if none of the request body had gone up yet, with a
        ``timeout`` of its own; refused again, or refused after the first
        body byte, it is an ``UpstreamProtocolError`` with status 503.
        """
        pool = self._pools.get((address, protocol))
        if pool is None:
            if protocol == "h2":
                pool = _H2Pool(address, self.config, self._nursery, watch=self._deadlines)
            elif protocol == "h1":
                pool = _H1Pool(address, self.config, self._nursery)
            elif protocol == "https":
                if self._tls is None:
                    self._tls = client_context(self.config.ca_file)
                pool = _TlsPool(address, self.config, self._nursery, self._tls, self._pools, self._deadlines)
            else:
                raise ValueError(f"unknown upstream protocol {protocol!r}")
            self._pools[(address, protocol)] = pool
        response: Response = await pool.request(
            request, headers, self.config.response_timeout if timeout is None else timeout
        )
        return response


@asynccontextmanager
async def open_upstreams(config: UpstreamConfig | None = None) -> AsyncIterator[Upstreams]:
    """The upstream pools of one hop, alive for the ``async with`` block.

    Leaving the block closes every pooled connection. With a ``ca_file``
    in ``config``, the TLS client context is made here: a file that cannot
    be loaded is an ``OSError`` at once, not a 502 at the first request.
    """
    config = config or UpstreamConfig()
    tls = None if config.ca_file is None else client_context(config.ca_file)
    async with trio.open_nursery() as nursery:
        upstreams = Upstreams(config, nursery, tls=tls)
        nursery.start_soon(upstreams._sweep)
        try:
            yield upstreams
        finally:
            nursery.cancel_scope.cancel()
            for pool in upstreams._pools.values():
                if type(pool) is _H1Pool:
                    pool.close_idle()


fixup_module_metadata(__name__, globals())
del fixup_module_metadata
