"""The hop contract: a :class:`Hop` runs an ordered stack of :class:`Feature` objects for every request.

Theory of operation. A request reaches a hop on one of two paths (see
docs/hops.md): the fast path (:meth:`Hop.relay`, synchronous, inside the h2
connection's reader) or the handler path (:meth:`Hop.handle`, a task). On
either, the hop makes one :class:`Exchange` for it and runs the phases of
its stack in this order, each phase over the features in stack order:

1. ``screen(exchange)``: refuse the request (raise a
   :class:`~blocks.errors.BlocksError`), rewrite its fields, note what later
   phases need (the app, verified claims), answer it here (set
   ``exchange.answer``: the handler awaits it; nothing else runs), or hold
   it (set ``exchange.wait``: the handler awaits it, then goes on: to the
   answer if one is set, say a session start held by a cold start).
2. admission: the hop's :class:`Admission` (a fair scheduler), if any. The
   fast path takes a slot only if one is free now; otherwise the handler
   waits its turn.
3. ``route(exchange)``: the first feature that returns a :class:`Forward`
   decides where the request goes. None returned one: 503.
4. ``dispatched(exchange, forward)``: the request is going out; count it,
   edit ``forward.headers``, start watching it (``exchange.tee``).
5. ``response(exchange, status, headers)``: the upstream's response head
   (edit ``headers`` in place), or the error status when it never answered
   (502, 503, 504; ``headers`` empty).
6. ``closed(exchange)``: exactly once per exchange whose ``dispatched`` ran
   for this feature, however it ends, in reverse stack order.
7. ``answered(exchange, status, headers)``: once per request, the head this
   hop sends back: the upstream's final one (after ``response``), or this
   hop's own error answer (a refusal in ``screen``, no route, an upstream
   that never answered). A request answered by ``exchange.answer`` (a
   probe, a session start) is not heard here.

The invariant the hop keeps: whatever a feature took in ``dispatched`` it
gives back in ``closed``, and the scheduler slot admission took is released,
exactly once, on every path (a refusal, a route that raised, a splice that
failed, a response sent in full, a client that left).

A bug in a feature costs that one request: on the fast path anything but a
:class:`~blocks.errors.BlocksError` is logged with its traceback and answered
500 (:class:`~blocks.errors.HopFailed`); on the handler path the listener
does the same. The stack is resolved once, when the hop is made: a phase no
feature implements costs nothing per request.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import attrs
import trio

from blocks.errors import (
    NEXT_HOP_REASONS,
    RETRYABLE_REASONS,
    UPSTREAM_REASONS,
    BlocksError,
    HopFailed,
    NoRoute,
    StreamReset,
    UpstreamConnectError,
    UpstreamProtocolError,
    error_field,
    parse_error_field,
)
from blocks.fields import ERROR_HEADER, HEALTH_PATH, PROBE_HEADER
from blocks.http import (
    SAFE_METHODS,
    Body,
    Headers,
    Request,
    Response,
    abandon,
    error_response,
    text_response,
)
from blocks.routing import format_address
from blocks.scheduler import Grant, Scheduler, TenantKey, header_tenant
from blocks.timing import Timing, add_server_timing
from blocks.transport import Address
from blocks.transport.listener import HTTPServer, ListenerConfig
from blocks.transport.multiplexer import Upstreams
from blocks.transport.streams import H2Driver, H2Stream, TappedBody, Tee, tap_response, tap_splice

if TYPE_CHECKING:
    from blocks.routing import Replica, RetryBudget
    from blocks.tokens import TokenClaims

log = logging.getLogger("blocks.hops")

Answer = Callable[["Exchange"], Awaitable[Response]]
"""A hop's own answer to a request (a probe, a session start): see :attr:`Exchange.answer`."""

Wait = Callable[["Exchange"], Awaitable[None]]
"""What a request waits for before admission (a cold start): see :attr:`Exchange.wait`."""


T = TypeVar("T")
D = TypeVar("D")


class NoteKey(Generic[T]):
    """A typed key for a feature's own per-request state on an :class:`Exchange` (``exchange.notes``),
    in the spirit of :class:`contextvars.ContextVar`: one module-level key per kind of note, its value
    type checked by mypy::

        ATTEMPTS: NoteKey[int] = NoteKey("attempts")

        class CountAttempts(Feature):
            def screen(self, exchange: Exchange) -> None:
                ATTEMPTS.set(exchange, ATTEMPTS.get(exchange, 0) + 1)

    Keys compare by identity: two features never share a note by a name they both chose.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<NoteKey {self.name}>"

    @overload
    def get(self, exchange: Exchange) -> T | None: ...
    @overload
    def get(self, exchange: Exchange, default: D) -> T | D: ...
    def get(self, exchange: Exchange, default: object = None) -> object:
        """This note of ``exchange``, or ``default`` if none was set."""
        notes = exchange.notes
        return default if notes is None else notes.get(self, default)

    def set(self, exchange: Exchange, value: T) -> None:
        """Note ``value`` on ``exchange`` (replacing what was there)."""
        notes = exchange.notes
        if notes is None:
            exchange.notes = {self: value}
        else:
            notes[self] = value


class Forward:
    """Where one request goes next: the ``route`` phase's result.

    ``headers`` are the fields it goes with (``dispatched`` may edit them);
    ``protocol`` is ``"h2"`` (pooled, spliced when it can be), ``"h1"``, or
    ``"https"`` (TLS; spliced too once its handshake settled on h2).
    """

    __slots__ = ("address", "headers", "protocol")

    def __init__(self, address: Address, headers: Headers, *, protocol: str = "h2") -> None:
        self.address = address
        self.headers = headers
        self.protocol = protocol

    def __repr__(self) -> str:
        return f"<Forward {self.protocol} {self.address[0]}:{self.address[1]}>"


class Exchange:
    """One request at one hop: the typed context its features share.

    ``request.exchange`` is this object from the moment the hop sees the
    request. Fields a hop's features fill in (None until then):

    - ``app``: the app the authority maps to (the proxy's first screen);
    - ``claims``: the verified claims of the request's token, proxy-auth or
      session (what :func:`~blocks.scheduler.token_tenant` reads);
    - ``replica``: the replica's name, once routed (``picked``: its routing
      entry, when the proxy's policy picked it); ``session``: the session
      id, for a request of a session;
    - ``answer``: set in ``screen`` to answer the request at this hop
      (``await answer(exchange)`` gives the response); nothing else runs;
    - ``wait``: set in ``screen`` to hold the request until local state is
      ready (a cold start's first replica): the request takes the handler
      path, which awaits ``wait(exchange)`` before admission (and before
      ``answer``, when both are set: a session start needs a replica); it must wait
      on memory (an event), never on the network, and raise a
      :class:`~blocks.errors.BlocksError` to refuse;
    - ``tee``: set in ``dispatched`` to watch the exchange go by, never
      holding it up (the mirror's copy; :class:`~blocks.transport.Tee`);
    - ``forward``: the route's :class:`Forward`; ``grant``: the scheduler
      slot admission took;
    - ``notes``: your features' own per-request state, by :class:`NoteKey`
      (``KEY.get(exchange)``, ``KEY.set(exchange, value)``; None until the first);
    - ``answer_status``: set by a ``response`` hook that re-classifies this
      hop's own error answer (it rewrote the ``proxyblocks-error`` field in
      the head it was given, say ``session_lost`` for ``replica_unreachable``):
      the status that answer goes out with instead.

    ``hop.clock()`` is the hop's clock (``trio.current_time`` unless the hop
    was given another): read it instead of calling trio, so a feature's
    decisions can be tested without a trio run.
    """

    __slots__ = (
        "_dispatched",
        "answer",
        "answer_status",
        "app",
        "claims",
        "down",
        "error",
        "forward",
        "grant",
        "hop",
        "notes",
        "picked",
        "queued",
        "replica",
        "request",
        "retried",
        "session",
        "start",
        "tee",
        "wait",
    )

    def __init__(self, hop: Hop, request: Request) -> None:
        self.hop = hop
        self.request = request
        self.app: str | None = None
        self.claims: TokenClaims | None = None
        self.replica: str | None = None
        self.picked: Replica | None = None
        self.session: str | None = None
        self.answer: Answer | None = None
        self.answer_status: int | None = None
        self.wait: Wait | None = None
        self.tee: Tee | None = None
        self.forward: Forward | None = None
        self.grant: Grant | None = None
        self.error: BlocksError | None = None
        self.queued = False
        self.retried = False
        self.down: H2Stream | None = None
        self.notes: dict[NoteKey[Any], Any] | None = None
        self.start = 0.0
        self._dispatched = 0
        request.exchange = self

    def __repr__(self) -> str:
        return f"<Exchange {self.request.method!r} {self.request.path!r} at {self.hop.name} -> {self.forward!r}>"

    @property
    def timing(self) -> Timing:
        """The request's Server-Timing clock at this hop (made on first use)."""
        timing = self.request.timing
        if timing is None:
            timing = self.request.timing = Timing()
        return timing

    def head(self, status: int, headers: Headers) -> Headers:
        """The upstream's response head passes: ``response`` hooks, then this hop's Server-Timing entries.

        An error head whose ``proxyblocks-error`` names no hop is this hop's
        own (a splice that failed): it gets ``; hop=NAME``.
        """
        hop = self.hop
        if status >= 500:
            for i, (name, value) in enumerate(headers):
                if name == ERROR_HEADER:
                    if b"hop=" not in value:
                        headers[i] = hop.error_field(value.decode("latin-1"), self)
                    break
        for response in hop._responses:
            response(self, status, headers)
        if self.tee is not None:
            self.tee.head(status, headers)
        timing = self.timing
        timing.upstream = perf_counter() - self.start
        for answered in hop._answered:
            answered(self, status, headers)
        headers = add_server_timing(headers, timing.entries(hop.name, upstream_name=hop.upstream_name, total=hop.total))
        if self.answer_status is not None:  # (a hook re-classified this hop's own error: the splice reads it)
            headers.insert(0, (b":status", b"%d" % self.answer_status))
        return headers

    def retry_head(self, status: int, headers: Headers) -> Headers | None:
        """A spliced response head, at a hop that retries: an error the hop sends elsewhere is dropped (None)."""
        if status >= 500 and not self.retried and self.down is not None:
            hop = self.hop
            down = self.down
            if hop.upstreams.can_resplice(down):
                forward = hop.retry(self, status, headers)
                if forward is not None and hop.upstreams.resplice(down, forward.address, forward.headers):
                    return None
        return self.head(status, headers)

    def failed(self, status: int, headers: Headers | None = None) -> None:
        """The upstream never answered (or is being left for another): the ``response`` hooks hear the error."""
        for response in self.hop._responses:
            response(self, status, headers if headers is not None else [])

    def undispatch(self) -> None:
        """Before sending the exchange elsewhere: the ``closed`` hooks give back what ``dispatched`` took.

        The scheduler slot and the tee stay; :meth:`dispatch` follows.
        """
        observers = self.hop._closers
        n, self._dispatched = self._dispatched, 0
        for i in range(n - 1, -1, -1):
            closer = observers[i]
            if closer is not None:
                closer(self)

    def dispatch(self, forward: Forward) -> None:
        """The exchange goes to ``forward``: the ``dispatched`` hooks (after :meth:`undispatch`)."""
        self.forward = forward
        for n, dispatched in enumerate(self.hop._dispatchers, 1):
            if dispatched is not None:
                dispatched(self, forward)
            self._dispatched = n

    def closed(self) -> None:
        """The exchange is over: ``closed`` hooks in reverse stack order, the tee, then the slot. Idempotent."""
        observers = self.hop._closers
        n, self._dispatched = self._dispatched, 0
        error: BaseException | None = None
        for i in range(n - 1, -1, -1):
            closer = observers[i]
            if closer is not None:
                try:
                    closer(self)
                except BaseException as exc:  # the others still give back what they took
                    error = exc
        tee, self.tee = self.tee, None
        if tee is not None:
            tee.closed()
        grant, self.grant = self.grant, None
        if grant is not None:
            admission = self.hop.admission
            assert admission is not None
            admission.scheduler.release(grant)
        if error is not None:
            raise error


class Feature:
    """One step of a hop's stack; override only the phases it needs (the others cost nothing).

    Every phase is synchronous and runs once per request, on the fast path
    inside the h2 connection's reader: it must not await, block or touch
    the network, and must not raise for control flow. Raise a
    :class:`~blocks.errors.BlocksError` to answer with its status (a 401,
    a 429); anything else is a bug, logged and answered 500, costing only
    this request. Keep per-request state on the :class:`Exchange`
    (a :class:`NoteKey`'s note for your own), never on the feature.
    """

    def screen(self, exchange: Exchange) -> None:
        """Before admission. Refuse (raise), rewrite ``exchange.request.headers``, note, set ``answer``,
        or set ``wait`` (the request then takes the handler path, which awaits it before admission)."""

    def route(self, exchange: Exchange) -> Forward | None:
        """After admission: where the request goes, or None to leave it to the next feature."""
        return None

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        """The request is going out as ``forward``: take what ``closed`` gives back, edit its headers."""

    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        """The response head (``headers`` editable in place), or an error status with no head."""

    def closed(self, exchange: Exchange) -> None:
        """The exchange ended, however: give back what ``dispatched`` took. Runs once, in reverse stack order."""

    def answered(self, exchange: Exchange, status: int, headers: Headers) -> None:
        """The head this hop sends back, once per request (its own error answers included); read only."""


def _overrides(feature: Feature, phase: str) -> bool:
    return getattr(type(feature), phase) is not getattr(Feature, phase)


class Admission:
    """Admission through a fair :class:`~blocks.scheduler.Scheduler`, between ``screen`` and ``route``.

    The fast path takes a slot only if one is free now; otherwise the request
    takes the handler path and waits its turn there (or gets the scheduler's
    429 or 503). The slot is released with the exchange, on every path.
    """

    def __init__(self, scheduler: Scheduler, tenant_key: TenantKey | None = None) -> None:
        self.scheduler = scheduler
        self.tenant_key = tenant_key or header_tenant()

    def admit_nowait(self, exchange: Exchange) -> bool:
        grant = self.scheduler.try_acquire(self.tenant_key(exchange.request))
        exchange.grant = grant
        return grant is not None

    async def admit(self, exchange: Exchange) -> None:
        exchange.grant = await self.scheduler.acquire(self.tenant_key(exchange.request))


class Hop:
    """A forwarding hop: an ordered stack of :class:`Feature` objects around shared :class:`Upstreams`.

    The listener calls :meth:`relay` (the fast path for HTTP/2: when the
    pool has a free stream slot to the chosen upstream right now, the
    stream is spliced there and every frame relayed by the connections'
    readers) and :meth:`handle` (the general path: a task awaits the
    upstream's response). Both run the same phases, once per request (see
    the module's docstring), and give the response head this hop's
    Server-Timing entries: ``name`` for the hop's own time,
    ``upstream_name`` (if set) for the wait on the upstream, and ``total``
    at the outermost hop.
    """

    upstream_name: str | None = None
    total: bool = False
    retries: bool = False
    """True if :meth:`retry` may send a failed request elsewhere (the proxy's)."""
    tenant_key: TenantKey | None = None
    """How this hop names a request's tenant, if it knows tenants (the proxy's); what its access log reads."""
    server: HTTPServer | None = None
    """The listener serving this hop (its ``serve_*`` sets it): its health answer is 503 once that drains."""

    def __init__(
        self,
        name: str,
        upstreams: Upstreams,
        features: Sequence[Feature],
        *,
        admission: Admission | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.name = name
        self._name = name.encode()
        self.retried = 0
        """Requests this hop sent to another upstream (:meth:`retry`)."""
        self.retries_refused = 0
        """Retries its retry budget refused (the original error was answered)."""
        self.upstreams = upstreams
        self.features = tuple(features)
        self.admission = admission
        self.clock = clock
        stack = self.features
        # First on every hop: the health check (blocks.fields.HEALTH_PATH), answered by the hop itself.
        self._screens = [self._health_screen, *(f.screen for f in stack if _overrides(f, "screen"))]
        self._routes = [f.route for f in stack if _overrides(f, "route")]
        self._responses = [f.response for f in stack if _overrides(f, "response")]
        self._answered = [f.answered for f in stack if _overrides(f, "answered")]
        # dispatched and closed pair up: closed runs for the features whose dispatched ran.
        observers = [f for f in stack if _overrides(f, "dispatched") or _overrides(f, "closed")]
        self._dispatchers = [f.dispatched if _overrides(f, "dispatched") else None for f in observers]
        self._closers = [f.closed if _overrides(f, "closed") else None for f in observers]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {[type(f).__name__ for f in self.features]}>"

    @property
    def draining(self) -> bool:
        """True once the listener serving this hop (:attr:`server`) drains."""
        server = self.server
        return server is not None and server.draining

    def _health_screen(self, exchange: Exchange) -> None:
        request = exchange.request
        if request.path == HEALTH_PATH and request.header(PROBE_HEADER) is not None:
            exchange.answer = self.health

    async def health(self, exchange: Exchange) -> Response:
        """The answer to a health check (``GET /.proxyblocks/health`` with ``x-proxyblocks-probe``):
        200 while this hop serves, 503 once it drains. The worker's also checks a replica it names."""
        if self.draining:
            return text_response(503, "draining\n")
        return text_response(200, "ok\n")

    def retry(self, exchange: Exchange, status: int, headers: Headers) -> Forward | None:
        """An error came back (``status``, ``headers``) for a request nothing of which was sent on: where
        to send it instead (already dispatched there), or None to answer the error. Once per exchange."""
        return None

    def send_elsewhere(
        self,
        exchange: Exchange,
        status: int,
        headers: Headers,
        route: Callable[[], Forward],
        budget: RetryBudget | None,
    ) -> Forward | None:
        """For :meth:`retry`: send ``exchange`` where ``route()`` says instead, if ``budget`` has a
        retry (else None, counted in ``retries_refused``). The failure (``status``, ``headers``)
        reaches the ``response`` hooks and ``closed`` gives back what ``dispatched`` took, both for
        the first upstream; then ``route()`` (which notes the new one) and its ``dispatched`` run;
        counted in ``retried``."""
        if budget is not None and not budget.try_retry(self.clock()):
            self.retries_refused += 1
            return None
        exchange.failed(status, headers)
        exchange.undispatch()
        forward = route()
        exchange.dispatch(forward)
        self.retried += 1
        return forward

    def resendable(self, exchange: Exchange, headers: Headers, *, passed_on: bool = False) -> bytes | None:
        """The reason of an error head that lets this hop send the request elsewhere, or None.

        This hop's own error whose reason says nothing was processed
        (:data:`~blocks.errors.RETRYABLE_REASONS`: it could not connect, the
        stream was refused), or its own ``upstream_reset`` (its connection
        was lost before any response byte) for a request of a safe method
        with no body left to send (:data:`~blocks.http.SAFE_METHODS`). With
        ``passed_on``, a hop behind's ``RETRYABLE_REASONS`` count too (a
        worker that could not reach its replica).
        """
        for name, value in headers:
            if name == ERROR_HEADER:
                reason, at = parse_error_field(value)
                own = not at or at == self._name
                if reason in RETRYABLE_REASONS and (own or passed_on):
                    return reason
                request = exchange.request
                if own and reason == b"upstream_reset" and request.method in SAFE_METHODS and request.body.ended:
                    return reason
                return None
        return None

    upstream_kind = "next"
    """What this hop's upstream is, in its error fields: ``next`` (another hop) or ``replica`` (the worker's)."""

    def error_field(self, reason: str, exchange: Exchange | None = None) -> tuple[bytes, bytes]:
        """The ``proxyblocks-error`` field of this hop's own error: ``REASON; hop=NAME``, and for a failure
        of its upstream, which one (``; next=proxy-2 (127.0.0.1:9000)``, ``; replica=replica-0 (...)``).

        A hop that is not the last calls an upstream it cannot reach
        ``next_hop_unreachable`` (``next_hop_refused``), so that
        ``replica_unreachable`` only ever means a worker could not reach a replica.
        """
        if exchange is None or exchange.forward is None or reason not in UPSTREAM_REASONS:
            return error_field(reason, self.name)
        kind = self.upstream_kind
        if kind == "next":
            reason = NEXT_HOP_REASONS.get(reason, reason)
        return (ERROR_HEADER, f"{reason}; hop={self.name}; {kind}={self.upstream_label(exchange)}".encode())

    def upstream_label(self, exchange: Exchange) -> str:
        """How this hop's error fields name the upstream ``exchange`` went to: its address (``host:port``)."""
        forward = exchange.forward
        assert forward is not None
        return format_address(forward.address)

    def error_answer(self, request: Request, error: BlocksError) -> Response:
        """This hop's answer to ``error``: its status, ``proxyblocks-error: REASON; hop=NAME``, a one-line
        body saying the same, and this hop's Server-Timing entries (its wait on the upstream, if it sent)."""
        exchange = request.exchange
        timing = request.timing
        if timing is None:
            timing = request.timing = Timing()
        sent = exchange is not None and exchange.start > 0.0
        if sent:
            assert exchange is not None
            timing.upstream = perf_counter() - exchange.start
        entries = timing.entries(self.name, upstream_name=self.upstream_name if sent else None, total=self.total)
        headers = add_server_timing([*error.headers, self.error_field(error.error_reason, exchange)], entries)
        if self._answered:
            if exchange is None:
                exchange = Exchange(self, request)
            for answered in self._answered:
                answered(exchange, error.status, headers)
        return error_response(error.status, headers)

    def screen(self, exchange: Exchange) -> None:
        """Run every feature's ``screen``."""
        for screen in self._screens:
            screen(exchange)

    def decide(self, exchange: Exchange) -> Forward:
        """Route the exchange (after admission) and dispatch it; undo what it took if any of that raises."""
        try:
            for route in self._routes:
                forward = route(exchange)
                if forward is not None:
                    break
            else:
                raise NoRoute(f"{self.name}: nothing routes {exchange.request.authority!r}")
            exchange.forward = forward
            for n, dispatched in enumerate(self._dispatchers, 1):
                if dispatched is not None:
                    dispatched(exchange, forward)
                exchange._dispatched = n  # from now on, this feature's closed runs
        except BaseException:
            exchange.forward = None
            exchange.closed()
            raise
        exchange.start = perf_counter()
        return forward

    def relay(self, request: Request, down: H2Driver, st: H2Stream, ended: bool) -> bool:
        """The listener's fast path (see :func:`blocks.serve_http`): True if spliced.

        It runs in the connection's reader, so a feature that fails costs
        only this request: an exception that is not a
        :class:`~blocks.errors.BlocksError` is logged once, with its
        traceback, and the request answered 500 by the handler path.
        """
        exchange = Exchange(self, request)
        try:
            for screen in self._screens:
                screen(exchange)
            if exchange.answer is not None or exchange.wait is not None:
                return False  # answered here, or held: the handler awaits it
            admission = self.admission
            if admission is not None and not admission.admit_nowait(exchange):
                exchange.queued = True
                return False  # not its turn: the handler waits in the scheduler's queue
            forward = self.decide(exchange)
        except BlocksError as exc:
            exchange.error = exc
            return False
        except Exception:
            log.exception("%s failed deciding %r %r", self.name, request.method, request.path)
            exchange.error = HopFailed(f"{self.name} failed deciding the request")
            return False
        if self.retries:
            exchange.down = st
        try:
            spliced = forward.protocol != "h1" and self.upstreams.splice(
                forward.address,
                request,
                forward.headers,
                down,
                st,
                request_ended=ended,
                head_filter=exchange.retry_head if self.retries else exchange.head,
                on_close=exchange.closed,
                protocol=forward.protocol,
            )
        except Exception:
            log.exception("%s failed splicing %r %r", self.name, request.method, request.path)
            exchange.error = HopFailed(f"{self.name} failed splicing the request")
            exchange.closed()
            return False
        if spliced:
            if exchange.tee is not None:
                tap_splice(st, exchange.tee, ended)
            return True
        return False  # decided: the handler carries it out

    async def handle(self, request: Request) -> Response:
        """The listener's general path: the response, or this hop's :meth:`error_answer` to a failure."""
        try:
            return await self._handle(request)
        except BlocksError as exc:
            log.debug("%s: %r %r -> %d: %s", self.name, request.method, request.path, exc.status, exc)
            return self.error_answer(request, exc)
        except Exception:
            log.exception("%s failed handling %r %r", self.name, request.method, request.path)
            return self.error_answer(request, HopFailed(f"{self.name} failed handling the request"))

    async def _handle(self, request: Request) -> Response:
        exchange = request.exchange
        if exchange is None:  # the fast path never saw it (h1, TLS without h2)
            exchange = Exchange(self, request)
            self.screen(exchange)
        elif exchange.error is not None:
            raise exchange.error
        wait = exchange.wait
        if wait is not None:  # (set in screen: nothing was decided yet)
            exchange.wait = None
            await wait(exchange)  # or raises: answered with its status
        if exchange.answer is not None:
            return await exchange.answer(exchange)
        forward = exchange.forward
        if forward is None:
            if self.admission is not None:
                await self.admission.admit(exchange)  # or 429 / 503
            forward = self.decide(exchange)
        # Once: a connect failure while no pool took the body (nothing of it was read, streamed or
        # not), or a reset or an error head for a request with no body (none went up).
        again_ok = self.retries
        bodiless = request.body.ended
        tee = exchange.tee
        if tee is not None:
            request.body = TappedBody(request.body, tee.request, tee.abort)
        while True:
            try:
                response = await self.upstreams.request(
                    forward.address, request, forward.headers, protocol=forward.protocol
                )
            except BaseException as exc:
                if again_ok and (
                    (isinstance(exc, UpstreamConnectError) and _unread(request.body))
                    or (bodiless and isinstance(exc, (StreamReset, UpstreamProtocolError)))
                ):
                    again_ok = False
                    again = self.retry(exchange, exc.status, [self.error_field(exc.error_reason, exchange)])
                    if again is not None:
                        forward = again
                        continue
                reclassified = None
                try:
                    if isinstance(exc, BlocksError) and not isinstance(exc, StreamReset):
                        # the upstream never answered: 502, 503, 504
                        head = [(ERROR_HEADER, exc.error_reason.encode())]
                        exchange.failed(exc.status, head)
                        if exchange.answer_status is not None:  # a hook re-classified it
                            reclassified = _reclassified(exchange.answer_status, head)
                        elif len(head) > 1:  # what the response hooks added (request ids) goes out with it
                            exc.headers = [*exc.headers, *head[1:]]
                finally:
                    exchange.closed()
                if reclassified is not None:
                    raise reclassified from exc
                raise
            if again_ok and bodiless and response.status >= 500:
                again_ok = False
                again = self.retry(exchange, response.status, response.headers)
                if again is not None:
                    await abandon(response.body)
                    response.closed()
                    forward = again
                    continue
            break
        response.call_on_close(exchange.closed)
        try:
            response.headers = exchange.head(response.status, response.headers)
        except BaseException:
            await abandon(response.body)
            response.closed()
            raise
        if tee is not None:
            response.body = tap_response(response.body, tee)
        return response


def _reclassified(status: int, head: Headers) -> BlocksError:
    """The hop's own error as a ``response`` hook re-classified it (``Exchange.answer_status``):
    its status, the reason its ``proxyblocks-error`` field now says, and the fields it added."""
    reason = parse_error_field(head[0][1])[0].decode("latin-1")
    error = BlocksError(f"re-classified as {reason}", status=status, error_reason=reason)
    error.headers = head[1:]
    return error


def _unread(body: Body) -> bool:
    """Nothing of ``body`` was taken by an upstream, so it can go elsewhere: it ended with nothing in
    it, or it is :attr:`~blocks.http.Body.untouched` (no pool claimed an h2 stream's body; an h1
    WebSocket's tunnel was not opened). An upload whose body comes after its head is still unread
    when its connect fails, and so is a WebSocket whose upstream could not be reached."""
    return body.ended or body.untouched


def own_error(headers: Headers, hop: str) -> bytes | None:
    """The reason of ``hop``'s own error in a response head (its ``proxyblocks-error`` names no hop,
    or ``hop``), or None: no error field, or one a hop behind it answered."""
    for name, value in headers:
        if name == ERROR_HEADER:
            reason, at = parse_error_field(value)
            return reason if not at or at == hop.encode() else None
    return None


# An internal hop's peer is a hop: its connection carries many clients' streams,
# their resets and their window updates, so the per-client abuse limits are off.
def hop_listener(listener: ListenerConfig | None, hop: Hop) -> ListenerConfig:
    """``listener`` (default: a validating one) serving ``hop``: its own error answers name the hop."""
    listener = listener or ListenerConfig()
    return listener if listener.hop is not None else attrs.evolve(listener, hop=hop.name)


INTERNAL_LISTENER = ListenerConfig(
    validate=False,
    max_concurrent_streams=1000,
    max_header_list_size=256 * 1024,
    max_target=256 * 1024,
    max_request_body=None,
    max_client_resets=None,
    flood_limit=None,
    max_empty_frames=None,
)
"""Listener settings for hops that only hear from a validating hop.

Its header-list cap is well above the edge's, so the fields hops add on the
way (``via``, ``x-forwarded-*``, the replica name) never tip a head the edge
accepted over a later hop's limit; nor does its target cap refuse a target
(at most the edge's ``max_target``) that the edge let through.
"""
