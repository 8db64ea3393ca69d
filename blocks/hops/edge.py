"""The edge: faces the clients, validates once, sends everything to the proxy."""

from __future__ import annotations

import contextlib
import functools
import ssl
from collections.abc import Callable, Sequence

import attrs
import trio

from blocks.errors import RETRYABLE_REASONS, NoRoute
from blocks.fields import INTERNAL_PREFIX
from blocks.hops._hop import Exchange, Feature, Forward, Hop, hop_listener, own_error
from blocks.http import Headers, Request, strip_hop_by_hop
from blocks.prober import HealthChecker, HealthConfig, open_health_checker
from blocks.routing import LeastInFlight, OutlierConfig, OutlierDetector, Replica, RetryBudget, RetryBudgetConfig
from blocks.transport import Address
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http
from blocks.transport.multiplexer import UpstreamConfig, Upstreams, open_upstreams
from blocks.transport.streams import KEY_FIELDS

NEXT_HOP_OUTLIERS = OutlierConfig()
"""The edge's ejection of proxies it cannot reach: :class:`~blocks.routing.OutlierConfig`'s defaults."""


def next_hop(name: str, address: Address) -> Replica:
    """A next hop as a hop routes to it: a :class:`~blocks.routing.Replica` named ``name`` whose
    upstream (``worker``) and ``address`` are both ``address``, so that policies and outlier
    detection serve for hops as they do for replicas."""
    return Replica(name=name, worker=address, address=address)


_FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"forwarded"})


def forwarded_headers(request: Request, via: bytes, *, trust_forwarded: bool = False) -> Headers:
    """A client's request fields as the next hop should see them: the edge's header hygiene.

    Drops hop-by-hop fields and those ``connection`` names
    (:func:`~blocks.http.strip_hop_by_hop`, keeping ``te: trailers``) and
    every ``x-proxyblocks-*`` field (a client never picks a replica).
    Unless ``trust_forwarded``, the client's ``x-forwarded-for``,
    ``x-forwarded-proto`` and ``forwarded`` are replaced by the edge's own;
    with it, the peer's address is appended to the ``x-forwarded-for``
    chain. Appends ``via: <client's HTTP version> <via>``. A WebSocket
    (``request.protocol`` set) loses ``sec-websocket-key`` and
    ``-accept``: each h1 leg makes its own.
    """
    drop_forwarded = not trust_forwarded
    headers: Headers = [  # the fields themselves (a never-indexed one stays so)
        field
        for field in strip_hop_by_hop(request.headers, te_trailers=True)
        if not (field[0].startswith(INTERNAL_PREFIX) or (drop_forwarded and field[0] in _FORWARDED))
    ]
    client = request.client.encode()
    if drop_forwarded:
        headers.append((b"x-forwarded-for", client))
        headers.append((b"x-forwarded-proto", request.scheme))
    else:
        # Behind a trusted hop: append ourselves to the chain it started.
        for i, (name, value) in enumerate(headers):
            if name == b"x-forwarded-for":
                headers[i] = (name, value + b", " + client)
                break
        else:
            headers.append((b"x-forwarded-for", client))
    headers.append((b"via", request.http_version.encode() + b" " + via))
    if request.protocol is not None:
        headers = [field for field in headers if field[0] not in KEY_FIELDS]
    return headers


def _addresses(value: Sequence[Address]) -> tuple[Address, ...]:
    return tuple((str(host), int(port)) for host, port in value)


@attrs.frozen(kw_only=True)
class EdgeConfig:
    """The edge's next hops and manners.

    ``proxies``: where the proxies listen, one or several; the edge spreads
    requests across them (least in flight), ejects one that cannot be
    reached (``outliers``), and sends a request that never reached one to
    another (:meth:`Edge.retry`). They are named ``proxy-1``, ``proxy-2``...
    in that order (:meth:`next_hops`); none, when the edge reads them from
    a route store (:func:`serve_edge`'s ``next_hops``). ``proxy``: one proxy, the same as
    ``proxies=(proxy,)``. ``trust_forwarded``: keep the client's own
    ``x-forwarded-*`` fields (only behind another trusted hop).
    ``outliers``: when a proxy is taken out of selection (None: never);
    ``health``: the active checks that eject a proxy before requests find it
    dead and end an ejection as soon as it answers again (None: none;
    needs ``outliers``); ``retry_budget``: what :meth:`Edge.retry` may spend
    (None: every request that reached no proxy is retried, once).
    """

    proxies: tuple[Address, ...] = attrs.field(default=(), converter=_addresses)
    proxy: Address | None = None
    name: str = "edge"
    trust_forwarded: bool = False
    outliers: OutlierConfig | None = NEXT_HOP_OUTLIERS
    health: HealthConfig | None = attrs.field(factory=HealthConfig)
    retry_budget: RetryBudgetConfig | None = attrs.field(factory=RetryBudgetConfig)

    def __attrs_post_init__(self) -> None:
        if self.proxy is not None:
            if self.proxies:
                raise ValueError("give the edge proxy= or proxies=, not both")
            object.__setattr__(self, "proxies", (self.proxy,))

    def next_hops(self) -> tuple[Replica, ...]:
        """The proxies as the edge routes to them: ``proxy-N`` at its address."""
        return tuple(next_hop(f"proxy-{i}", address) for i, address in enumerate(self.proxies, 1))


class ToProxy(Feature):
    """route: a proxy, least in flight among those ``outliers`` has not ejected, with :func:`forwarded_headers`.

    ``next_hops`` gives the proxies to choose from (the config's, or those a
    route store names: see :class:`~blocks.topology.Chain`); ``exchange.picked``
    is the one picked. dispatched / closed: the requests in flight per proxy
    (``in_flight``, by name), which the pick reads. response: the edge's own
    failures with a proxy, and its successes, go to ``outliers`` by the
    proxy's address (where the health checks report too), a reset that cuts
    many streams counting once. One proxy costs no pick.
    """

    def __init__(self, config: EdgeConfig, next_hops: Callable[[], Sequence[Replica]] | None = None) -> None:
        self.config = config
        self._via = config.name.encode()
        static = config.next_hops()
        if next_hops is not None and static:
            found = next_hops
            next_hops = lambda: (*static, *found())  # noqa: E731  (both: the config's and the store's)
        self.next_hops = next_hops or (lambda: static)
        self.outliers = OutlierDetector(config.outliers) if config.outliers is not None else None
        self.in_flight: dict[str, int] = {}
        self.policy = LeastInFlight()
        self.budget = RetryBudget(config.retry_budget) if config.retry_budget is not None else None

    def route(self, exchange: Exchange) -> Forward:
        if self.budget is not None:
            self.budget.requests += 1
        candidates = self.next_hops()
        if not candidates:
            raise NoRoute("the edge knows no proxy", error_reason="no_next_hop")
        if len(candidates) > 1:
            if self.outliers is not None:
                candidates = self.outliers.selectable(candidates, exchange.hop.clock())
            hop = self.policy.pick(exchange.request, candidates, self.in_flight)
        else:
            hop = candidates[0]
        return self.forward(exchange, hop)

    def forward(self, exchange: Exchange, hop: Replica) -> Forward:
        """The request, to proxy ``hop`` (``exchange.picked``)."""
        exchange.picked = hop
        config = self.config
        return Forward(
            hop.worker, forwarded_headers(exchange.request, self._via, trust_forwarded=config.trust_forwarded)
        )

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        picked = exchange.picked
        if picked is not None:
            counts = self.in_flight
            counts[picked.name] = counts.get(picked.name, 0) + 1

    def closed(self, exchange: Exchange) -> None:
        picked = exchange.picked
        if picked is not None:
            self.in_flight[picked.name] -= 1

    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        outliers = self.outliers
        picked = exchange.picked
        if outliers is None or picked is None:
            return
        ok = True
        unreachable = False
        if status >= 500:
            reason = own_error(headers, exchange.hop.name)
            if reason is not None:  # the edge's own failure with this proxy, not one the proxy passed on
                ok = False
                unreachable = reason in RETRYABLE_REASONS
        outliers.record_hop(picked.worker, ok, exchange.hop.clock(), unreachable=unreachable)

    def alternative(self, exchange: Exchange, failed: Replica) -> Replica | None:
        """Another proxy than ``failed``, least in flight among those not ejected; None if none."""
        candidates = [hop for hop in self.next_hops() if hop.worker != failed.worker]
        if not candidates:
            return None
        if self.outliers is not None:
            candidates = list(self.outliers.selectable(candidates, exchange.hop.clock()))
        return self.policy.pick(exchange.request, candidates, self.in_flight)


class Edge(Hop):
    """Faces the clients; everything goes to a proxy.

    Its stack: the caller's ``features``, then :class:`ToProxy`. A WebSocket
    (``request.protocol``, from an h1 Upgrade or an h2 extended CONNECT)
    goes on as an extended CONNECT, its ``:protocol`` carried by the
    request; its ``sec-websocket-version``, ``-protocol`` and
    ``-extensions`` cross, and the fields that bind a handshake to one h1
    connection (``sec-websocket-key``, ``-accept``) never do.

    A request none of which reached a proxy (the edge could not connect,
    or the proxy refused the stream) goes to another proxy, once
    (:meth:`retry`), whatever its method.
    """

    total = True
    retries = True

    def __init__(
        self,
        config: EdgeConfig,
        upstreams: Upstreams,
        *,
        features: Sequence[Feature] = (),
        next_hops: Callable[[], Sequence[Replica]] | None = None,
    ) -> None:
        if not config.proxies and next_hops is None:
            raise ValueError("the edge needs a proxy: EdgeConfig(proxies=...), or next_hops")
        self.to_proxy = ToProxy(config, next_hops)
        self.health_checker: HealthChecker | None = None  # (serve_edge's, checking the proxies)
        super().__init__(config.name, upstreams, [*features, self.to_proxy])
        self.config = config

    def upstream_headers(self, request: Request) -> Headers:
        """The request's fields as the proxy will see them (:func:`forwarded_headers`)."""
        return forwarded_headers(request, self.config.name.encode(), trust_forwarded=self.config.trust_forwarded)

    def upstream_label(self, exchange: Exchange) -> str:
        """A proxy in the edge's error fields: ``proxy-N (host:port)``."""
        picked = exchange.picked
        address = super().upstream_label(exchange)
        return f"{picked.name} ({address})" if picked is not None else address

    def retry(self, exchange: Exchange, status: int, headers: Headers) -> Forward | None:
        """Once per request, one the edge could not get to its proxy (its own ``next_hop_unreachable`` or
        ``next_hop_refused``, or a safe request whose connection was lost before any response byte:
        :meth:`~blocks.hops.Hop.resendable`) goes to another proxy; the failure counts for the first
        one's ejection."""
        failed = exchange.picked
        if failed is None or exchange.retried:
            return None
        if self.resendable(exchange, headers) is None:
            return None
        exchange.retried = True
        hop = self.to_proxy.alternative(exchange, failed)
        if hop is None:
            return None
        route = functools.partial(self.to_proxy.forward, exchange, hop)
        return self.send_elsewhere(exchange, status, headers, route, self.to_proxy.budget)


async def serve_edge(
    config: EdgeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    listener: ListenerConfig | None = None,
    upstream: UpstreamConfig | None = None,
    features: Sequence[Feature] = (),
    next_hops: Callable[[], Sequence[Replica]] | None = None,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an :class:`Edge` on a validating listener until cancelled or drained.

    ``next_hops``, if given, is where the edge reads its proxies on every
    request (a route store's, see :func:`proxies_in`), instead of ``config.proxies``.
    """
    async with contextlib.AsyncExitStack() as stack:
        upstreams = await stack.enter_async_context(open_upstreams(upstream))
        edge = Edge(config, upstreams, features=features, next_hops=next_hops)
        detector = edge.to_proxy.outliers
        if config.health is not None and detector is not None and (next_hops is not None or len(config.proxies) > 1):
            # (one proxy and no other to send to: nothing a check could change)
            proxies = edge.to_proxy.next_hops
            edge.health_checker = await stack.enter_async_context(
                open_health_checker(upstreams, lambda: [hop.worker for hop in proxies()], detector, config.health)
            )
        nursery = await stack.enter_async_context(trio.open_nursery())
        serve = functools.partial(
            serve_http,
            edge.handle,
            host=host,
            port=port,
            ssl_context=ssl_context,
            config=hop_listener(listener, edge),
            relay=edge.relay,
            upstreams=upstreams,
        )
        edge.server = await nursery.start(serve)
        task_status.started(edge.server)


__all__ = [
    "NEXT_HOP_OUTLIERS",
    "Edge",
    "EdgeConfig",
    "ToProxy",
    "forwarded_headers",
    "next_hop",
    "serve_edge",
]
