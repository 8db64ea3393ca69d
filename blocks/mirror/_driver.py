"""The mirror tee: copy a sampled share of requests to a shadow, and compare the answers.

:func:`open_mirror` runs a :class:`Mirror` for the life of a proxy
(``serve_proxy(..., mirror=MirrorConfig())`` does it for you). The proxy asks
it, once per request and only for apps whose settings record has a
``mirror`` field (:class:`~blocks.routing.MirrorSetting`), whether to copy
the request; a copied request gets a tee (:class:`~blocks.transport._tap.Tee`) that
watches the primary exchange go by, and a shadow task that sends the copy
(none for a copy without a body once the mirror's pool has a free slot:
the pool's reader reads its answer where it arrives, see :class:`_Sink`).

Guarantees:

- **The primary never waits for the shadow.** The tee's methods run on the
  primary's path and never block: the request body is copied into a
  bounded buffer (``buffer`` bytes per request, ``total_buffer`` for all);
  a chunk that does not fit abandons that copy (counted), it never holds up
  the primary. The shadow's response is read by the shadow task, and
  compared there.
- **A shadow never takes a primary's resources.** Shadows go through the
  mirror's own :class:`~blocks.transport.multiplexer.Upstreams` (its own connections,
  stream slots and flow-control windows), never the proxy's: a shadow that
  does not read stalls only its own connection to the shadow. At most
  ``max_in_flight`` shadows run at once; past that a request is not copied
  (counted as ``skipped``).
- **Every wait on the shadow is bounded** by ``stall_timeout``: the
  connection (``connect_timeout`` at most), a stream slot, the response head,
  and each chunk of its body. Nothing is retried (the pool's resend of a
  stream the shadow refused unprocessed, ``REFUSED_STREAM``, aside).
- **The shadow follows the primary.** When the primary's exchange breaks
  (the client resets, the upstream fails) the shadow is cancelled. Shadow
  responses are read to the end and discarded, never sent to a client.
- **Marked.** A shadow request carries ``x-proxyblocks-mirror: 1`` (the
  ``header``), and its authority's host gets ``host_suffix`` (``-shadow``:
  ``app.example:8443`` becomes ``app.example-shadow:8443``).
- **Owned.** Shadows run in the mirror's service-lifetime nursery; leaving
  :func:`open_mirror` cancels those still running. ``serve_proxy`` leaves it
  only once its listener has drained, so shadows never delay a drain.

Comparison: for every pair whose two sides completed, the status, the
setting's ``compare`` header fields, the body length and a ``blake2b``
hash, and the latency of both (from the routing decision to the end of
each body) go to :class:`~blocks.mirror._core.ComparisonBook`:
``statistics().routes`` has the match and mismatch counts per route and the
latency ratio; ``on_mismatch`` gets at most ``report_limit`` mismatching
pairs per ``report_interval`` seconds. The decisions and the bookkeeping
are sans-IO, in :mod:`blocks.mirror._core`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from blocks._sync import one_error
from blocks.errors import BlocksError, UpstreamTimeout
from blocks.fields import INTERNAL_PREFIX, MIRROR_HEADER, REPLICA_HEADER, TARGET_HEADER
from blocks.http import Headers, Request, StreamBody
from blocks.mirror._core import (
    BodyDigest,
    ComparisonBook,
    MirrorPair,
    Observation,
    RouteComparison,
    Sampler,
    TeeBudget,
    TeeBuffer,
    compare,
    route_name,
    select_headers,
)
from blocks.mirror._shadow import _Shadow
from blocks.routing import Address, LeastInFlight, MirrorSetting, Routes, host_of
from blocks.transport.multiplexer import UpstreamConfig, Upstreams, open_upstreams
from blocks.transport.streams import H2Driver, H2Stream, acknowledge

log = logging.getLogger("blocks.mirror")


TenantKey = Callable[[Request], str]


def _header_name(value: str | bytes) -> bytes:
    return (value.encode() if isinstance(value, str) else value).lower()


@attrs.frozen(kw_only=True)
class MirrorConfig:
    """The mirror's knobs (what to mirror is per app, in the route table). Durations in seconds.

    - ``buffer``: request-body bytes held for one shadow that has not taken
      them yet (1 MiB); ``total_buffer``: for all shadows together (64 MiB).
    - ``max_in_flight``: shadows running at once; past it, requests are not copied.
    - ``stall_timeout``: the bound on every wait on a shadow.
    - ``header``, ``host_suffix``: how shadow requests are marked (``""``: no suffix).
    - ``sample_bytes``: the first bytes of each body kept in a compared pair.
    - ``on_mismatch``: called with each reported mismatching
      :class:`~blocks.mirror.MirrorPair`, at most ``report_limit`` per
      ``report_interval``; it runs in a shadow task, must not block, and its
      exceptions are logged.
    - ``max_connections``: the shadow pool's connections per shadow address.
    - ``seed``: for the random draws of requests without a sampling key.
    """

    buffer: int = attrs.field(default=1024 * 1024, validator=attrs.validators.ge(0))
    total_buffer: int = attrs.field(default=64 * 1024 * 1024, validator=attrs.validators.ge(0))
    max_in_flight: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    stall_timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    header: bytes = attrs.field(default=MIRROR_HEADER, converter=_header_name)
    host_suffix: str = "-shadow"
    sample_bytes: int = attrs.field(default=256, validator=attrs.validators.ge(0))
    report_limit: int = attrs.field(default=10, validator=attrs.validators.ge(0))
    report_interval: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    on_mismatch: Callable[[MirrorPair], None] | None = attrs.field(default=None, eq=False)
    max_connections: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    seed: int | None = None

    def upstream(self) -> UpstreamConfig:
        """The shadow pool's settings: every wait bounded by ``stall_timeout``."""
        return UpstreamConfig(
            connect_timeout=min(5.0, self.stall_timeout),
            response_timeout=self.stall_timeout,
            max_connections=self.max_connections,
            timeout_resolution=min(0.05, self.stall_timeout / 4),
        )


OUTCOMES = ("matches", "mismatches", "abandoned", "aborted", "failed", "timed_out", "cancelled", "skipped", "no_route")
"""How a copy ends, each a count of :class:`MirrorStatistics` (``skipped`` and ``no_route``: never copied)."""


@attrs.frozen
class MirrorStatistics:
    """A snapshot of a :class:`Mirror`.

    ``sampled``: requests copied (a shadow started). Each ends in exactly one
    of: ``compared`` (``matches`` + ``mismatches``), ``abandoned`` (its
    buffer was full), ``aborted`` (the primary broke first), ``failed`` (the
    shadow refused, reset or broke), ``timed_out`` (a wait on it passed
    ``stall_timeout``), ``cancelled`` (the mirror closed). ``skipped``: not
    copied, ``max_in_flight`` shadows running; ``no_route``: not copied, the
    shadow app has no replica. ``in_flight`` and ``buffered`` (bytes) are
    now. ``reported``/``unreported``: mismatches given to ``on_mismatch`` or
    not (over its budget). ``routes``: per route, see
    :class:`~blocks.mirror.RouteComparison`.
    """

    in_flight: int
    buffered: int
    sampled: int
    compared: int
    matches: int
    mismatches: int
    abandoned: int
    aborted: int
    failed: int
    timed_out: int
    cancelled: int
    skipped: int
    no_route: int
    reported: int
    unreported: int
    routes: dict[str, RouteComparison]


def shadow_authority(authority: bytes, suffix: bytes) -> bytes:
    """``authority`` with ``suffix`` after its host: ``a.example:8443`` -> ``a.example-shadow:8443``."""
    if not suffix:
        return authority
    host = host_of(authority)
    return host + suffix + authority[len(host) :]


@attrs.define(eq=False)
class Mirror:
    """Copies sampled requests to shadows and compares the answers. Use :func:`open_mirror`.

    The proxy calls :meth:`tee` once per request it routes; everything else
    happens in the mirror's own tasks.
    """

    config: MirrorConfig
    upstreams: Upstreams
    _nursery: trio.Nursery
    _sampler: Sampler = attrs.field(init=False)
    _budget: TeeBudget = attrs.field(init=False)
    _book: ComparisonBook = attrs.field(init=False)
    _policy: LeastInFlight = attrs.field(init=False)
    _suffix: bytes = attrs.field(init=False)
    _marker: tuple[bytes, bytes] = attrs.field(init=False)
    in_flight: dict[str, int] = attrs.field(factory=dict, init=False)
    """Shadows in flight per shadow replica (or ``host:port`` for an address)."""
    closing: bool = attrs.field(default=False, init=False)
    _running: int = attrs.field(default=0, init=False)
    _sinks: dict[_Sink, None] = attrs.field(factory=dict, init=False)
    _counts: dict[str, int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        config = self.config
        rng = random.Random(config.seed)
        self._sampler = Sampler(rng)
        self._budget = TeeBudget(config.total_buffer)
        self._book = ComparisonBook(report_limit=config.report_limit, report_interval=config.report_interval)
        self._policy = LeastInFlight(rng)
        self._suffix = config.host_suffix.encode()
        self._marker = (config.header, b"1")
        self._counts = dict.fromkeys(
            ("sampled", *OUTCOMES),
            0,
        )

    def statistics(self) -> MirrorStatistics:
        counts = self._counts
        return MirrorStatistics(
            in_flight=self._running,
            buffered=self._budget.used,
            compared=counts["matches"] + counts["mismatches"],
            reported=self._book.reported,
            unreported=self._book.unreported,
            routes=self._book.routes(),
            **counts,
        )

    # -- the request path ---------------------------------------------------------------------

    def tee(
        self, routes: Routes, app: str, request: Request, headers: Headers, tenant_key: TenantKey
    ) -> _Shadow | None:
        """Whether to copy ``request`` (routed to ``app``); if so, its tee (the shadow starts with it).

        ``headers`` are the fields the primary goes upstream with; the
        ``x-proxyblocks-*`` ones among them (the replica the proxy picked)
        are not copied. Costs a dict read when ``app`` mirrors nothing.
        Never raises: a bug here is logged, and the request is not copied.
        """
        settings = routes.settings(app)
        if settings is None:
            return None
        try:
            return self._tee(routes, app, settings.mirror, request, headers, tenant_key)
        except Exception:
            log.exception("mirror: not copying %r %r", request.method, request.path)
            return None

    def _tee(
        self,
        routes: Routes,
        app: str,
        setting: MirrorSetting | None,
        request: Request,
        headers: Headers,
        tenant_key: TenantKey,
    ) -> _Shadow | None:
        if setting is None or self.closing or request.method == b"CONNECT":
            return None  # a tunnel (WebSocket) is never copied
        tenant = tenant_key(request) if setting.tenants else None
        key = request.header(setting.key) if setting.key is not None else None
        route = self._sampler.decide(setting, request.path, tenant, key)
        if route is None:
            return None
        counts = self._counts
        if self._running >= self.config.max_in_flight:
            counts["skipped"] += 1
            return None
        shadow_headers = [field for field in headers if not field[0].startswith(INTERNAL_PREFIX)]
        shadow_headers.append(self._marker)
        if setting.to is not None:
            candidates = routes.replicas(setting.to)
            if not candidates:
                counts["no_route"] += 1
                return None
            replica = self._policy.pick(request, candidates, self.in_flight)
            address: Address = replica.worker
            target = replica.name
            shadow_headers += [(TARGET_HEADER, replica.target), (REPLICA_HEADER, target.encode())]
        else:
            assert setting.address is not None
            address = setting.address
            target = f"{address[0]}:{address[1]}"
        counts["sampled"] += 1
        self.in_flight[target] = self.in_flight.get(target, 0) + 1
        self._running += 1
        # It goes with the request's first body byte, or (no body) once the primary's
        # exchange is over; either way after the reader's batch: the primary's frames go first.
        return _Shadow(self, app, route_name(app, route), request, address, shadow_headers, target, setting.compare)

    def _start(self, shadow: _Shadow) -> None:
        if shadow.outcome is not None:  # stopped before it went (the primary broke): count it, send nothing
            self._finished(shadow, shadow.outcome)
            return
        request = shadow.original
        authority = shadow_authority(request.authority, self._suffix)
        if shadow.primary is not None and not shadow.fed and not shadow.trailers:
            # Body-less, and the primary's answer is in: the pool's reader reads the
            # shadow's answer where it arrives, on a free slot of a connection it has.
            copy = Request(request.method, request.scheme, authority, request.path, client=request.client)
            sink = _Sink(self, shadow, copy)
            if self.upstreams.sink(shadow.address, copy, shadow.copy_headers, sink):
                self._sinks[sink] = None
                return
        buffer = shadow.buffer = TeeBuffer(self._budget, self.config.buffer)
        body = shadow.body = StreamBody(on_consumed=buffer.take)
        if shadow.request_ended:
            body.end(shadow.trailers)
        shadow.scope = trio.CancelScope()
        copy = Request(request.method, request.scheme, authority, request.path, body=body, client=request.client)
        try:
            self._nursery.start_soon(self._run, shadow, copy)
        except RuntimeError:  # the mirror has closed (a late primary of a proxy shutting down)
            shadow.outcome = "cancelled"
            buffer.close()
            self._finished(shadow, "cancelled")

    def _finished(self, shadow: _Shadow, outcome: str) -> None:
        self._counts[outcome] += 1
        self._running -= 1
        target = shadow.target
        left = self.in_flight[target] - 1
        if left:
            self.in_flight[target] = left
        else:
            del self.in_flight[target]

    def _sink_closed(self, sink: _Sink, outcome: str) -> None:
        del self._sinks[sink]
        self._finished(sink.shadow, outcome)

    async def _sweep_sinks(self) -> None:
        """Bound a sink's wait for its response body by ``stall_timeout`` (the pool bounds the head)."""
        stall = self.config.stall_timeout
        while True:
            await trio.sleep(min(stall / 8, 0.25))
            now = trio.current_time()
            for sink in [sink for sink in self._sinks if now - sink.progress >= stall]:
                sink.stop("timed_out")

    def _stop_sinks(self) -> None:
        for sink in list(self._sinks):
            sink.stop("cancelled")

    # -- the shadow task ----------------------------------------------------------------------

    async def _run(self, shadow: _Shadow, copy: Request) -> None:
        scope, buffer = shadow.scope, shadow.buffer
        assert scope is not None and buffer is not None  # made with the task (see _start)
        outcome = "cancelled"
        shadow.sent = trio.current_time()
        try:
            with scope:
                outcome = await self._exchange(shadow, copy)
            if scope.cancelled_caught:
                outcome = shadow.outcome or "cancelled"
        finally:
            buffer.close()
            self._finished(shadow, outcome)

    async def _exchange(self, shadow: _Shadow, copy: Request) -> str:
        stall = self.config.stall_timeout
        try:
            response = await self.upstreams.request(shadow.address, copy, shadow.copy_headers)
        except UpstreamTimeout:
            return "timed_out"
        except BlocksError:
            return "failed"  # refused, reset, broken: no retry
        body = response.body
        digest = BodyDigest(self.config.sample_bytes)
        try:
            while True:
                chunk = b""
                with trio.move_on_after(stall) as waited:
                    chunk = await body.receive()
                if waited.cancelled_caught:
                    return "timed_out"
                if not chunk:
                    break
                digest.update(chunk)
        except BlocksError:
            return "failed"
        finally:
            if not body.ended:
                with trio.CancelScope(shield=True):
                    await body.aclose()  # resets the shadow stream
        observed = Observation(
            response.status,
            select_headers(response.headers, shadow.compare_names),
            digest.length,
            digest.hexdigest(),
            trio.current_time() - shadow.sent,
            digest.sample,
        )
        if not shadow.over:
            shadow.done = trio.Event()
            await shadow.done.wait()  # the primary's end: bounded by the primary's own life, never ours
        primary = shadow.primary
        if primary is None or shadow.outcome is not None:
            return shadow.outcome or "aborted"
        return self._compare(shadow, copy, primary, observed)

    def _compare(self, shadow: _Shadow, copy: Request, primary: Observation, observed: Observation) -> str:
        differences = compare(primary, observed)
        pair = MirrorPair(shadow.app, shadow.route, copy.method, copy.path, primary, observed, differences)
        report = self._book.record(pair, trio.current_time())
        callback = self.config.on_mismatch
        if report and callback is not None:
            try:
                callback(pair)
            except Exception:
                log.exception("on_mismatch callback failed")
        return "matches" if pair.matched else "mismatches"


class _Sink:
    """A body-less shadow, sent once its primary is over and read with no task (a ``_splice.Sink``).

    The shadow pool's reader hands it the response as it arrives: the head's
    compared fields and the body's digest are taken on the spot, the window
    given back, and the pair compared at the end. ``stop`` ends it early.
    """

    __slots__ = (
        "closed",
        "conn",
        "copy",
        "digest",
        "head_sent",
        "headers",
        "mirror",
        "progress",
        "shadow",
        "st",
        "status",
    )

    def __init__(self, mirror: Mirror, shadow: _Shadow, copy: Request) -> None:
        self.mirror = mirror
        self.shadow = shadow
        self.copy = copy
        self.digest = BodyDigest(mirror.config.sample_bytes)
        self.status = 0
        self.headers: tuple[tuple[bytes, bytes | None], ...] = ()
        self.head_sent = False
        self.closed = False
        self.conn: H2Driver | None = None
        self.st: H2Stream | None = None
        self.progress = shadow.sent = trio.current_time()

    def opened(self, conn: H2Driver, st: H2Stream) -> None:
        self.conn = conn
        self.st = st

    def head(self, status: int, headers: Headers, ended: bool) -> None:
        self.head_sent = True
        if self.closed:
            return
        self.status = status
        self.headers = select_headers(headers, self.shadow.compare_names)
        self.progress = trio.current_time()
        if ended:
            self._complete()

    def data(self, driver: H2Driver, st: H2Stream, data: bytes, size: int, end: bool) -> None:
        if size:
            acknowledge(driver.h2, size, st.id)  # read and dropped: the window goes back with the batch
        if self.closed:
            return
        if data:
            self.digest.update(data)
            self.progress = trio.current_time()
        if end:
            self._complete()

    def ended(self, st: H2Stream, trailers: Headers | None = None) -> None:
        if not self.closed:
            self._complete()

    def window(self, st: H2Stream) -> None:
        """Nothing to send: the request went whole with its head."""

    def failed(self, driver: H2Driver, error: BaseException) -> None:
        if not self.closed:
            self._close("timed_out" if isinstance(error, UpstreamTimeout) else "failed")

    def stop(self, outcome: str) -> None:
        """End it from our side (stalled, or the mirror closing): reset the stream."""
        if self.closed:
            return
        self._close(outcome)
        if self.conn is not None and self.st is not None:
            self.conn.reset(self.st)

    def _complete(self) -> None:
        assert self.conn is not None and self.st is not None
        self.conn.finish_stream(self.st)
        shadow, digest = self.shadow, self.digest
        primary = shadow.primary
        assert primary is not None  # a sink is sent only once the primary's answer is in
        observed = Observation(
            self.status,
            self.headers,
            digest.length,
            digest.hexdigest(),
            trio.current_time() - shadow.sent,
            digest.sample,
        )
        self._close(self.mirror._compare(shadow, self.copy, primary, observed))

    def _close(self, outcome: str) -> None:
        self.closed = True
        self.mirror._sink_closed(self, outcome)


@asynccontextmanager
async def open_mirror(config: MirrorConfig | None = None) -> AsyncIterator[Mirror]:
    """A running :class:`Mirror` for the ``async with`` block, with its own shadow pool and nursery.

    Leaving the block cancels the shadows still running (they are counted
    as ``cancelled``) and closes the shadow connections; errors from the
    body come out as they are, not wrapped.
    """
    config = config or MirrorConfig()
    with one_error():
        async with open_upstreams(config.upstream()) as upstreams, trio.open_nursery() as nursery:
            mirror = Mirror(config, upstreams, nursery)
            nursery.start_soon(mirror._sweep_sinks)
            try:
                yield mirror
            finally:
                mirror.closing = True
                mirror._stop_sinks()
                nursery.cancel_scope.cancel()
