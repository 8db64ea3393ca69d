"""The three hops of the chain: edge, proxy and worker.

Each hop is a :class:`Hop`: a synchronous ``decide(request) -> Forward``
around a shared :class:`~blocks.multiplexer.Upstreams`, carried out by the
hop's fast path (``relay``) or handler (``handle``), and a ``serve_*``
function that runs it on a listener::

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

import contextlib
import functools
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from time import perf_counter

import attrs
import trio

from blocks._h2 import H2Driver, H2Stream
from blocks._splice import HeadFilter
from blocks._tap import TappedBody, Tee, tap_splice
from blocks._upgrade import KEY_FIELDS
from blocks.errors import BlocksError, HopFailed, NoRoute, StreamReset, Unauthorized
from blocks.fair_queue import Grant, SchedulerConfig
from blocks.http import HOP_BY_HOP, BytesBody, Headers, Request, Response
from blocks.listener import HTTPServer, ListenerConfig, serve_http
from blocks.load import (
    LOAD_PATH,
    PROBE_HEADER,
    REPLICA_HEADER,
    AutoscaleSignal,
    LoadEstimator,
    ProberAware,
    ProberConfig,
    ReplicaLoad,
    encode_load,
)
from blocks.mirror import Mirror, MirrorConfig, open_mirror
from blocks.multiplexer import UpstreamConfig, Upstreams, open_upstreams
from blocks.prober import open_prober
from blocks.routing import Address, LeastInFlight, OutlierConfig, OutlierDetector, Policy, Replica, Routes
from blocks.scheduler import Scheduler, TenantKey, header_tenant, open_scheduler
from blocks.sessions import (
    SESSION_HEADER,
    SESSIONS_PATH,
    SessionBroker,
    SessionConfig,
    SessionGone,
    SessionTracker,
    WorkerSessionConfig,
    open_sessions,
)
from blocks.sessions._broker import json_response
from blocks.timing import Timing, add_server_timing
from blocks.tokens import ProxyAuth, TokenClaims, TokenIssuer, TokenVerifier

log = logging.getLogger("blocks.hops")

_SCREENED = object()
"""``request.decision`` after a fast path that screened the request, then found no scheduler slot free."""
INTERNAL_PREFIX = b"x-proxyblocks-"
_FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"forwarded"})


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
    exchange go by without ever holding it up (:class:`~blocks._tap.Tee`; the
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
        if forward.protocol == "h2" and self.upstreams.splice(
            forward.address,
            request,
            forward.headers,
            down,
            st,
            request_ended=ended,
            head_filter=self._head(request, forward.on_status, forward.tee),
            on_close=forward.on_close,
        ):
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
            if forward.on_status is not None and isinstance(exc, BlocksError) and not isinstance(exc, StreamReset):
                forward.on_status(exc.status)  # the upstream never answered: 502, 503, 504
            if forward.on_close is not None:
                forward.on_close()
            raise
        if forward.on_close is not None:
            response.call_on_close(forward.on_close)
        response.headers = head(response.status, response.headers)
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


def _decrement(counts: dict[str, int], key: str) -> Callable[[], None]:
    def done() -> None:
        counts[key] -= 1

    return done


# -- edge ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class EdgeConfig:
    """``proxy``: where the proxy listens. ``trust_forwarded``: keep the
    client's own ``x-forwarded-*`` fields (only behind another trusted hop)."""

    proxy: Address
    name: str = "edge"
    trust_forwarded: bool = False


class Edge(Hop):
    """Faces the clients; everything goes to the proxy.

    A WebSocket (``request.protocol``, from an h1 Upgrade or an h2 extended
    CONNECT) goes on as an extended CONNECT, its ``:protocol`` carried by the
    request; its ``sec-websocket-version``, ``-protocol`` and ``-extensions``
    cross, and the fields that bind a handshake to one h1 connection
    (``sec-websocket-key``, ``-accept``) never do.
    """

    total = True

    def __init__(self, config: EdgeConfig, upstreams: Upstreams) -> None:
        super().__init__(config.name, upstreams)
        self.config = config
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
        if request.protocol is not None:
            headers = [(name, value) for name, value in headers if name not in KEY_FIELDS]  # each h1 leg makes its own
        return headers

    def decide(self, request: Request) -> Forward:
        return Forward(self.config.proxy, self.upstream_headers(request))


# -- proxy ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ProxyConfig:
    name: str = "proxy"


@attrs.frozen
class ProxyStatistics:
    in_flight: dict[str, int]
    no_route: int


class Proxy(Hop):
    """Routes by authority from in-memory :class:`~blocks.routing.Routes`; never awaits for a decision.

    ``routes`` is a static :class:`~blocks.routing.RouteTable` or a
    :class:`~blocks.routing.RouteCache` that a route source keeps current.
    With ``auth`` (a :class:`~blocks.tokens.ProxyAuth`), a request for an app
    that requires a proxy-auth token and lacks a valid one for that app is
    a 401 from :meth:`screen`: before the scheduler, the replica pick and any
    upstream.

    With ``sessions`` (a :class:`~blocks.sessions.SessionBroker`), the
    sessioned apps' requests that carry a session token go to the replica
    the token names (a 410 if it is gone), and ``POST`` / ``DELETE
    /.proxyblocks/sessions`` on their domains start and end sessions. A
    valid session token opens its app on its own; a start needs a
    proxy-auth token for the app (``SessionConfig.require_auth``).
    """

    def __init__(
        self,
        routes: Routes,
        upstreams: Upstreams,
        *,
        policy: Policy | None = None,
        config: ProxyConfig | None = None,
        scheduler: Scheduler | None = None,
        tenant_key: TenantKey | None = None,
        outliers: OutlierDetector | None = None,
        load: LoadEstimator | None = None,
        auth: ProxyAuth | None = None,
        sessions: SessionBroker | None = None,
        mirror: Mirror | None = None,
    ) -> None:
        self.config = config or ProxyConfig()
        self.auth = auth
        self.sessions = sessions
        self.mirror = mirror  # copies the sampled requests of apps whose settings say so
        self.outliers = outliers
        self.load = load  # told of every dispatch and completion (the prober's correction)
        super().__init__(self.config.name, upstreams, scheduler=scheduler, tenant_key=tenant_key)
        self.routes = routes
        self.policy: Policy = policy or LeastInFlight()
        self.in_flight: dict[str, int] = {}
        self._no_route = 0
        self._via = (b"via", b"2 " + self.config.name.encode())
        self._phase = f"{self.config.name}-route"
        self._auth_phase = f"{self.config.name}-auth"
        self._session_phase = f"{self.config.name}-session"

    def statistics(self) -> ProxyStatistics:
        return ProxyStatistics(dict(self.in_flight), self._no_route)

    def screen(self, request: Request) -> None:
        """Session tokens and proxy auth, as configured: a 401 for a bad token; tokens are stripped.

        A request of a sessioned app with a valid session token gets its
        claims (``request.claims``), and needs no proxy-auth token. Otherwise,
        a request of an app that requires proxy auth needs a valid
        proxy-auth token for that app.
        """
        auth, sessions = self.auth, self.sessions
        if auth is None and sessions is None:
            return
        start = perf_counter()
        app = self.routes.app_for(request.authority)
        if app is None:
            return  # decide answers 503
        if sessions is not None and app in sessions.apps:
            if request.path == SESSIONS_PATH and request.method == b"POST":
                sessions.strip(request)  # a start is authorized like any request, not by an old session
            else:
                claims = sessions.read(app, request)
                if claims is not None:
                    request.claims = claims
                    if auth is not None:
                        request.headers = auth.strip(app, request.headers)
                    _timing(request).phase(self._session_phase, perf_counter() - start)
                    return
        if auth is not None:
            claims, request.headers = auth.authorize(app, request.headers, time.time())
            if claims is not None:  # the app requires auth: its check is a phase of its own
                request.claims = claims
                _timing(request).phase(self._auth_phase, perf_counter() - start)

    def relay(self, request: Request, down: H2Driver, st: H2Stream, ended: bool) -> bool:
        if self.sessions is not None and request.path == SESSIONS_PATH:
            return False  # a start or terminate: the handler answers it (a task: it awaits the worker)
        return super().relay(request, down, st, ended)

    async def handle(self, request: Request) -> Response:
        sessions = self.sessions
        if sessions is not None and request.decision is None and request.path == SESSIONS_PATH:
            app = self.routes.app_for(request.authority)
            if app is not None and app in sessions.apps:
                return await self._session_control(request, app, sessions)
        return await super().handle(request)

    async def _session_control(self, request: Request, app: str, sessions: SessionBroker) -> Response:
        self.screen(request)
        if request.method == b"POST":
            sessions.authorize_start(app, request)
            return await sessions.start(app, self.tenant_key(request))
        if request.method == b"DELETE":
            claims = request.claims
            if claims is None or claims.kind != "session":
                raise Unauthorized(f"no session token to end a session of app {app!r}")
            return await sessions.terminate(app, claims)
        raise BlocksError(f"{request.method!r} on {SESSIONS_PATH!r}", status=405)

    def decide(self, request: Request) -> Forward:
        """Pick the replica (in memory, never awaits); count it in flight."""
        claims = request.claims
        if claims is not None and claims.kind == "session":
            return self._decide_session(request, claims)
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
        outliers = self.outliers
        if outliers is None:
            replica = self.policy.pick(request, candidates, self.in_flight)
        else:
            replica = self.policy.pick(request, outliers.selectable(candidates, trio.current_time()), self.in_flight)
        timing.phase(self._phase, perf_counter() - start)
        name = replica.name
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        if self.load is not None:
            self.load.dispatched(name)
        headers = [*request.headers, self._via, (REPLICA_HEADER, name.encode())]
        on_status = None if outliers is None else functools.partial(_record_outcome, outliers, replica)
        forward = Forward(replica.worker, headers, on_close=self._release(name), on_status=on_status)
        if self.mirror is not None and app is not None:
            forward.tee = self.mirror.tee(routes, app, request, headers, self.tenant_key)
        return forward

    def _decide_session(self, request: Request, claims: TokenClaims) -> Forward:
        """The replica the session token names: no policy, no lookup beyond the routes in memory."""
        assert self.sessions is not None  # only the broker's read gives session claims
        replica = self.sessions.pinned(claims.app, claims)
        name = replica.name
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        if self.load is not None:
            self.load.dispatched(name)
        headers = [
            *request.headers,
            self._via,
            (SESSION_HEADER, (claims.session_id or "").encode()),
            (REPLICA_HEADER, name.encode()),
        ]
        return Forward(replica.worker, headers, on_close=self._release(name))

    def _release(self, name: str) -> Callable[[], None]:
        in_flight, load = self.in_flight, self.load

        def done() -> None:
            in_flight[name] -= 1
            if load is not None:
                load.completed(name)

        return done


def _record_outcome(outliers: OutlierDetector, replica: Replica, status: int) -> None:
    outliers.record(replica, status < 500, trio.current_time())


# -- worker -----------------------------------------------------------------------------


@attrs.frozen
class LocalReplica:
    """A replica as its worker reaches it.

    ``capacity``: how many requests it takes at once, as the worker's load
    endpoint reports it (0, the default: unknown). ``max_sessions``: how
    many sessions it hosts at once, when its worker keeps sessions (0: no
    limit but the worker's own ``max_sessions``).
    """

    address: Address
    protocol: str = attrs.field(default="h2", validator=attrs.validators.in_(("h2", "h1")))
    capacity: int = attrs.field(default=0, kw_only=True, validator=attrs.validators.ge(0))
    max_sessions: int = attrs.field(default=0, kw_only=True, validator=attrs.validators.ge(0))


@attrs.frozen
class WorkerStatistics:
    in_flight: dict[str, int]
    served: dict[str, int]


class Worker(Hop):
    """Relays each stream to the replica the proxy named, counting in-flight per replica.

    It answers the proxy's control requests itself, those carrying
    ``x-proxyblocks-probe`` (:data:`~blocks.load.PROBE_HEADER`):
    ``GET /.proxyblocks/load`` gets :meth:`load` as JSON, for the prober
    (:mod:`blocks.prober`), and with ``sessions`` (a
    :class:`~blocks.sessions.WorkerSessionConfig`), ``POST`` and ``DELETE
    /.proxyblocks/sessions`` open and end sessions. The edge drops
    ``x-proxyblocks-*`` from clients, so a client's request for those paths
    reaches its app like any other. Normal requests pay two path
    comparisons for it.

    With ``sessions``, a request the proxy sent for a session (its id in
    ``x-proxyblocks-session``, which the replica sees too) counts in its
    session's in-flight, and gets a 410 if this worker does not host that
    session on that replica (ended idle, terminated, or a worker restart).
    """

    upstream_name = "app"

    def __init__(
        self,
        replicas: Mapping[str, LocalReplica],
        upstreams: Upstreams,
        *,
        name: str = "worker",
        sessions: WorkerSessionConfig | None = None,
    ) -> None:
        super().__init__(name, upstreams)
        self.sessions = (
            None
            if sessions is None
            else SessionTracker({key: replica.max_sessions for key, replica in replicas.items()}, sessions)
        )
        self.replicas = {key.encode(): value for key, value in replicas.items()}
        self.in_flight: dict[str, int] = dict.fromkeys(replicas, 0)
        self.served: dict[str, int] = dict.fromkeys(replicas, 0)
        self._via = (b"via", b"2 " + name.encode())

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(dict(self.in_flight), dict(self.served))

    def load(self) -> dict[str, ReplicaLoad]:
        """Per local replica: requests in flight now, and its configured capacity."""
        loads = {}
        tracker = self.sessions
        for key, replica in self.replicas.items():
            name = key.decode()
            if tracker is None:
                loads[name] = ReplicaLoad(self.in_flight[name], replica.capacity)
            else:
                loads[name] = ReplicaLoad(
                    self.in_flight[name], replica.capacity, tracker.active(name), replica.max_sessions, tracker.revision
                )
        return loads

    def load_response(self) -> Response:
        """The answer to a load probe: :meth:`load` as JSON, never cached."""
        data = encode_load(self.name, self.load())
        headers: Headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(data)),
            (b"cache-control", b"no-store"),
        ]
        return Response(200, headers, BytesBody(data))

    def session_response(self, request: Request) -> Response:
        """The answer to the proxy's session start (``POST``) or terminate (``DELETE``).

        ``{"active": n, "capacity": c, "revision": r}`` of the replica either way, with
        201 (opened) or 409 (the replica, or the worker, is full) for a
        start, 200 (ended) or 404 (no such session) for a terminate.
        """
        tracker = self.sessions
        session = request.header(SESSION_HEADER)
        replica = (request.header(REPLICA_HEADER) or b"").decode("ascii", "replace")
        if tracker is None or session is None or replica not in tracker.capacities:
            return json_response(404, {"error": "no such replica, or this worker keeps no sessions"})
        name = session.decode("ascii", "replace")
        if request.method == b"POST":
            status = 201 if tracker.open(name, replica, trio.current_time()) else 409
        elif request.method == b"DELETE":
            status = 200 if tracker.terminate(name) is not None else 404
        else:
            return json_response(405, {"error": "POST or DELETE"})
        active = tracker.active(replica)
        capacity = tracker.capacities[replica]
        return json_response(status, {"active": active, "capacity": capacity, "revision": tracker.revision})

    def relay(self, request: Request, down: H2Driver, st: H2Stream, ended: bool) -> bool:
        path = request.path
        if path == LOAD_PATH or path == SESSIONS_PATH:  # noqa: SIM109  (two compares beat building a tuple per request)
            return False  # the handler answers the proxy (or forwards a client's request for this path)
        return super().relay(request, down, st, ended)

    async def handle(self, request: Request) -> Response:
        # A declined fast path left its decision: only an undecided request can be a probe.
        if request.decision is None and request.header(PROBE_HEADER) is not None:
            if request.path == LOAD_PATH:
                return self.load_response()
            if request.path == SESSIONS_PATH:
                return self.session_response(request)
        return await super().handle(request)

    def decide(self, request: Request) -> Forward:
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
        tracker = self.sessions
        if tracker is not None and len(headers) > 1 and headers[-2][0] == SESSION_HEADER:  # the proxy puts it there
            session = headers[-2][1].decode("ascii", "replace")
            if not tracker.begin(session, name, trio.current_time()):
                raise SessionGone(f"this worker hosts no session {session!r} on replica {name!r}", reason="not-hosted")
            self.in_flight[name] += 1
            self.served[name] += 1
            return Forward(
                target.address,
                headers,
                protocol=target.protocol,
                on_close=functools.partial(self._session_done, name, session),
            )
        self.in_flight[name] += 1
        self.served[name] += 1
        return Forward(target.address, headers, protocol=target.protocol, on_close=_decrement(self.in_flight, name))

    def _session_done(self, name: str, session: str) -> None:
        self.in_flight[name] -= 1
        if self.sessions is not None:
            self.sessions.end(session, trio.current_time())


# -- serving ----------------------------------------------------------------------------

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
            upstreams=upstreams,
            task_status=task_status,
        )


async def serve_proxy(
    routes: Routes,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    policy: Policy | None = None,
    config: ProxyConfig | None = None,
    scheduler: SchedulerConfig | None = None,
    tenant_key: TenantKey | None = None,
    outliers: OutlierConfig | None = None,
    prober: ProberConfig | None = None,
    autoscale: AutoscaleSignal | None = None,
    auth: ProxyAuth | None = None,
    sessions: SessionConfig | None = None,
    session_issuer: TokenIssuer | None = None,
    session_verifier: TokenVerifier | None = None,
    mirror: MirrorConfig | None = None,
    listener: ListenerConfig = INTERNAL_LISTENER,
    upstream: UpstreamConfig | None = None,
    task_status: trio.TaskStatus[tuple[HTTPServer, Proxy]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a :class:`Proxy`; ``task_status`` gets ``(server, proxy)``.

    With ``scheduler``, requests are admitted to the proxy's upstream slots
    through a fair :class:`~blocks.scheduler.Scheduler` (tenant from
    ``tenant_key``, the ``x-tenant`` header by default). With ``outliers``,
    replicas that keep failing are ejected from selection for a while
    (:class:`~blocks.routing.OutlierDetector`). With ``prober``, a background
    :func:`~blocks.prober.open_prober` polls every worker in ``routes`` for
    its replicas' load, the proxy's own dispatches correct it, and the
    default policy becomes :class:`~blocks.load.ProberAware`; ``autoscale``
    then gets every app's in-flight (``proxy.load`` is the estimator).
    With ``auth``, apps that require a proxy-auth token get a 401 without
    one, before admission and routing (:class:`~blocks.tokens.ProxyAuth`).
    With ``sessions``, its apps get sticky sessions
    (:mod:`blocks.sessions`): ``session_issuer`` signs their tokens,
    ``session_verifier`` reads them (by default, ``auth``'s verifier), and a
    prober runs (``prober``, or its defaults) so the proxy hears of sessions
    the workers end; ``autoscale`` then counts a sessioned app's sessions.
    With ``mirror``, apps whose settings record has a ``mirror`` field get a
    sampled share of their requests copied to a shadow (:mod:`blocks.mirror`);
    the shadows are cancelled once the listener has drained.
    """
    async with contextlib.AsyncExitStack() as stack:
        upstreams = await stack.enter_async_context(open_upstreams(upstream))
        fair = await stack.enter_async_context(open_scheduler(scheduler)) if scheduler is not None else None
        broker = None
        if sessions is not None:
            verifier = session_verifier or (auth.verifier if auth is not None else None)
            if session_issuer is None or verifier is None:
                raise ValueError("sessions need a session_issuer, and a session_verifier (or auth's)")
            broker = await stack.enter_async_context(
                open_sessions(sessions, routes, upstreams, session_issuer, verifier)
            )
        estimator = None
        if prober is not None or broker is not None:
            estimator = LoadEstimator()
            if prober is not None:
                policy = policy or ProberAware(estimator)
            await stack.enter_async_context(
                open_prober(
                    upstreams,
                    lambda: {replica.worker for replicas in routes.app_replicas().values() for replica in replicas},
                    estimator,
                    prober,
                    autoscale=autoscale,
                    apps=routes.app_replicas,
                    on_report=broker.report if broker is not None else None,
                    session_apps=sessions.apps if sessions is not None else (),
                )
            )
            if prober is None:
                estimator = None  # polled for sessions only: the policy and the proxy's counts stay as they were
        tee = await stack.enter_async_context(open_mirror(mirror)) if mirror is not None else None
        nursery = await stack.enter_async_context(trio.open_nursery())
        proxy = Proxy(
            routes,
            upstreams,
            policy=policy,
            load=estimator,
            config=config,
            scheduler=fair,
            tenant_key=tenant_key,
            outliers=OutlierDetector(outliers) if outliers is not None else None,
            auth=auth,
            sessions=broker,
            mirror=tee,
        )
        serve = functools.partial(
            serve_http, proxy.handle, host=host, port=port, config=listener, relay=proxy.relay, upstreams=upstreams
        )
        server = await nursery.start(serve)
        task_status.started((server, proxy))


async def serve_worker(
    replicas: Mapping[str, LocalReplica],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    name: str = "worker",
    sessions: WorkerSessionConfig | None = None,
    listener: ListenerConfig = INTERNAL_LISTENER,
    upstream: UpstreamConfig | None = None,
    task_status: trio.TaskStatus[tuple[HTTPServer, Worker]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a :class:`Worker` for ``replicas``; ``task_status`` gets ``(server, worker)``.

    With ``sessions``, the worker keeps its replicas' sessions (each
    replica's ``max_sessions``) and ends the idle ones.
    """
    async with open_upstreams(upstream) as upstreams, trio.open_nursery() as nursery:
        worker = Worker(replicas, upstreams, name=name, sessions=sessions)
        if worker.sessions is not None:
            nursery.start_soon(_expire_sessions, worker.sessions)
        serve = functools.partial(
            serve_http, worker.handle, host=host, port=port, config=listener, relay=worker.relay, upstreams=upstreams
        )
        server = await nursery.start(serve)
        task_status.started((server, worker))


async def _expire_sessions(tracker: SessionTracker) -> None:
    """End idle sessions, looking a few times per ``idle_timeout`` (at least once a second)."""
    interval = min(tracker.config.idle_timeout / 4, 1.0)
    while True:
        await trio.sleep(interval)
        for session, replica in tracker.expire(trio.current_time()):
            log.debug("session %s on %s ended: idle", session, replica)
