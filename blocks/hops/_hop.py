"""The hop contract: :class:`Hop` (decide, screen, the fast path and the handler path) and :class:`Forward`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import perf_counter

from blocks.errors import BlocksError, HopFailed, StreamReset
from blocks.http import Headers, Request, Response, abandon
from blocks.routing import Address
from blocks.scheduler import Scheduler, TenantKey, header_tenant
from blocks.scheduler._core import Grant
from blocks.timing import Timing, add_server_timing
from blocks.transport._h2 import H2Driver, H2Stream
from blocks.transport._splice import HeadFilter
from blocks.transport._tap import TappedBody, Tee, tap_splice
from blocks.transport.listener import ListenerConfig
from blocks.transport.multiplexer import Upstreams

log = logging.getLogger("blocks.hops")

_SCREENED = object()
"""``request.decision`` after a fast path that screened the request, then found no scheduler slot free."""
INTERNAL_PREFIX = b"x-proxyblocks-"


def _timing(request: Request) -> Timing:
    timing = request.timing
    if timing is None:
        timing = request.timing = Timing()
    return timing


class Forward:
    """Where one request goes next, as a hop's :meth:`Hop.decide` says.

    ``on_close`` runs exactly once when the exchange ends, however it ends
    (release an in-flight count, a slot). ``on_status``, if set, hears the
    status of the upstream's response head, or the error status when the
    upstream never answered (502 for a refused connection, 504 for a
    timeout): what outlier detection feeds on. ``tee``, if set, watches the
    exchange go by without ever holding it up (:class:`~blocks.transport._tap.Tee`; the
    mirror's copy of a sampled request).
    """

    __slots__ = ("address", "headers", "on_close", "on_status", "protocol", "tee")

    def __init__(
        self,
        address: Address,
        headers: Headers,
        *,
        protocol: str = "h2",
        on_close: Callable[[], None] | None = None,
        on_status: Callable[[int], None] | None = None,
        tee: Tee | None = None,
    ) -> None:
        self.address = address
        self.headers = headers
        self.protocol = protocol
        self.on_close = on_close
        self.on_status = on_status
        self.tee = tee


class Hop:
    """A forwarding hop: :meth:`decide` picks the upstream, the rest is shared.

    A subclass implements ``decide(request) -> Forward`` (synchronous: read
    memory, never the network; raise a :class:`~blocks.errors.BlocksError`
    to answer with its status). The hop then offers its listener two ways to
    carry the request out:

    - :meth:`relay`, the fast path for HTTP/2: when the pool has a free
      stream slot to the chosen upstream right now, the stream is spliced
      there and every frame relayed by the connections' readers;
    - :meth:`handle`, the general path (h1, TLS or not, a pool that must
      first open a connection): a task awaits the upstream's response.

    With a :class:`~blocks.scheduler.Scheduler`, a request is admitted
    before it is decided: the fast path takes a slot only if one is free
    now, otherwise the handler waits its turn (or gets the scheduler's 429 or
    503), and the slot is released with the exchange, on every path.

    Before admission, :meth:`screen` runs once per request (nothing by
    default): a request it refuses (the proxy's 401) never takes, nor waits
    for, a slot.

    Either way the decision is made once (a declined fast path leaves it in
    ``request.decision``) and the response head gets this hop's
    Server-Timing entries: ``name`` for the hop's own time, ``upstream_name``
    (if set) for the wait on the upstream, and ``total`` at the outermost hop.
    """

    upstream_name: str | None = None
    total: bool = False

    def __init__(
        self,
        name: str,
        upstreams: Upstreams,
        *,
        scheduler: Scheduler | None = None,
        tenant_key: TenantKey | None = None,
    ) -> None:
        self.name = name
        self.upstreams = upstreams
        self.scheduler = scheduler
        self.tenant_key = tenant_key or header_tenant()

    def decide(self, request: Request) -> Forward:
        raise NotImplementedError

    def screen(self, request: Request) -> None:
        """Refuse a request before it is admitted or decided: raise a :class:`~blocks.errors.BlocksError`.

        Synchronous, like :meth:`decide`, and run once per request. It may
        rewrite ``request.headers`` (strip a credential). The default does
        nothing; the proxy checks proxy-auth tokens here.
        """

    def _head(self, request: Request, on_status: Callable[[int], None] | None, tee: Tee | None = None) -> HeadFilter:
        timing = _timing(request)
        start = perf_counter()
        name, upstream_name, total = self.name, self.upstream_name, self.total

        def head(status: int, headers: Headers) -> Headers:
            if on_status is not None:
                on_status(status)
            if tee is not None:
                tee.head(status, headers)
            timing.upstream = perf_counter() - start
            return add_server_timing(headers, timing.entries(name, upstream_name=upstream_name, total=total))

        return head

    def _admitted(self, request: Request, grant: Grant | None) -> Forward:
        """Decide, once admitted; the grant (if any) is released with the exchange."""
        scheduler = self.scheduler
        try:
            forward = self.decide(request)
        except BaseException:
            if grant is not None and scheduler is not None:
                scheduler.release(grant)
            raise
        if grant is not None and scheduler is not None:
            forward.on_close = _then_release(forward.on_close, scheduler, grant)
        if forward.tee is not None:
            forward.on_close = _then_close(forward.on_close, forward.tee)
        return forward

    def relay(self, request: Request, down: H2Driver, st: H2Stream, ended: bool) -> bool:
        """The listener's fast path (see :func:`blocks.serve_http`): True if spliced.

        It runs in the connection's reader, so whatever it calls that a user
        wrote (``screen``, the tenant key, ``decide`` and the policy behind
        it) must cost only this request when it fails: an exception that is
        not a :class:`~blocks.errors.BlocksError` is logged once, with its
        traceback, and the request answered 500 by the handler path.
        """
        try:
            self.screen(request)
            grant = None
            if self.scheduler is not None:
                grant = self.scheduler.try_acquire(self.tenant_key(request))
                if grant is None:
                    request.decision = _SCREENED
                    return False  # not its turn: the handler waits in the scheduler's queue
            forward = self._admitted(request, grant)
        except BlocksError as exc:
            request.decision = exc
            return False
        except Exception:
            log.exception("%s failed deciding %r %r", self.name, request.method, request.path)
            request.decision = HopFailed(f"{self.name} failed deciding the request")
            return False
        try:
            spliced = forward.protocol == "h2" and self.upstreams.splice(
                forward.address,
                request,
                forward.headers,
                down,
                st,
                request_ended=ended,
                head_filter=self._head(request, forward.on_status, forward.tee),
                on_close=forward.on_close,
            )
        except Exception:
            log.exception("%s failed splicing %r %r", self.name, request.method, request.path)
            if forward.on_close is not None:
                forward.on_close()  # (what decide took: a slot, an in-flight count)
            request.decision = HopFailed(f"{self.name} failed splicing the request")
            return False
        if spliced:
            if forward.tee is not None:
                tap_splice(st, forward.tee, ended)
            return True
        request.decision = forward
        return False

    async def handle(self, request: Request) -> Response:
        decision = request.decision
        if isinstance(decision, BlocksError):
            raise decision
        if decision is None or decision is _SCREENED:
            if decision is None:
                self.screen(request)
            grant = None
            if self.scheduler is not None:
                grant = await self.scheduler.acquire(self.tenant_key(request))  # or 429 / 503
            forward = self._admitted(request, grant)
        else:
            forward = decision
        tee = forward.tee
        head = self._head(request, forward.on_status, tee)
        if tee is not None:
            request.body = TappedBody(request.body, tee.request, tee.abort)
        try:
            response = await self.upstreams.request(
                forward.address, request, forward.headers, protocol=forward.protocol
            )
        except BaseException as exc:
            try:
                if forward.on_status is not None and isinstance(exc, BlocksError) and not isinstance(exc, StreamReset):
                    forward.on_status(exc.status)  # the upstream never answered: 502, 503, 504
            finally:
                if forward.on_close is not None:
                    forward.on_close()
            raise
        if forward.on_close is not None:
            response.call_on_close(forward.on_close)
        try:
            response.headers = head(response.status, response.headers)  # (it runs on_status and the tee's head)
        except BaseException:
            await abandon(response.body)
            response.closed()
            raise
        if tee is not None:
            response.body = TappedBody(response.body, tee.response)
        return response


def _then_close(on_close: Callable[[], None] | None, tee: Tee) -> Callable[[], None]:
    def done() -> None:
        if on_close is not None:
            on_close()
        tee.closed()

    return done


def _then_release(on_close: Callable[[], None] | None, scheduler: Scheduler, grant: Grant) -> Callable[[], None]:
    def done() -> None:
        if on_close is not None:
            on_close()
        scheduler.release(grant)

    return done


# An internal hop's peer is a hop: its connection carries many clients' streams,
# their resets and their window updates, so the per-client abuse limits are off.
INTERNAL_LISTENER = ListenerConfig(
    validate=False,
    max_concurrent_streams=1000,
    max_header_list_size=256 * 1024,
    max_request_body=None,
    max_client_resets=None,
    flood_limit=None,
    max_empty_frames=None,
)
"""Listener settings for hops that only hear from a validating hop.

Its header-list cap is well above the edge's, so the fields hops add on the
way (``via``, ``x-forwarded-*``, the replica name) never tip a head the edge
accepted over a later hop's limit.
"""
