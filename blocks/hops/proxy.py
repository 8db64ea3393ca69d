"""The proxy: authority -> app -> replica in memory, auth, admission, sessions, mirroring."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from time import perf_counter

import attrs
import trio

from blocks.errors import BlocksError, NoRoute, Unauthorized
from blocks.hops._hop import INTERNAL_LISTENER, Forward, Hop, _timing
from blocks.http import Request, Response
from blocks.mirror import Mirror, MirrorConfig, open_mirror
from blocks.prober import open_prober
from blocks.prober._core import (
    REPLICA_HEADER,
    AutoscaleSignal,
    LoadEstimator,
    ProberAware,
    ProberConfig,
)
from blocks.routing import LeastInFlight, OutlierConfig, OutlierDetector, Policy, Replica, Routes
from blocks.scheduler import Scheduler, TenantKey, open_scheduler
from blocks.scheduler._core import SchedulerConfig
from blocks.sessions import (
    SESSION_HEADER,
    SESSIONS_PATH,
    SessionBroker,
    SessionConfig,
    open_sessions,
)
from blocks.tokens import ProxyAuth, TokenClaims, TokenIssuer, TokenVerifier
from blocks.transport._h2 import H2Driver, H2Stream
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http
from blocks.transport.multiplexer import UpstreamConfig, Upstreams, open_upstreams


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
    default policy becomes :class:`~blocks.prober._core.ProberAware`; ``autoscale``
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
