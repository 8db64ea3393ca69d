"""The proxy: authority -> app -> replica in memory, auth, admission, sessions, mirroring."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter

import attrs
import trio

from blocks.errors import RETRYABLE_REASONS, BlocksError, NoRoute, Unauthorized, parse_error_field
from blocks.fields import (
    ENDED_HEADER,
    ERROR_HEADER,
    HEALTH_PATH,
    REPLICA_HEADER,
    REPORT_HEADER,
    ROUTED_HEADER,
    SESSION_HEADER,
    SESSION_TOKEN_HEADER,
    SESSIONS_PATH,
    TARGET_HEADER,
)
from blocks.hops._hop import (
    INTERNAL_LISTENER,
    Admission,
    Exchange,
    Feature,
    Forward,
    Hop,
    NoteKey,
    hop_listener,
    own_error,
)
from blocks.hops.features.cold_start import AwaitReplica, ColdStartConfig, ReplicaWait
from blocks.http import Headers, Response
from blocks.mirror import Mirror, MirrorConfig, open_mirror
from blocks.prober import (
    AutoscaleSignal,
    HealthChecker,
    HealthConfig,
    LoadEstimator,
    ProberAware,
    ProberConfig,
    open_health_checker,
    open_prober,
)
from blocks.routing import (
    Demand,
    LeastInFlight,
    OutlierConfig,
    OutlierDetector,
    Policy,
    Replica,
    RetryBudget,
    RetryBudgetConfig,
    RouteCache,
    Routes,
)
from blocks.scheduler import Scheduler, SchedulerConfig, TenantKey, header_tenant, open_scheduler
from blocks.sessions import SessionBroker, SessionConfig, open_sessions
from blocks.tokens import ProxyAuth, TokenIssuer, TokenVerifier
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http
from blocks.transport.multiplexer import UpstreamConfig, Upstreams, open_upstreams

DEFAULT_OUTLIERS = OutlierConfig()
""":func:`serve_proxy`'s outlier ejection, on unless ``outliers=None``."""

_STATIC_COLD_START = "cold_start waits for the routes to change: the proxy needs a RouteCache"

DEFAULT_HEALTH = HealthConfig()
""":func:`serve_proxy`'s active health checks of its workers and ejected replicas, on unless ``health=None``."""


@attrs.frozen(kw_only=True)
class ProxyConfig:
    """``name``: the proxy's name in ``via``, Server-Timing and errors.
    ``retry_budget``: what :meth:`Proxy.retry` may spend (:class:`~blocks.routing.RetryBudget`);
    None retries every request that reached no replica, once.
    ``cold_start``: a request for an app with no live replica waits for one, bounded
    (:class:`~blocks.hops.AwaitReplica`; the routes must be a :class:`~blocks.routing.RouteCache`);
    None: it is a 503 ``no_replica`` at once."""

    name: str = "proxy"
    retry_budget: RetryBudgetConfig | None = attrs.field(factory=RetryBudgetConfig)
    cold_start: ColdStartConfig | None = None


@attrs.frozen
class ProxyStatistics:
    """``retried``: requests sent to another replica because the first was unreachable;
    ``retries_refused``: retries the retry budget refused (the original error was answered)."""

    in_flight: dict[str, int]
    no_route: int
    retried: int = 0
    retries_refused: int = 0


class AppLookup(Feature):
    """First in the proxy's stack: ``exchange.app`` is the app the authority maps to (None: no route)."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def screen(self, exchange: Exchange) -> None:
        exchange.app = self.routes.app_for(exchange.request.authority)


_NEW_TOKEN: NoteKey[str] = NoteKey("session-token")  # a moved session's new token, for its answer
_REPORT: NoteKey[bool] = NoteKey("report-route")  # the edge asked where the request went


class SessionPin(Feature):
    """Sticky sessions (:mod:`blocks.sessions`) for the broker's apps.

    screen: a request with a session token gets its claims (``exchange.claims``,
    token stripped; a bad token is a 401), timed as ``<proxy>-session``;
    ``POST`` / ``DELETE /.proxyblocks/sessions`` are answered here (a start
    awaits the worker). route: a request of a session goes to the replica
    its token names (a 410 ``session_lost`` if it is gone), with
    ``x-proxyblocks-session``.

    For an app whose sessions may move (``on_replica_loss = "restart"``), a
    request of a session whose replica is gone, ``down`` or lost (its worker
    answered ``session_lost``, ``replica-unreachable``, since the session
    started) waits in screen while the broker starts a new session on
    another replica, and goes there; response: its answer carries the new
    token (``proxyblocks-session-token``, and the cookie). A worker's
    ``replica-unreachable`` answer is heard here (the broker's
    :meth:`~blocks.sessions.SessionBroker.lost`).
    """

    def __init__(self, broker: SessionBroker, tenant_key: TenantKey, name: str) -> None:
        self.broker = broker
        self.tenant_key = tenant_key
        self._phase = f"{name}-session"
        self._via = (b"via", b"2 " + name.encode())

    def screen(self, exchange: Exchange) -> None:
        app = exchange.app
        broker = self.broker
        if app is None or app not in broker.apps:
            return
        request = exchange.request
        if request.path == SESSIONS_PATH:
            if request.method == b"POST":
                broker.strip(request)  # a start is authorized like any request, not by an old session
                exchange.answer = self._start
                return
            exchange.answer = self._terminate if request.method == b"DELETE" else _not_allowed
        start = perf_counter()
        claims = broker.read(app, request)
        if claims is not None:
            exchange.claims = claims
            exchange.timing.phase(self._phase, perf_counter() - start)
            if claims.kind == "session" and exchange.answer is None and broker.moves(app, claims):
                exchange.wait = self._restart

    async def _restart(self, exchange: Exchange) -> None:
        claims = exchange.claims
        assert claims is not None
        tenant = claims.tenant or self.tenant_key(exchange.request)
        exchange.claims, token = await self.broker.restart(claims.app, tenant)
        _NEW_TOKEN.set(exchange, token)

    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        if exchange.session is None:
            return
        notes = exchange.notes
        token = notes.get(_NEW_TOKEN) if notes is not None else None
        if token is not None:
            headers.append((SESSION_TOKEN_HEADER, token.encode()))
            cookie = self.broker.cookie(token, exchange.claims.app if exchange.claims is not None else "")
            if cookie is not None:
                headers.append((b"set-cookie", cookie))
        if status == 503:
            for name, value in headers:
                if name == ENDED_HEADER:
                    if value == b"replica-unreachable" and exchange.replica is not None:
                        self.broker.lost(exchange.replica)
                    break

    def route(self, exchange: Exchange) -> Forward | None:
        claims = exchange.claims
        if claims is None or claims.kind != "session":
            return None
        replica = self.broker.pinned(claims.app, claims)
        name = exchange.replica = replica.name
        session = exchange.session = claims.session_id or ""
        headers = [
            *exchange.request.headers,
            self._via,
            (SESSION_HEADER, session.encode()),
            (TARGET_HEADER, replica.target),
            (REPLICA_HEADER, name.encode()),
        ]
        return Forward(replica.worker, headers)

    async def _start(self, exchange: Exchange) -> Response:
        app = exchange.app
        assert app is not None
        exchange.claims = self.broker.authorize_start(app, exchange.request, exchange.claims)
        return await self.broker.start(app, self.tenant_key(exchange.request))

    async def _terminate(self, exchange: Exchange) -> Response:
        claims = exchange.claims
        if claims is None or claims.kind != "session":
            raise Unauthorized(f"no session token to end a session of app {exchange.app!r}")
        return await self.broker.terminate(claims.app, claims)


async def _not_allowed(exchange: Exchange) -> Response:
    raise BlocksError(f"{exchange.request.method!r} on {SESSIONS_PATH!r}", status=405)


class Authorize(Feature):
    """screen: proxy auth (:class:`~blocks.tokens.ProxyAuth`): a 401 without a valid token for an app that needs one.

    The token is stripped; its claims go to ``exchange.claims``, the check is
    timed as ``<proxy>-auth``. A request a session token already let in
    needs no proxy-auth token (any it carries is stripped).
    """

    def __init__(self, auth: ProxyAuth, name: str) -> None:
        self.auth = auth
        self._phase = f"{name}-auth"

    def screen(self, exchange: Exchange) -> None:
        app = exchange.app
        if app is None:
            return  # no route: 503
        if exchange.answer is not None and exchange.request.path == HEALTH_PATH:
            return  # a health check, answered by the hop (a session start, also an answer, is authorized)
        request = exchange.request
        claims = exchange.claims
        if claims is not None and claims.kind == "session":
            request.headers = self.auth.strip(app, request.headers)
            return
        start = perf_counter()
        claims, request.headers = self.auth.authorize(app, request.headers, time.time())
        if claims is not None:  # the app requires auth: its check is a phase of its own
            exchange.claims = claims
            exchange.timing.phase(self._phase, perf_counter() - start)


class Router(Feature):
    """route: the app's replica, by ``policy`` (in memory, never awaits), among those ``outliers`` has not ejected.

    No app, or no live replica: :class:`~blocks.errors.NoRoute` (503),
    counted. The lookup and the pick are timed as ``<proxy>-route``. The
    request goes to the replica's worker with ``via``,
    ``x-proxyblocks-target`` (how the worker reaches it) and
    ``x-proxyblocks-replica``; ``exchange.picked`` is the replica.
    """

    def __init__(
        self,
        routes: Routes,
        policy: Policy,
        in_flight: Mapping[str, int],
        name: str,
        outliers: OutlierDetector | None,
        budget: RetryBudget | None = None,
    ) -> None:
        self.routes = routes
        self.policy = policy
        self.in_flight = in_flight
        self.outliers = outliers
        self.budget = budget
        """Counts every routed request (one integer add), for :meth:`Proxy.retry`'s budget."""
        self.no_route = 0
        self._phase = f"{name}-route"
        self._via = (b"via", b"2 " + name.encode())

    def route(self, exchange: Exchange) -> Forward:
        start = perf_counter()
        app = exchange.app
        request = exchange.request
        candidates = self.routes.replicas(app) if app is not None else None
        if not candidates:
            self.no_route += 1
            if app:
                raise NoRoute(f"no live replica for {request.authority!r}", error_reason="no_replica")
            raise NoRoute(f"no route for {request.authority!r}")
        if self.outliers is not None:
            candidates = self.outliers.selectable(candidates, exchange.hop.clock())
        replica = self.policy.pick(request, candidates, self.in_flight)
        if self.budget is not None:
            self.budget.requests += 1
        exchange.timing.phase(self._phase, perf_counter() - start)
        return self.forward(exchange, replica)

    def forward(self, exchange: Exchange, replica: Replica) -> Forward:
        """The request, to ``replica`` (``exchange.picked``)."""
        exchange.picked = replica
        name = exchange.replica = replica.name
        headers = [
            *exchange.request.headers,
            self._via,
            (TARGET_HEADER, replica.target),
            (REPLICA_HEADER, name.encode()),
        ]
        return Forward(replica.worker, headers)

    def alternative(self, exchange: Exchange, failed: Replica, *, other_worker: bool = False) -> Replica | None:
        """Another of the app's replicas than ``failed``, by the policy among those not ejected; None if none.

        While another is left: not the same server behind another worker
        either, or, with ``other_worker`` (``failed``'s worker itself
        failed), none behind that worker.
        """
        app = exchange.app
        candidates = [r for r in self.routes.replicas(app) if r.name != failed.name] if app is not None else []
        if other_worker:
            elsewhere = [r for r in candidates if r.worker != failed.worker]
        else:
            elsewhere = [r for r in candidates if r.address != failed.address]
        candidates = elsewhere or candidates
        if not candidates:
            return None
        if self.outliers is not None:
            candidates = list(self.outliers.selectable(candidates, exchange.hop.clock()))
        return self.policy.pick(exchange.request, candidates, self.in_flight)


class InFlight(Feature):
    """Counts each routed request in flight per replica (``exchange.replica``) until it ends; tells ``load`` too."""

    def __init__(self, load: LoadEstimator | None = None, served: dict[str, int] | None = None) -> None:
        self.counts: dict[str, int] = {}
        self.load = load
        self.served = served

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        name = exchange.replica
        assert name is not None
        counts = self.counts
        counts[name] = counts.get(name, 0) + 1
        if self.served is not None:
            self.served[name] = self.served.get(name, 0) + 1
        if self.load is not None:
            self.load.dispatched(name)

    def closed(self, exchange: Exchange) -> None:
        name = exchange.replica
        assert name is not None
        self.counts[name] -= 1
        if self.load is not None:
            self.load.completed(name)


class Outliers(Feature):
    """response: feeds :class:`~blocks.routing.OutlierDetector` each routed replica's status (5xx: a failure).

    A failure whose ``proxyblocks-error`` says the replica could not be
    reached (``replica_unreachable``, ``replica_refused``) counts as such.
    A failure of the proxy's own connection to the worker (its
    ``proxyblocks-error`` names no hop, or this one: a connect that failed,
    a reset or GOAWAY that cut the stream) is the worker's, not the
    replica's: it goes to :meth:`~blocks.routing.OutlierDetector.record_hop`
    for the worker's address, once per connection event, and the healthy
    replicas behind it are not blamed.
    """

    def __init__(self, detector: OutlierDetector) -> None:
        self.detector = detector

    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        replica = exchange.picked
        if replica is None:  # (a session's request is pinned, not picked)
            return
        if status < 500:
            self.detector.record(replica, True, exchange.hop.clock())
            return
        for name, value in headers:
            if name == ERROR_HEADER:
                reason, at = parse_error_field(value)
                unreachable = reason in RETRYABLE_REASONS
                if (unreachable or reason == b"upstream_reset") and (not at or at == exchange.hop.name.encode()):
                    forward = exchange.forward
                    address = forward.address if forward is not None else replica.worker
                    self.detector.record_hop(address, False, exchange.hop.clock(), unreachable=unreachable)
                    return
                break
        else:
            unreachable = False
        self.detector.record(replica, False, exchange.hop.clock(), unreachable=unreachable)


class ReportRoute(Feature):
    """screen: a request whose last field is ``x-proxyblocks-report`` (the edge's access log asks) loses it;
    response: its head gets ``x-proxyblocks-routed: APP REPLICA TENANT`` (``-`` for unknown), which the
    edge's access log reads and removes. A request without it costs one comparison."""

    def __init__(self, tenant_key: TenantKey) -> None:
        self.tenant_key = tenant_key

    def screen(self, exchange: Exchange) -> None:
        headers = exchange.request.headers
        if headers and headers[-1][0] == REPORT_HEADER:
            headers.pop()
            _REPORT.set(exchange, True)

    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        notes = exchange.notes
        if notes is not None and _REPORT in notes:
            try:
                tenant = self.tenant_key(exchange.request)
            except Exception:
                tenant = "-"
            report = f"{exchange.app or '-'} {exchange.replica or '-'} {tenant or '-'}"
            headers.append((ROUTED_HEADER, report.encode("utf-8", "replace")))


class Mirroring(Feature):
    """dispatched: a sampled request of an app whose settings mirror it gets a tee (:mod:`blocks.mirror`)."""

    def __init__(self, mirror: Mirror, routes: Routes, tenant_key: TenantKey) -> None:
        self.mirror = mirror
        self.routes = routes
        self.tenant_key = tenant_key

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        app = exchange.app
        if app is not None and exchange.picked is not None and exchange.tee is None:  # (a retry keeps its tee)
            exchange.tee = self.mirror.tee(self.routes, app, exchange.request, forward.headers, self.tenant_key)


class Proxy(Hop):
    """Routes by authority from in-memory :class:`~blocks.routing.Routes`; never awaits for a decision.

    Its stack, in order: :class:`ReportRoute`, :class:`AppLookup`, :class:`SessionPin` (with
    ``sessions``), :class:`Authorize` (with ``auth``), the caller's
    ``features``, :class:`~blocks.hops.AwaitReplica` (with ``config.cold_start``),
    admission (with ``scheduler``), :class:`Router`,
    :class:`InFlight`, :class:`Outliers` (with ``outliers``),
    :class:`Mirroring` (with ``mirror``). ``routes`` is a static
    :class:`~blocks.routing.RouteTable` or a :class:`~blocks.routing.RouteCache`
    that a route source keeps current.
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
        features: Sequence[Feature] = (),
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.config = config or ProxyConfig()
        name = self.config.name
        tenant_key = tenant_key or header_tenant()
        self.routes = routes
        self.auth = auth
        self.sessions = sessions
        self.mirror = mirror
        self.outliers = outliers
        self.load = load  # told of every dispatch and completion (the prober's correction)
        self.tenant_key = tenant_key
        accounting = InFlight(load)
        self.in_flight = accounting.counts
        budget = self.config.retry_budget
        self.retry_budget = RetryBudget(budget) if budget is not None else None
        self.router = Router(routes, policy or LeastInFlight(), self.in_flight, name, outliers, self.retry_budget)
        stack: list[Feature] = [ReportRoute(tenant_key), AppLookup(routes)]
        if sessions is not None:
            stack.append(SessionPin(sessions, tenant_key, name))
        if auth is not None:
            stack.append(Authorize(auth, name))
        stack += features
        self.cold_start: ReplicaWait | None = None
        """The requests waiting for a replica, with ``config.cold_start``."""
        if self.config.cold_start is not None:
            if not isinstance(routes, RouteCache):
                raise ValueError(_STATIC_COLD_START)
            self.cold_start = ReplicaWait(routes, self.config.cold_start)
            stack.append(AwaitReplica(self.cold_start))
        stack += [self.router, accounting]
        if outliers is not None:
            stack.append(Outliers(outliers))
        if mirror is not None:
            stack.append(Mirroring(mirror, routes, tenant_key))
        admission = Admission(scheduler, tenant_key) if scheduler is not None else None
        super().__init__(name, upstreams, stack, admission=admission, clock=clock)
        self.scheduler = scheduler
        self.health_checker: HealthChecker | None = None
        """The health checker feeding ``outliers``, when :func:`serve_proxy` runs one."""

    retries = True

    @property
    def policy(self) -> Policy:
        return self.router.policy

    def retry(self, exchange: Exchange, status: int, headers: Headers) -> Forward | None:
        """Once per request, one that reached no replica (the worker says ``replica_unreachable`` or
        ``replica_refused``; or the worker itself was unreachable, ``next_hop_unreachable``, or lost
        before it answered a safe request, ``upstream_reset``: then a replica behind another worker is
        taken) goes to another replica of its app (:meth:`~blocks.hops.Hop.resendable`).

        The failure counts for the first replica's outlier detection (or
        its worker's); a session's request (pinned, not picked) is never
        moved. A retry the retry budget refuses (``ProxyConfig.retry_budget``)
        answers the original error, counted in ``retries_refused``.
        """
        failed = exchange.picked
        if failed is None or exchange.retried:
            return None
        reason = self.resendable(exchange, headers, passed_on=True)
        if reason is None:
            return None
        exchange.retried = True
        worker_failed = own_error(headers, self.name) is not None  # (the proxy's own: its link to the worker)
        replica = self.router.alternative(exchange, failed, other_worker=worker_failed)
        if replica is None:
            return None
        route = functools.partial(self.router.forward, exchange, replica)
        return self.send_elsewhere(exchange, status, headers, route, self.retry_budget)

    def demand(self) -> dict[str, Demand]:
        """What waits here, per app that has something waiting: requests held for a replica
        (``cold_start``) and session starts in the app's session queue. What the proxy publishes
        for an autoscaler in another process (:func:`~blocks.sources.demand.serve_demand`)."""
        waiting = self.cold_start.counts() if self.cold_start is not None else {}
        queued = self.sessions.statistics().queued if self.sessions is not None else {}
        demand = {app: Demand(requests=n) for app, n in waiting.items()}
        for app, n in queued.items():
            if n:
                demand[app] = Demand(demand.get(app, Demand()).requests, n)
        return demand

    def statistics(self) -> ProxyStatistics:
        return ProxyStatistics(dict(self.in_flight), self.router.no_route, self.retried, self.retries_refused)


async def serve_proxy(
    routes: Routes,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    policy: Policy | None = None,
    config: ProxyConfig | None = None,
    scheduler: SchedulerConfig | None = None,
    tenant_key: TenantKey | None = None,
    outliers: OutlierConfig | None = DEFAULT_OUTLIERS,
    health: HealthConfig | None = DEFAULT_HEALTH,
    prober: ProberConfig | None = None,
    autoscale: AutoscaleSignal | None = None,
    auth: ProxyAuth | None = None,
    sessions: SessionConfig | None = None,
    session_issuer: TokenIssuer | None = None,
    session_verifier: TokenVerifier | None = None,
    mirror: MirrorConfig | None = None,
    features: Sequence[Feature] = (),
    listener: ListenerConfig = INTERNAL_LISTENER,
    upstream: UpstreamConfig | None = None,
    task_status: trio.TaskStatus[tuple[HTTPServer, Proxy]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a :class:`Proxy`; ``task_status`` gets ``(server, proxy)``.

    With ``scheduler``, requests are admitted to the proxy's upstream slots
    through a fair :class:`~blocks.scheduler.Scheduler` (tenant from
    ``tenant_key``, the ``x-tenant`` header by default). With ``outliers``
    (on by default: :class:`~blocks.routing.OutlierConfig`'s defaults; None
    turns it off), replicas that keep failing are ejected from selection for
    a while (:class:`~blocks.routing.OutlierDetector`). With ``health`` too
    (on by default; None turns it off), a background
    :func:`~blocks.prober.open_health_checker` checks every worker in
    ``routes`` and every ejected replica through its worker once an
    interval, and tells the detector (``proxy.health_checker``): an
    ejection ends as soon as a check passes, a draining worker takes no new
    requests, a dead one is ejected before requests find it; where a prober
    runs, its load polls are the workers' checks. A request that
    reached no replica is sent once more, to another (:meth:`Proxy.retry`). With ``prober``, a background
    :func:`~blocks.prober.open_prober` polls every worker in ``routes`` for
    its replicas' load, the proxy's own dispatches correct it, and the
    default policy becomes :class:`~blocks.prober.ProberAware`; ``autoscale``
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
    the shadows are cancelled once the listener has drained. ``features``
    join the proxy's stack after auth and before the router (see :class:`Proxy`).
    """
    if config is not None and config.cold_start is not None and not isinstance(routes, RouteCache):
        raise ValueError(_STATIC_COLD_START)
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
        detector = OutlierDetector(outliers) if outliers is not None else None
        workers = lambda: {replica.worker for replicas in routes.app_replicas().values() for replica in replicas}  # noqa: E731
        checker = None
        if health is not None and detector is not None:
            checker = await stack.enter_async_context(
                open_health_checker(
                    upstreams,
                    workers,
                    detector,
                    health,
                    replicas=lambda: [replica for replicas in routes.app_replicas().values() for replica in replicas],
                    polled=prober is not None or broker is not None,
                )
            )
        estimator = None
        if prober is not None or broker is not None:
            estimator = LoadEstimator()
            if prober is not None:
                policy = policy or ProberAware(estimator)
            await stack.enter_async_context(
                open_prober(
                    upstreams,
                    workers,
                    estimator,
                    prober,
                    autoscale=autoscale,
                    apps=routes.app_replicas,
                    on_report=broker.report if broker is not None else None,
                    session_apps=broker.apps if broker is not None else (),  # (a live set: settings add apps)
                    on_poll=checker.observe if checker is not None else None,
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
            outliers=detector,
            auth=auth,
            sessions=broker,
            mirror=tee,
            features=features,
        )
        serve = functools.partial(
            serve_http,
            proxy.handle,
            host=host,
            port=port,
            config=hop_listener(listener, proxy),
            relay=proxy.relay,
            upstreams=upstreams,
        )
        server = await nursery.start(serve)
        proxy.server = server
        proxy.health_checker = checker
        task_status.started((server, proxy))


__all__ = [
    "AppLookup",
    "Authorize",
    "DEFAULT_HEALTH",
    "DEFAULT_OUTLIERS",
    "InFlight",
    "Mirroring",
    "Outliers",
    "Proxy",
    "ProxyConfig",
    "ProxyStatistics",
    "ReportRoute",
    "Router",
    "SessionPin",
    "serve_proxy",
]
