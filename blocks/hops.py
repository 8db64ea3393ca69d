"""The three hops of the chain: edge, proxy and worker.

Each hop is a handler (``async def handle(request) -> Response``) around a
shared :class:`~blocks.multiplexer.Upstreams`, and a ``serve_*`` function
that runs it on a listener::

    client --h1/h2/TLS--> Edge --h2--> Proxy --h2--> Worker --h2|h1--> replica

- :class:`Edge` faces the clients: the listener validates every head there,
  the edge drops hop-by-hop and internal (``x-proxyblocks-*``) fields, sets
  ``x-forwarded-for``/``x-forwarded-proto``, and sends everything to the
  proxy over pooled h2.
- :class:`Proxy` maps the authority to an app and the app to a replica
  (in memory), and forwards to the replica's worker, naming the replica in
  ``x-proxyblocks-replica``.
- :class:`Worker` relays each stream to its local replica over h2 or h1 and
  counts what is in flight per replica.

Behind the edge every hop trusts the one before it: heads are validated
once, at the edge, and internal listeners run with ``validate=False``.
Each hop appends its entries to the response's ``server-timing`` header
(see :mod:`blocks.timing`).
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable, Mapping
from time import perf_counter

import attrs
import trio

from blocks._h2 import H2Driver, H2Stream
from blocks._splice import HeadFilter
from blocks.errors import NoRoute
from blocks.http import HOP_BY_HOP, Headers, Request, Response
from blocks.listener import HTTPServer, ListenerConfig, serve_http
from blocks.multiplexer import UpstreamConfig, Upstreams, open_upstreams
from blocks.routing import Address, LeastInFlight, Policy, Replica, RouteTable
from blocks.timing import Timing, add_server_timing

INTERNAL_PREFIX = b"x-proxyblocks-"
REPLICA_HEADER = b"x-proxyblocks-replica"
_FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"forwarded"})


def _timing(request: Request) -> Timing:
    timing = request.timing
    if timing is None:
        timing = request.timing = Timing()
    return timing


def _timed_head(
    timing: Timing, hop: str, start: float, *, upstream_name: str | None = None, total: bool = False
) -> HeadFilter:
    """The response-head rewrite every hop applies: its Server-Timing entries.

    ``start`` is when the hop began waiting for its upstream; the wait ends
    when the head arrives, which is when this runs.
    """

    def head(status: int, headers: Headers) -> Headers:
        timing.upstream = perf_counter() - start
        return add_server_timing(headers, timing.entries(hop, upstream_name=upstream_name, total=total))

    return head


# -- edge ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class EdgeConfig:
    """``proxy``: where the proxy listens. ``trust_forwarded``: keep the
    client's own ``x-forwarded-*`` fields (only behind another trusted hop)."""

    proxy: Address
    name: str = "edge"
    trust_forwarded: bool = False


class Edge:
    def __init__(self, config: EdgeConfig, upstreams: Upstreams) -> None:
        self.config = config
        self.upstreams = upstreams
        self._via = config.name.encode()

    def upstream_headers(self, request: Request) -> Headers:
        """The request's fields as the proxy will see them."""
        drop_forwarded = not self.config.trust_forwarded
        connection_tokens: set[bytes] = set()
        for name, value in request.headers:
            if name == b"connection":
                connection_tokens.update(t.strip().lower() for t in value.split(b","))
        headers: Headers = []
        for name, value in request.headers:
            if (
                name in HOP_BY_HOP
                or name.startswith(INTERNAL_PREFIX)
                or (drop_forwarded and name in _FORWARDED)
                or name in connection_tokens
            ):
                if name == b"te" and value.strip().lower() == b"trailers":
                    headers.append((name, value))  # the one TE value h2 allows
                continue
            headers.append((name, value))
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
        headers.append((b"via", request.http_version.encode() + b" " + self._via))
        return headers

    def relay(self, request: Request, down: H2Driver, st: H2Stream, ended: bool) -> bool:
        """Fast path for h2 clients: splice the stream to the proxy."""
        headers = self.upstream_headers(request)
        head = _timed_head(_timing(request), self.config.name, perf_counter(), total=True)
        if self.upstreams.splice(self.config.proxy, request, headers, down, st, request_ended=ended, head_filter=head):
            return True
        request.decision = headers
        return False

    async def handle(self, request: Request) -> Response:
        headers = request.decision or self.upstream_headers(request)
        head = _timed_head(_timing(request), self.config.name, perf_counter(), total=True)
        response = await self.upstreams.request(self.config.proxy, request, headers)
        response.headers = head(response.status, response.headers)
        return response


# -- proxy ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ProxyConfig:
    name: str = "proxy"


@attrs.frozen
class ProxyStatistics:
    in_flight: dict[str, int]
    no_route: int


class Proxy:
    """Routes by authority from an in-memory :class:`RouteTable`; never awaits for a decision."""

    def __init__(
        self,
        routes: RouteTable,
        upstreams: Upstreams,
        *,
        policy: Policy | None = None,
        config: ProxyConfig | None = None,
    ) -> None:
        self.routes = routes
        self.upstreams = upstreams
        self.policy: Policy = policy or LeastInFlight()
        self.config = config or ProxyConfig()
        self.in_flight: dict[str, int] = {}
        self._no_route = 0
        self._via = (b"via", b"2 " + self.config.name.encode())
        self._phase = f"{self.config.name}-route"

    def statistics(self) -> ProxyStatistics:
        return ProxyStatistics(dict(self.in_flight), self._no_route)

    def _route(self, request: Request) -> tuple[Replica, Headers]:
        """Pick the replica (in memory, never awaits); count it in flight."""
        timing = _timing(request)
        start = perf_counter()
        routes = self.routes
        app = routes.app_for(request.authority)
        candidates = routes.replicas(app) if app is not None else None
        if not candidates:
            self._no_route += 1
            raise NoRoute(
                f"no live replica for {request.authority!r}" if app else f"no route for {request.authority!r}"
            )
        replica = self.policy.pick(candidates, self.in_flight)
        timing.phase(self._phase, perf_counter() - start)
        self.in_flight[replica.name] = self.in_flight.get(replica.name, 0) + 1
        return replica, [*request.headers, self._via, (REPLICA_HEADER, replica.name.encode())]

    def _done(self, name: str) -> Callable[[], None]:
        in_flight = self.in_flight

        def done() -> None:
            in_flight[name] -= 1

        return done

    def relay(self, request: Request, down: H2Driver, st: H2Stream, ended: bool) -> bool:
        try:
            replica, headers = self._route(request)
        except NoRoute as exc:
            request.decision = exc
            return False
        head = _timed_head(_timing(request), self.config.name, perf_counter())
        if self.upstreams.splice(
            replica.worker,
            request,
            headers,
            down,
            st,
            request_ended=ended,
            head_filter=head,
            on_close=self._done(replica.name),
        ):
            return True
        request.decision = (replica, headers)
        return False

    async def handle(self, request: Request) -> Response:
        decision = request.decision
        if decision is None:
            replica, headers = self._route(request)
        elif isinstance(decision, NoRoute):
            raise decision
        else:
            replica, headers = decision
        done = self._done(replica.name)
        head = _timed_head(_timing(request), self.config.name, perf_counter())
        try:
            response = await self.upstreams.request(replica.worker, request, headers)
        except BaseException:
            done()
            raise
        response.call_on_close(done)
        response.headers = head(response.status, response.headers)
        return response


# -- worker -----------------------------------------------------------------------------


@attrs.frozen
class LocalReplica:
    """A replica as its worker reaches it."""

    address: Address
    protocol: str = attrs.field(default="h2", validator=attrs.validators.in_(("h2", "h1")))


@attrs.frozen
class WorkerStatistics:
    in_flight: dict[str, int]
    served: dict[str, int]


class Worker:
    """Relays each stream to the replica the proxy named, counting in-flight per replica."""

    def __init__(self, replicas: Mapping[str, LocalReplica], upstreams: Upstreams, *, name: str = "worker") -> None:
        self.replicas = {key.encode(): value for key, value in replicas.items()}
        self.upstreams = upstreams
        self.name = name
        self.in_flight: dict[str, int] = dict.fromkeys(replicas, 0)
        self.served: dict[str, int] = dict.fromkeys(replicas, 0)
        self._via = (b"via", b"2 " + name.encode())

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(dict(self.in_flight), dict(self.served))

    def _target(self, request: Request) -> tuple[str, LocalReplica, Headers]:
        """The replica the proxy named, and the fields to send it; counts it in flight."""
        headers = request.headers
        if headers and headers[-1][0] == REPLICA_HEADER:  # where the proxy puts it
            key = headers[-1][1]
            headers = headers[:-1]
        else:
            found = [v for n, v in headers if n == REPLICA_HEADER]
            key = found[0] if found else b""
            headers = [(n, v) for n, v in headers if n != REPLICA_HEADER]
        target = self.replicas.get(key)
        if target is None:
            if key or len(self.replicas) != 1:
                raise NoRoute(f"replica {key!r} is not on this worker")
            key, target = next(iter(self.replicas.items()))
        headers.append(self._via)
        name = key.decode()
        self.in_flight[name] += 1
        self.served[name] += 1
        return name, target, headers

    def _done(self, name: str) -> Callable[[], None]:
        in_flight = self.in_flight

        def done() -> None:
            in_flight[name] -= 1

        return done

    def relay(self, request: Request, down: H2Driver, st: H2Stream, ended: bool) -> bool:
        try:
            name, target, headers = self._target(request)
        except NoRoute as exc:
            request.decision = exc
            return False
        if target.protocol == "h2":
            head = _timed_head(_timing(request), self.name, perf_counter(), upstream_name="app")
            if self.upstreams.splice(
                target.address,
                request,
                headers,
                down,
                st,
                request_ended=ended,
                head_filter=head,
                on_close=self._done(name),
            ):
                return True
        request.decision = (name, target, headers)
        return False

    async def handle(self, request: Request) -> Response:
        decision = request.decision
        if decision is None:
            name, target, headers = self._target(request)
        elif isinstance(decision, NoRoute):
            raise decision
        else:
            name, target, headers = decision
        done = self._done(name)
        head = _timed_head(_timing(request), self.name, perf_counter(), upstream_name="app")
        try:
            response = await self.upstreams.request(target.address, request, headers, protocol=target.protocol)
        except BaseException:
            done()
            raise
        response.call_on_close(done)
        response.headers = head(response.status, response.headers)
        return response


# -- serving ----------------------------------------------------------------------------

INTERNAL_LISTENER = ListenerConfig(validate=False, max_concurrent_streams=1000, max_header_list_size=256 * 1024)
"""Listener settings for hops that only hear from a validating hop.

Its header-list cap is well above the edge's, so the fields hops add on the
way (``via``, ``x-forwarded-*``, the replica name) never tip a head the edge
accepted over a later hop's limit.
"""


async def serve_edge(
    config: EdgeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    listener: ListenerConfig | None = None,
    upstream: UpstreamConfig | None = None,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an :class:`Edge` on a validating listener until cancelled or drained."""
    async with open_upstreams(upstream) as upstreams:
        edge = Edge(config, upstreams)
        await serve_http(
            edge.handle,
            host=host,
            port=port,
            ssl_context=ssl_context,
            config=listener,
            relay=edge.relay,
            task_status=task_status,
        )


async def serve_proxy(
    routes: RouteTable,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    policy: Policy | None = None,
    config: ProxyConfig | None = None,
    listener: ListenerConfig = INTERNAL_LISTENER,
    upstream: UpstreamConfig | None = None,
    task_status: trio.TaskStatus[tuple[HTTPServer, Proxy]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a :class:`Proxy`; ``task_status`` gets ``(server, proxy)``."""
    async with open_upstreams(upstream) as upstreams, trio.open_nursery() as nursery:
        proxy = Proxy(routes, upstreams, policy=policy, config=config)
        serve = functools.partial(serve_http, proxy.handle, host=host, port=port, config=listener, relay=proxy.relay)
        server = await nursery.start(serve)
        task_status.started((server, proxy))


async def serve_worker(
    replicas: Mapping[str, LocalReplica],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    name: str = "worker",
    listener: ListenerConfig = INTERNAL_LISTENER,
    upstream: UpstreamConfig | None = None,
    task_status: trio.TaskStatus[tuple[HTTPServer, Worker]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a :class:`Worker` for ``replicas``; ``task_status`` gets ``(server, worker)``."""
    async with open_upstreams(upstream) as upstreams, trio.open_nursery() as nursery:
        worker = Worker(replicas, upstreams, name=name)
        serve = functools.partial(serve_http, worker.handle, host=host, port=port, config=listener, relay=worker.relay)
        server = await nursery.start(serve)
        task_status.started((server, worker))
