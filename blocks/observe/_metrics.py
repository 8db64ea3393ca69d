"""Per-request counts at a hop (:class:`Metrics`), and the Prometheus families read from a process's parts.

Theory of operation. The request path only adds to plain ints: the
:class:`Metrics` feature, in its ``answered`` phase (once per request, see
:mod:`blocks.hops`), bumps one slot of a list per app and one bucket per
Server-Timing phase (a ``bisect`` over bounds fixed when it is made). Every
other figure (in flight, queues, sessions, routes, ejections, connections)
already lives in some part's ``statistics()``. A scrape reads all of them
at once (:class:`MetricsCollector`, a ``prometheus_client`` collector) and
renders them; nothing is rendered, locked or awaited per request.

Cardinality is bounded: tenants are the ``top_tenants`` with the most
traffic (a tenant once shown stays shown), the rest summed as ``other``;
apps, replicas and reasons are the operator's own (routes, error reasons).
"""

from __future__ import annotations

import collections
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from time import perf_counter
from typing import Any

import attrs
import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from blocks.fields import ERROR_HEADER
from blocks.hops import Edge, Exchange, Feature, Hop, Proxy, Worker
from blocks.http import Headers
from blocks.mirror import OUTCOMES
from blocks.routing import RouteCache, format_address
from blocks.transport.listener import HTTPServer

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""The phase histograms' upper bounds, in seconds (100 µs to 10 s)."""

STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")

LAST_ERRORS = 20
"""How many recent errors each :class:`Metrics` keeps (``/status.json``'s ``last_errors``)."""


class PhaseHistogram:
    """One Server-Timing phase's durations: counts per bucket (the last one past every bound) and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """``[(le, count)]`` as Prometheus wants them, ``+Inf`` last."""
        out = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile in seconds, interpolated within its bucket (as PromQL's
        ``histogram_quantile``); None if empty. Past the last bound: that bound."""
        total = self.count
        if total == 0:
            return None
        rank = q * total
        running = 0
        lower = 0.0
        for i, n in enumerate(self.counts):
            if n and running + n >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                upper = self.bounds[i]
                return lower + (upper - lower) * (rank - running) / n
            running += n
            if i < len(self.bounds):
                lower = self.bounds[i]
        return self.bounds[-1]


@attrs.frozen
class HopErrorRecord:
    """One error a hop answered: for ``/status.json``'s ``last_errors``."""

    time: float
    hop: str
    status: int
    reason: str
    method: str
    authority: str
    path: str


class Metrics(Feature):
    """answered: counts every request the hop answers, by app, status class and ``proxyblocks-error``
    reason, and its Server-Timing phases (the hop's own time, its wait on the next hop, the sub-phases,
    ``total`` at the edge) into fixed-bucket histograms.

    Add one to a hop's ``features`` (``serve_edge(..., features=[Metrics()])``,
    ``Chain.start_proxy(features=[Metrics()])``); an admin listener
    (:func:`~blocks.observe.serve_admin`) finds it in the hop's stack and
    renders it at scrape time. Its place in the stack does not matter. A
    request the hop answers itself with ``exchange.answer`` (the worker's
    load probes, a session start) is not counted. Per request: a list slot,
    a dict read per phase and a ``bisect``.

    ``requests``: app (``""`` where the hop does not know it: the edge,
    the worker) -> counts indexed by ``status // 100``; ``errors``:
    ``(app, status class, reason)`` -> count, for answers that carry a
    ``proxyblocks-error`` reason; ``phases``: phase name -> histogram;
    ``last_errors``: the latest errors (5xx, or with a reason), newest last.
    """

    def __init__(self, *, buckets: Sequence[float] = DEFAULT_BUCKETS, last_errors: int = LAST_ERRORS) -> None:
        bounds = tuple(sorted(float(b) for b in buckets))
        if not bounds or bounds[0] <= 0:
            raise ValueError(f"buckets must be positive seconds, not {buckets!r}")
        self.bounds = bounds
        self.requests: dict[str, list[int]] = {}
        self.errors: dict[tuple[str, str, str], int] = {}
        self.phases: dict[str, PhaseHistogram] = {}
        self.last_errors: collections.deque[HopErrorRecord] = collections.deque(maxlen=last_errors)

    def __repr__(self) -> str:
        total = sum(sum(counts) for counts in self.requests.values())
        return f"<Metrics requests={total} phases={sorted(self.phases)}>"

    def answered(self, exchange: Exchange, status: int, headers: Headers) -> None:
        app = exchange.app or ""
        counts = self.requests.get(app)
        if counts is None:
            counts = self.requests[app] = [0, 0, 0, 0, 0, 0]
        counts[status // 100 if 100 <= status < 600 else 5] += 1
        if status >= 400:
            self._error(exchange, app, status, headers)
        timing = exchange.request.timing
        if timing is None:
            return
        hop = exchange.hop
        elapsed = perf_counter() - timing.start
        upstream = timing.upstream
        self._observe(hop.name, elapsed - upstream)
        if hop.upstream_name is not None and exchange.start > 0.0:
            self._observe(hop.upstream_name, upstream)
        for name, seconds in timing.phases:
            self._observe(name, seconds)
        if hop.total:
            self._observe("total", elapsed)

    def _observe(self, name: str, seconds: float) -> None:
        histogram = self.phases.get(name)
        if histogram is None:
            histogram = self.phases[name] = PhaseHistogram(self.bounds)
        histogram.counts[bisect_left(self.bounds, seconds)] += 1
        histogram.sum += seconds

    def _error(self, exchange: Exchange, app: str, status: int, headers: Headers) -> None:
        reason = ""
        for name, value in headers:
            if name == ERROR_HEADER:
                reason = value.partition(b";")[0].strip().decode("latin-1")
                break
        if reason:
            key = (app, STATUS_CLASSES[min(status // 100, 5) - 1], reason)
            self.errors[key] = self.errors.get(key, 0) + 1
        if reason or status >= 500:
            request = exchange.request
            self.last_errors.append(
                HopErrorRecord(
                    time.time(),
                    exchange.hop.name,
                    status,
                    reason,
                    request.method.decode("latin-1"),
                    request.authority.decode("latin-1"),
                    request.path.decode("latin-1"),
                )
            )


def hop_metrics(hop: Hop | None) -> Metrics | None:
    """The :class:`Metrics` in ``hop``'s stack, if any."""
    if hop is not None:
        for feature in hop.features:
            if isinstance(feature, Metrics):
                return feature
    return None


def served_hop(server: HTTPServer) -> Hop | None:
    """The hop a listener serves (its handler is the hop's ``handle``), or None (a replica, the admin)."""
    owner = getattr(server.handler, "__self__", None)
    return owner if isinstance(owner, Hop) else None


@attrs.frozen
class Part:
    """One listener of the process an admin listener reports on, and the hop it serves (None: not a hop)."""

    name: str
    server: HTTPServer
    hop: Hop | None = None


@attrs.frozen(kw_only=True)
class Observed:
    """What an admin listener reads, as of a scrape: the process's ``parts`` (front first) and
    ``routes`` (the proxy's route cache; None where the process has no proxy)."""

    parts: Sequence[Part] = ()
    routes: RouteCache | None = None


def named_parts(parts: Iterable[tuple[str, HTTPServer, Hop | None]]) -> list[Part]:
    """``Part`` objects with unique names (a second ``worker`` becomes ``worker-2``)."""
    seen: dict[str, int] = {}
    out = []
    for name, server, hop in parts:
        n = seen[name] = seen.get(name, 0) + 1
        out.append(Part(name if n == 1 else f"{name}-{n}", server, hop))
    return out


def status_class_counts(counts: Sequence[int]) -> dict[str, int]:
    """``{"1xx": n, ...}`` from a :class:`Metrics` count list."""
    return {label: counts[i + 1] for i, label in enumerate(STATUS_CLASSES)}


def top_tenants(granted: dict[str, int], shown: dict[str, None], limit: int) -> list[str]:
    """The tenants to show by name: those ``shown`` before (sticky, so a series never vanishes
    into ``other``), then the busiest of the rest up to ``limit``. ``shown`` is updated."""
    if len(shown) < limit:
        for name in sorted(granted, key=lambda t: (-granted[t], t)):
            if len(shown) >= limit:
                break
            shown.setdefault(name, None)
    return [name for name in shown if name in granted]


class MetricsCollector:
    """A ``prometheus_client`` collector: every ``proxyblocks_*`` family, read from ``observe()`` at scrape time.

    Register it in a ``CollectorRegistry`` and render with
    ``prometheus_client.generate_latest``; docs/observability.md lists the
    families. ``top_tenants`` bounds the scheduler families' ``tenant`` label.
    """

    def __init__(self, observe: Callable[[], Observed], *, top_tenants: int = 10) -> None:
        self.observe = observe
        self.top_tenants = top_tenants
        self._shown: dict[str, None] = {}  # tenants given their own series, in the order they got it

    def describe(self) -> list[Metric]:
        return []  # families depend on the parts running: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        observed = self.observe()
        yield from self._requests(observed.parts)
        yield from self._listeners(observed.parts)
        yield from self._replicas(observed.parts)
        yield from self._proxies(observed.parts)
        yield from self._routes(observed.routes)

    def _requests(self, parts: Sequence[Part]) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "proxyblocks_requests",
            "Requests a hop answered, by app, status class and proxyblocks-error reason (empty: none).",
            labels=["hop", "app", "status_class", "reason"],
        )
        phases = HistogramMetricFamily(
            "proxyblocks_phase_duration_seconds",
            "Server-Timing phases of the requests a hop answered (its own time, its wait on the next hop, "
            "its sub-phases, total at the edge).",
            labels=["hop", "phase"],
        )
        for part in parts:
            metrics = hop_metrics(part.hop)
            if metrics is None:
                continue
            errors: dict[tuple[str, str], int] = {}
            for (app, status_class, reason), n in sorted(metrics.errors.items()):
                requests.add_metric([part.name, app, status_class, reason], n)
                errors[app, status_class] = errors.get((app, status_class), 0) + n
            for app, counts in sorted(metrics.requests.items()):
                for status_class, n in status_class_counts(counts).items():
                    plain = n - errors.get((app, status_class), 0)
                    if plain or status_class in ("2xx", "5xx"):
                        requests.add_metric([part.name, app, status_class, ""], plain)
            for phase, histogram in sorted(metrics.phases.items()):
                phases.add_metric([part.name, phase], histogram.cumulative(), histogram.sum)
        yield requests
        yield phases

    def _listeners(self, parts: Sequence[Part]) -> Iterator[Metric]:
        labels = ["hop"]
        connections = GaugeMetricFamily(
            "proxyblocks_listener_connections", "Client connections open on a listener (h1 and h2).", labels=labels
        )
        accepted = CounterMetricFamily(
            "proxyblocks_listener_accepted_connections", "Connections a listener accepted.", labels=labels
        )
        h2 = GaugeMetricFamily(
            "proxyblocks_listener_h2_connections", "HTTP/2 connections open on a listener.", labels=labels
        )
        streams = GaugeMetricFamily(
            "proxyblocks_listener_h2_streams", "HTTP/2 streams open on a listener's connections.", labels=labels
        )
        draining = GaugeMetricFamily("proxyblocks_listener_draining", "1 once a listener drains.", labels=labels)
        abuse = CounterMetricFamily(
            "proxyblocks_abuse_closed_connections",
            "HTTP/2 connections a listener closed with ENHANCE_YOUR_CALM, by reason.",
            labels=["hop", "reason"],
        )
        upstream = GaugeMetricFamily(
            "proxyblocks_upstream_connections",
            "Pooled connections a hop holds to the next hop, by protocol.",
            labels=["hop", "protocol"],
        )
        upstream_streams = GaugeMetricFamily(
            "proxyblocks_upstream_streams", "Requests in flight on a hop's pooled connections.", labels=labels
        )
        for part in parts:
            stats = part.server.statistics()
            connections.add_metric([part.name], stats.connections)
            accepted.add_metric([part.name], stats.accepted)
            h2.add_metric([part.name], len(stats.h2))
            streams.add_metric([part.name], sum(c.streams for c in stats.h2))
            draining.add_metric([part.name], 1.0 if stats.draining else 0.0)
            for reason, n in sorted(stats.abuse.items()):
                abuse.add_metric([part.name, reason], n)
            pools = part.server.upstreams
            if pools is not None:
                by_protocol: dict[str, int] = {}
                active = 0
                for pool in pools.statistics():
                    by_protocol[pool.protocol] = by_protocol.get(pool.protocol, 0) + pool.connections
                    active += pool.active_streams
                for protocol, n in sorted(by_protocol.items()):
                    upstream.add_metric([part.name, protocol], n)
                upstream_streams.add_metric([part.name], active)
        yield from (connections, accepted, h2, streams, draining, abuse, upstream, upstream_streams)

    def _replicas(self, parts: Sequence[Part]) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "proxyblocks_replica_in_flight",
            "Requests in flight per replica, as a hop counts them.",
            labels=["hop", "replica"],
        )
        sessions = GaugeMetricFamily(
            "proxyblocks_replica_sessions", "Sessions per replica, as a hop counts them.", labels=["hop", "replica"]
        )
        for part in parts:
            hop = part.hop
            if isinstance(hop, Proxy | Worker):
                for replica, n in sorted(hop.in_flight.items()):
                    in_flight.add_metric([part.name, replica], n)
            if isinstance(hop, Worker) and hop.sessions is not None:
                for replica, n in sorted(hop.sessions.statistics().active.items()):
                    sessions.add_metric([part.name, replica], n)
            elif isinstance(hop, Proxy) and hop.sessions is not None:
                for replica, place in sorted(hop.sessions.statistics().replicas.items()):
                    sessions.add_metric([part.name, replica], place.active)
        yield in_flight
        yield sessions

    def _proxies(self, parts: Sequence[Part]) -> Iterator[Metric]:
        tenant = ["hop", "tenant"]
        admitted = CounterMetricFamily(
            "proxyblocks_scheduler_admitted", "Requests the fair scheduler admitted, per tenant.", labels=tenant
        )
        queued = CounterMetricFamily(
            "proxyblocks_scheduler_queued",
            "Requests that had to wait in the fair scheduler's queue for a slot, per tenant.",
            labels=tenant,
        )
        refused = CounterMetricFamily(
            "proxyblocks_scheduler_refused",
            "Requests the fair scheduler refused, per tenant: 429 (queue full), 503 (waited too long).",
            labels=[*tenant, "status"],
        )
        depth = GaugeMetricFamily(
            "proxyblocks_scheduler_queue_depth", "Requests waiting for a slot, per tenant.", labels=tenant
        )
        running = GaugeMetricFamily("proxyblocks_scheduler_in_flight", "Slots a tenant holds now.", labels=tenant)
        mirror = CounterMetricFamily(
            "proxyblocks_mirror_copies",
            "Requests the mirror copied to a shadow, by how the copy ended.",
            labels=["hop", "outcome"],
        )
        ejections = CounterMetricFamily(
            "proxyblocks_outlier_ejections", "Times outlier detection ejected a replica.", labels=["hop", "replica"]
        )
        ejected = GaugeMetricFamily(
            "proxyblocks_outlier_ejected", "1 while a replica is ejected from selection.", labels=["hop", "replica"]
        )
        retried = CounterMetricFamily(
            "proxyblocks_proxy_retried",
            "Requests a hop sent to another upstream (the edge: another proxy; a proxy: another replica).",
            labels=["hop"],
        )
        refused_retries = CounterMetricFamily(
            "proxyblocks_proxy_retries_refused",
            "Retries a hop's retry budget refused (the original error was answered).",
            labels=["hop"],
        )
        hop_ejected = GaugeMetricFamily(
            "proxyblocks_outlier_next_hop_ejected",
            "1 while a next hop (a worker, a proxy) is out of selection: ejected, failing its check, or draining.",
            labels=["hop", "next_hop"],
        )
        ramping = GaugeMetricFamily(
            "proxyblocks_outlier_slow_start_share",
            "The share of a full member's traffic a member back from ejection may take now (slow start).",
            labels=["hop", "member"],
        )
        panics = CounterMetricFamily(
            "proxyblocks_outlier_panics",
            "Selections that ignored ejection: fewer than the panic threshold of an app's replicas were left.",
            labels=["hop"],
        )
        checks = CounterMetricFamily(
            "proxyblocks_health_checks",
            "Active health checks a hop sent (a proxy: its workers, ejected replicas; an edge: its proxies).",
            labels=["hop"],
        )
        checks_failed = CounterMetricFamily(
            "proxyblocks_health_check_failures",
            "Health checks (or the prober's polls standing for them) that found no usable answer.",
            labels=["hop"],
        )
        for part in parts:
            hop = part.hop
            if isinstance(hop, Edge | Proxy):  # the hops that retry and check their next hops
                retried.add_metric([part.name], hop.retried)
                refused_retries.add_metric([part.name], hop.retries_refused)
                if hop.health_checker is not None:
                    health = hop.health_checker.statistics()
                    checks.add_metric([part.name], health.checks)
                    checks_failed.add_metric([part.name], health.failed)
            if isinstance(hop, Edge) and hop.to_proxy.outliers is not None:
                for address in sorted(hop.to_proxy.outliers.statistics(hop.clock()).hops):
                    hop_ejected.add_metric([part.name, format_address(address)], 1.0)
            if not isinstance(hop, Proxy):
                continue
            if hop.scheduler is not None:
                for row in self.tenant_rows(hop):
                    name = row["name"]
                    admitted.add_metric([part.name, name], row["admitted"])
                    queued.add_metric([part.name, name], row["queued"])
                    refused.add_metric([part.name, name, "429"], row["refused_429"])
                    refused.add_metric([part.name, name, "503"], row["refused_503"])
                    depth.add_metric([part.name, name], row["waiting"])
                    running.add_metric([part.name, name], row["in_flight"])
            if hop.mirror is not None:
                stats = hop.mirror.statistics()
                for outcome in OUTCOMES:
                    mirror.add_metric([part.name, outcome], getattr(stats, outcome))
            if hop.outliers is not None:
                now = hop.clock()
                outliers = hop.outliers.statistics(now)
                for replica, n in sorted(outliers.by_replica.items()):
                    ejections.add_metric([part.name, replica], n)
                for replica in sorted(outliers.ejected):
                    ejected.add_metric([part.name, replica], 1.0)
                for address in sorted(outliers.hops):
                    hop_ejected.add_metric([part.name, format_address(address)], 1.0)
                for member in sorted(outliers.ramping, key=str):
                    label = member if isinstance(member, str) else format_address(member)
                    ramping.add_metric([part.name, label], hop.outliers.share(member, now))
                panics.add_metric([part.name], outliers.panics)
        yield from (admitted, queued, refused, depth, running, mirror, ejections, ejected, retried)
        yield from (refused_retries, hop_ejected, ramping, panics, checks, checks_failed)

    def tenant_rows(self, proxy: Proxy) -> list[dict[str, Any]]:
        """The proxy's scheduler per tenant: the top tenants by name, the rest summed as ``other``
        (its counts include tenants the scheduler forgot, so each total only grows)."""
        assert proxy.scheduler is not None
        stats = proxy.scheduler.statistics()
        tenants = stats.tenants
        shown = top_tenants({name: t.granted for name, t in tenants.items()}, self._shown, self.top_tenants)
        rows = []
        sums = {"admitted": 0, "queued": 0, "refused_429": 0, "refused_503": 0, "waiting": 0, "in_flight": 0}
        for name in shown:
            t = tenants[name]
            row: dict[str, Any] = {
                "name": name,
                "admitted": t.granted,
                "queued": t.waited,
                "refused_429": t.rejected_full,
                "refused_503": t.rejected_deadline,
                "waiting": t.queued,
                "in_flight": t.in_flight,
            }
            rows.append(row)
            for key in sums:
                sums[key] += row[key]
        other: dict[str, Any] = {
            "name": "other",
            "admitted": stats.granted - sums["admitted"],
            "queued": stats.waited - sums["queued"],
            "refused_429": stats.rejected_full - sums["refused_429"],
            "refused_503": stats.rejected_deadline - sums["refused_503"],
            "waiting": stats.queued - sums["waiting"],
            "in_flight": stats.in_flight - sums["in_flight"],
        }
        if len(tenants) > len(shown) or any(other[key] for key in sums):
            rows.append(other)
        return rows

    def _routes(self, routes: RouteCache | None) -> Iterator[Metric]:
        revision = GaugeMetricFamily("proxyblocks_routes_revision", "The route store revision the cache reflects.")
        staleness = GaugeMetricFamily(
            "proxyblocks_routes_staleness_seconds",
            "Seconds since the route source last confirmed the cache current (0 in sync, +Inf never loaded).",
        )
        if routes is not None:
            revision.add_metric([], routes.revision)
            staleness.add_metric([], routes_staleness(routes))
        yield revision
        yield staleness


def routes_staleness(routes: RouteCache) -> float:
    """The cache's staleness now (trio's clock, the reconciler's), or at its latest confirmation outside trio."""
    try:
        now = trio.current_time()
    except RuntimeError:
        return routes.statistics().staleness
    return routes.staleness(now)
