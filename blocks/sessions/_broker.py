"""The proxy's session broker: starts, session tokens, terminates; the trio side of :class:`SessionPlacer`."""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from blocks._sync import one_error
from blocks.errors import NoRoute, SessionLost, Unauthorized, UpstreamProtocolError, UpstreamTimeout
from blocks.fields import (
    PROBE_HEADER,
    REPLICA_HEADER,
    SESSION_HEADER,
    SESSION_LIMIT_HEADER,
    SESSIONS_PATH,
    TARGET_HEADER,
)
from blocks.http import Headers, Request, Response, json_response
from blocks.routing import RouteCache, RouteTable
from blocks.sessions._core import SessionConfig, SessionPlacer, SessionStatistics, SessionTicket
from blocks.sessions._core_tracker import SessionTracker
from blocks.tokens import take_token

if TYPE_CHECKING:
    from blocks.prober import LoadReport
    from blocks.routing import Replica, Routes
    from blocks.tokens import TokenClaims, TokenIssuer, TokenVerifier
    from blocks.transport.multiplexer import Upstreams

log = logging.getLogger("blocks.sessions")

_MAX_ANSWER = 4096
_MAX_LOST = 4096  # replicas remembered as lost by their worker


class SessionBroker:
    """Starts sessions, reads session tokens, ends sessions; made by :func:`open_sessions`.

    The proxy calls it (``serve_proxy(sessions=...)``):

    - :meth:`read` in its screen: a request of a sessioned app that carries a
      session token gets the token's claims (the token is stripped); a
      forged, expired or foreign token is a 401;
    - :meth:`pinned` when it decides: the replica the claims name, or a
      :class:`SessionLost` (410) when that replica left the routes or is
      ``down``. Never another replica;
    - :meth:`start` for ``POST /.proxyblocks/sessions``: a place (or a wait
      in the fair queue), the worker's consent, a signed session token;
    - :meth:`terminate` for ``DELETE /.proxyblocks/sessions``.

    Only :meth:`start` and :meth:`terminate` touch the network (the worker
    that hosts the session). A request of a session reads memory only.
    """

    def __init__(
        self,
        config: SessionConfig,
        routes: Routes,
        upstreams: Upstreams,
        issuer: TokenIssuer,
        verifier: TokenVerifier,
        *,
        control_timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.apps: set[str] = set(config.apps)  # and those whose route store settings make them sessioned
        self.routes = routes
        self.upstreams = upstreams
        self.issuer = issuer
        self.verifier = verifier
        self.control_timeout = control_timeout
        self.clock = clock
        self.placer = SessionPlacer(config)
        self._events: dict[SessionTicket, trio.Event] = {}
        self._queued = trio.Event()  # set when a ticket joins an empty deadline queue
        self._lost: dict[str, float] = {}  # replica -> when its worker said it lost its sessions (bounded)
        settings = routes.app_settings if isinstance(routes, (RouteTable, RouteCache)) else {}
        self.routes_changed(frozenset(settings))

    def __repr__(self) -> str:
        return f"<SessionBroker {self.placer!r}>"

    def statistics(self) -> SessionStatistics:
        return self.placer.statistics()

    # -- on every request of a sessioned app ----------------------------------------------------

    def strip(self, request: Request) -> None:
        """Remove any session token from the request's fields (a start is authorized by proxy auth, not by one)."""
        request.headers = take_token(request.headers, self.config.header, self.config.cookie)[1]

    def authorize_start(self, app: str, request: Request, claims: TokenClaims | None) -> TokenClaims | None:
        """With ``require_auth``, a start needs a proxy-auth token for ``app``: 401 without one.

        ``claims`` are what the proxy's own auth verified (None: nothing); a
        request they already let in (an ``auth`` token's) needs nothing more.
        Returns the claims the start is authorized by (stripping the token
        it reads).
        """
        if not self.config.require_auth or (claims is not None and claims.kind == "auth"):
            return claims
        token, request.headers = take_token(request.headers, b"authorization", bearer=True)
        if token is None:
            raise Unauthorized(f"no proxy-auth token to start a session of app {app!r}")
        return self.verifier.verify(token, now=self.clock(), app=app, kind="auth")

    def read(self, app: str, request: Request) -> TokenClaims | None:
        """The verified claims of the request's session token for ``app`` (now stripped), or None without one.

        Raises :class:`~blocks.tokens.InvalidToken` (a 401) for a token that
        does not verify for ``app`` as a session token.
        """
        token, headers = take_token(request.headers, self.config.header, self.config.cookie)
        if token is None:
            return None
        claims = self.verifier.verify(token, now=self.clock(), app=app, kind="session")
        request.headers = headers
        return claims

    def pinned(self, app: str, claims: TokenClaims) -> Replica:
        """The replica a session's claims name, while it is in the routes and not ``down``; else 410."""
        name = claims.replica or ""
        replica = self.routes.replica(app, name)
        if replica is None or replica.state == "down":
            self.placer.count_gone()
            raise SessionLost(
                f"session {claims.session_id!r}: replica {name!r} of app {app!r} is gone", reason="replica-gone"
            )
        return replica

    def moves(self, app: str, claims: TokenClaims) -> bool:
        """Whether a request of this session is to start a new one elsewhere: its app's sessions may
        move (``on_replica_loss = "restart"``) and its replica is gone from the routes, ``down``, or
        lost by its worker (:meth:`lost`). A dict read or two."""
        if self.placer.limits(app).on_replica_loss != "restart":
            return False
        name = claims.replica or ""
        replica = self.routes.replica(app, name)
        if replica is None or replica.state == "down":
            return True
        lost, issued = self._lost.get(name), claims.issued_at
        # (issued_at is whole seconds: a session started in the second of the loss counts as before it)
        return lost is not None and issued is not None and issued < lost

    def lost(self, replica: str) -> None:
        """``replica``'s worker answered ``session_lost`` (it could not reach it): the sessions it
        hosted until now are gone. For an app whose sessions move, their next requests start anew."""
        if len(self._lost) >= _MAX_LOST:
            self._lost.clear()  # (a bound: forgetting means one more session_lost answer, no harm)
        self._lost[replica] = self.clock()

    async def restart(self, app: str, tenant: str) -> tuple[TokenClaims, str]:
        """A new session of ``app`` for a session whose replica was lost: its claims and token."""
        replica, session = await self._place(app, tenant)
        token = self._mint(app, tenant, session, replica)
        claims = self.verifier.verify(token, now=self.clock(), app=app, kind="session")
        self.placer.count_restarted()
        log.info("a session of app %r moved to %s as %s (on_replica_loss = restart)", app, replica.name, session)
        return claims, token

    def routes_changed(self, apps: frozenset[str]) -> None:
        """The route cache's listener: ``apps``' settings or replicas changed. Keeps :attr:`apps` and
        each app's limits current, and hands the places of new replicas to waiting starts."""
        config, placer = self.config, self.placer
        for app in apps:
            settings = self.routes.settings(app)
            own = settings.sessions if settings is not None else None
            if own is not None:
                self.apps.add(app)
                placer.configure(app, config.for_app(own))
            else:
                placer.configure(app, None)
                if app not in config.apps:
                    self.apps.discard(app)
            if app in self.apps:
                self._grant(app)

    # -- starts and terminates ------------------------------------------------------------------

    async def start(self, app: str, tenant: str) -> Response:
        """Start a session of ``app`` for ``tenant``: place it, have its worker open it, mint its token.

        Waits for a place in the app's fair queue when every replica is full
        (:class:`~blocks.errors.QueueFull` 429 when the queue is, a
        :class:`~blocks.errors.QueueTimeout` 503 at its deadline);
        :class:`~blocks.errors.NoRoute` (503) when the app has no live replica.
        """
        replica, session = await self._place(app, tenant)
        token = self._mint(app, tenant, session, replica)
        ttl = self.placer.limits(app).ttl
        body = json.dumps(
            {"session": session, "token": token, "replica": replica.name, "expires_at": int(self.clock() + ttl)},
            separators=(",", ":"),
        ).encode()
        response = json_response(201, body)
        if self.config.set_cookie and self.config.cookie is not None:
            response.headers.append((b"set-cookie", self._cookie(token.encode(), int(ttl))))
        log.debug("session %s of app %r started on %s", session, app, replica.name)
        return response

    def _mint(self, app: str, tenant: str, session: str, replica: Replica) -> str:
        return self.issuer.mint(
            app=app,
            now=self.clock(),
            ttl=self.placer.limits(app).ttl,
            kind="session",
            tenant=tenant,
            session_id=session,
            replica=replica.name,
        )

    async def _place(self, app: str, tenant: str) -> tuple[Replica, str]:
        """A replica whose worker opened a new session of ``app``, and the session's id: at once, or
        after a wait in the app's queue (also while the app has no live replica, for one to come)."""
        placer, live = self.placer, self._live
        if not live(app) and not placer.limits(app).queue_size:
            raise NoRoute(f"no live replica for app {app!r}", error_reason="no_replica")
        ticket: SessionTicket | None = None
        replica = placer.reserve(app, live(app))
        refusals = 0
        while True:
            if replica is None:
                if ticket is None:
                    ticket = placer.enqueue(app, tenant, trio.current_time())
                else:
                    placer.requeue(ticket)
                self._queued.set()  # the deadline keeper looks again: this one may be the earliest
                self._grant(app)  # places the estimate freed since (an answer, a report) go in queue order
                replica = await self._wait(ticket)
            session = secrets.token_urlsafe(16)
            if await self._open(replica, session, placer.limits(app).max_per_replica):
                break
            # Its worker was full after all (another proxy filled it): try again with
            # what it told us, then wait in the queue rather than go round the replicas.
            refusals += 1
            retry = ticket is None and refusals <= len(live(app))
            replica = placer.reserve(app, live(app)) if retry else None
        return replica, session

    def cookie(self, token: str, app: str) -> bytes | None:
        """The ``set-cookie`` value that hands a client ``token`` of ``app``, or None (no cookie set)."""
        if not self.config.set_cookie or self.config.cookie is None:
            return None
        return self._cookie(token.encode(), int(self.placer.limits(app).ttl))

    async def terminate(self, app: str, claims: TokenClaims) -> Response:
        """End the session ``claims`` name, at its worker; 204, or 410 if its replica is gone."""
        replica = self.pinned(app, claims)
        status, active, capacity, revision = await self._control(b"DELETE", replica, claims.session_id or "")
        if status not in (200, 404):
            raise UpstreamProtocolError(f"worker {replica.worker!r} answered a session terminate with {status}")
        self.placer.observe(replica.name, active, capacity, at=revision)
        self.placer.count_terminated()
        self._grant(app)
        headers: Headers = [(b"cache-control", b"no-store")]
        if self.config.set_cookie and self.config.cookie is not None:
            headers.append((b"set-cookie", self._cookie(b"", 0)))
        return Response(204, headers)

    def report(self, report: LoadReport, taken_at: float) -> None:
        """A worker's load report (the prober's ``on_report``): its replicas' session counts."""
        touched = False
        for name, load in report.replicas.items():
            if load.sessions is not None:
                self.placer.observe(name, load.sessions, load.session_capacity, at=load.session_revision)
                touched = True
        if touched:
            for app in self.apps:
                self._grant(app)

    # -- the parts ------------------------------------------------------------------------------

    def _cookie(self, value: bytes, max_age: int) -> bytes:
        name = self.config.cookie or b""
        return b"%s=%s; Path=/; Max-Age=%d; SameSite=Strict" % (name, value, max_age)

    def _live(self, app: str) -> list[Replica]:
        """Where new sessions of ``app`` may go: its ``live`` replicas (a draining one keeps its sessions only)."""
        return [replica for replica in self.routes.replicas(app) if replica.state == "live"]

    def _grant(self, app: str) -> None:
        if self.placer.waiting(app):
            for ticket in self.placer.grant(app, self._live(app)):
                self._events[ticket].set()

    async def _wait(self, ticket: SessionTicket) -> Replica:
        event = self._events[ticket] = trio.Event()
        try:
            await event.wait()
        except BaseException:
            self.placer.cancel(ticket)
            self._grant(ticket.app)  # a place it was granted goes to the next waiter
            raise
        finally:
            del self._events[ticket]
        if ticket.replica is None:  # expired
            raise self.placer.timeout_error(ticket)
        return ticket.replica

    async def _open(self, replica: Replica, session: str, limit: int) -> bool:
        """Ask the worker to host ``session`` on ``replica`` (held to ``limit``): True if it did, False if full."""
        try:
            status, active, capacity, revision = await self._control(b"POST", replica, session, limit)
        except BaseException:
            self.placer.unanswered(replica.name)
            self._grant_all()
            raise
        if status not in (201, 409):
            self.placer.unanswered(replica.name)
            self._grant_all()
            raise UpstreamProtocolError(f"worker {replica.worker!r} answered a session start with {status}")
        self.placer.answered(replica.name, active, capacity, started=status == 201, at=revision)
        self._grant_all()  # the worker's word may show places the estimate had taken
        return status == 201

    def _grant_all(self) -> None:
        for app in self.apps:
            self._grant(app)

    async def _control(
        self, method: bytes, replica: Replica, session: str, limit: int = 0
    ) -> tuple[int, int, int, int]:
        """One control request to ``replica``'s worker: ``(status, active sessions, capacity, revision)``;
        ``limit``: the app's ``max_per_replica`` (0: none), which the worker holds the replica to."""
        host, port = replica.worker
        request = Request(method, b"http", f"{host}:{port}".encode(), SESSIONS_PATH)
        fields = [
            (PROBE_HEADER, b"1"),
            (SESSION_HEADER, session.encode()),
            (TARGET_HEADER, replica.target),  # where it is: a worker keeps sessions for a replica it reaches by route
            (REPLICA_HEADER, replica.name.encode()),
        ]
        if limit:  # a worker holds a replica it takes on to it
            fields.append((SESSION_LIMIT_HEADER, b"%d" % limit))
        with trio.move_on_after(self.control_timeout):
            response = await self.upstreams.request(replica.worker, request, fields)
            try:
                data = await response.body.read_all(_MAX_ANSWER)
            finally:
                with trio.CancelScope(shield=True):
                    await response.body.aclose()
            try:
                answer = json.loads(data)
                return response.status, int(answer["active"]), int(answer["capacity"]), int(answer["revision"])
            except (ValueError, KeyError, TypeError) as exc:
                raise UpstreamProtocolError(f"worker {replica.worker!r}: a malformed session answer") from exc
        raise UpstreamTimeout(f"worker {replica.worker!r} did not answer a session {method.decode()} in time")

    async def _expire_forever(self) -> None:
        """Answer each waiting start at its deadline; woken early when a start (re)joins a queue."""
        placer = self.placer
        while True:
            deadline = placer.next_deadline()
            self._queued = trio.Event()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._queued.wait()
            for ticket in placer.expire(trio.current_time()):
                self._events[ticket].set()


def _answer(status: int, document: object) -> Response:
    """The worker's session control answers."""
    return json_response(status, json.dumps(document, separators=(",", ":")).encode())


def session_control_response(
    tracker: SessionTracker | None, request: Request, now: float, *, reachable: bool = True
) -> Response:
    """A worker's answer to the proxy's session start (``POST``) or terminate (``DELETE``) at ``now``.

    The request names the session (``x-proxyblocks-session``) and the
    replica (``x-proxyblocks-replica``; the worker takes on one it reaches by
    its route before this, see :meth:`blocks.Worker.take_on`). The answer is ``{"active": n,
    "capacity": c, "revision": r}`` of the replica either way, with 201
    (opened) or 409 (the replica, or the worker, is full) for a start, 200
    (ended) or 404 (no such session) for a terminate; 404 for a replica the
    tracker does not know (or no tracker: the worker keeps no sessions), 405
    for another method. A start on a replica the worker cannot reach now
    (``reachable`` False: it crashed, and lost its sessions) is a 409 too:
    the proxy places it elsewhere, as on a full one.
    """
    session = request.header(SESSION_HEADER)
    replica = (request.header(REPLICA_HEADER) or b"").decode("ascii", "replace")
    if tracker is None or session is None or replica not in tracker.capacities:
        return _answer(404, {"error": "no such replica, or this worker keeps no sessions"})
    name = session.decode("ascii", "replace")
    if request.method == b"POST":
        status = 201 if reachable and tracker.open(name, replica, now) else 409
    elif request.method == b"DELETE":
        status = 200 if tracker.terminate(name) is not None else 404
    else:
        return _answer(405, {"error": "POST or DELETE"})
    capacity = tracker.capacities[replica]
    return _answer(status, {"active": tracker.active(replica), "capacity": capacity, "revision": tracker.revision})


@asynccontextmanager
async def open_sessions(
    config: SessionConfig,
    routes: Routes,
    upstreams: Upstreams,
    issuer: TokenIssuer,
    verifier: TokenVerifier,
    *,
    control_timeout: float = 5.0,
) -> AsyncIterator[SessionBroker]:
    """A :class:`SessionBroker` for the ``async with`` block, its queue deadlines kept by a task of its own.

    ``issuer`` signs the session tokens; ``verifier`` (whose keyring holds
    the issuer's key, and the keys of the other proxies of the fleet) reads
    them. ``upstreams`` carries the starts and terminates to the workers:
    normally the proxy's own pool. Leaving the block answers every waiting
    start with a cancellation.
    """
    broker = SessionBroker(config, routes, upstreams, issuer, verifier, control_timeout=control_timeout)
    unlisten = routes.add_listener(broker.routes_changed) if isinstance(routes, RouteCache) else None
    with one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(broker._expire_forever)
            try:
                yield broker
            finally:
                if unlisten is not None:
                    unlisten()
                nursery.cancel_scope.cancel()
