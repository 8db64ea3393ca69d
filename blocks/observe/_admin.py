"""The admin listener: ``/metrics``, ``/healthz``, ``/readyz``, ``/status.json`` and the admin page.

It is a listener of its own (:func:`~blocks.serve_http` on its own port,
never the traffic's), and reads the process's parts through a function
called on every request (:class:`~blocks.observe.Observed`), so it sees
parts started after it and never holds a copy that goes stale.
"""

from __future__ import annotations

import importlib.resources
import json
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio
from prometheus_client import CollectorRegistry, generate_latest

from blocks.hops import Proxy, Worker
from blocks.http import BytesBody, Request, Response, json_response, text_response
from blocks.observe._metrics import (
    STATUS_CLASSES,
    MetricsCollector,
    Observed,
    hop_metrics,
    routes_staleness,
    status_class_counts,
)
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http

METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format, 0.0.4 (what every Prometheus server reads)."""

_PLACEHOLDER = "<!doctype html><title>proxyblocks</title><p>proxyblocks admin: /metrics, /status.json</p>\n"

ADMIN_LISTENER = ListenerConfig(hop="admin")
"""The admin listener's settings: a validating listener whose own errors name ``hop=admin``."""


def admin_page() -> bytes:
    """``blocks/observe/admin.html`` (the live page), or a one-line placeholder if the package has none."""
    try:
        return importlib.resources.files("blocks.observe").joinpath("admin.html").read_bytes()
    except (FileNotFoundError, OSError):
        return _PLACEHOLDER.encode()


def ready(observed: Observed) -> tuple[bool, str]:
    """``(ready, why)``: listeners open and none draining, and routes loaded (where the process has a proxy)."""
    if not observed.parts:
        return False, "no listener open yet"
    for part in observed.parts:
        if part.server.draining:
            return False, f"{part.name} is draining"
    if observed.routes is not None and routes_staleness(observed.routes) == float("inf"):
        return False, "routes not loaded yet"
    return True, "ready"


def status(observed: Observed, collector: MetricsCollector) -> dict[str, Any]:
    """The ``/status.json`` document (docs/observability.md): the process's parts, as of now."""
    parts = observed.parts
    listeners = []
    hops = []
    apps: list[dict[str, Any]] = []
    tenants: list[dict[str, Any]] = []
    mirror: list[dict[str, Any]] = []
    last_errors: list[dict[str, Any]] = []
    for part in parts:
        stats = part.server.statistics()
        listeners.append(
            {
                "part": part.name,
                "url": part.server.url,
                "connections": stats.connections,
                "streams": sum(c.streams for c in stats.h2),
            }
        )
        metrics = hop_metrics(part.hop)
        if metrics is not None:
            requests = dict.fromkeys(STATUS_CLASSES[1:], 0)
            for counts in metrics.requests.values():
                for status_class, n in status_class_counts(counts).items():
                    if status_class in requests:
                        requests[status_class] += n
            errors: dict[str, int] = {}
            for (_, _, reason), n in metrics.errors.items():
                errors[reason] = errors.get(reason, 0) + n
            phases = {}
            for phase, histogram in sorted(metrics.phases.items()):
                p50, p99 = histogram.quantile(0.5), histogram.quantile(0.99)
                phases[phase] = {
                    "count": histogram.count,
                    "p50_ms": None if p50 is None else round(p50 * 1000, 3),
                    "p99_ms": None if p99 is None else round(p99 * 1000, 3),
                }
            hops.append({"name": part.name, "requests": requests, "errors": errors, "phases": phases})
            last_errors.extend(attrs.asdict(record) for record in metrics.last_errors)
        hop = part.hop
        if isinstance(hop, Proxy):
            apps += _proxy_apps(hop)
            if hop.scheduler is not None:
                tenants += [{key: row[key] for key in _TENANT_KEYS} for row in collector.tenant_rows(hop)]
            if hop.mirror is not None:
                for route, comparison in sorted(hop.mirror.statistics().routes.items()):
                    app, _, prefix = route.partition(" ")
                    mirror.append(
                        {
                            "app": app,
                            "route": prefix or "/",
                            "pairs": comparison.pairs,
                            "matches": comparison.matches,
                            "mismatches": comparison.mismatches,
                        }
                    )
        elif isinstance(hop, Worker) and not any(isinstance(p.hop, Proxy) for p in parts):
            apps.append(_worker_app(part.name, hop))
    last_errors = _first_seen(last_errors)
    routes: dict[str, Any] = {}
    if observed.routes is not None:
        staleness = routes_staleness(observed.routes)
        routes = {
            "revision": observed.routes.revision,
            "staleness_s": None if staleness == float("inf") else round(staleness, 3),
            "connected": staleness == 0.0,
        }
    return {
        "time": time.time(),
        "draining": any(part.server.draining for part in parts),
        "listeners": listeners,
        "hops": hops,
        "apps": apps,
        "tenants": tenants,
        "mirror": mirror,
        "routes": routes,
        "last_errors": last_errors[:20],
    }


_TENANT_KEYS = ("name", "admitted", "queued", "refused_429", "refused_503", "waiting")


def _proxy_apps(proxy: Proxy) -> list[dict[str, Any]]:
    now = proxy.clock()
    outliers = proxy.outliers.statistics(now) if proxy.outliers is not None else None
    sessions = proxy.sessions.statistics().replicas if proxy.sessions is not None else {}
    apps = []
    for app, replicas in sorted(proxy.routes.app_replicas().items()):
        rows = []
        for replica in replicas:
            name = replica.name
            place = sessions.get(name)
            rows.append(
                {
                    "name": name,
                    "in_flight": proxy.in_flight.get(name, 0),
                    "ejected": outliers is not None and name in outliers.ejected,
                    "ejections": outliers.by_replica.get(name, 0) if outliers is not None else 0,
                    "sessions": place.active if place is not None else 0,
                }
            )
        apps.append({"name": app, "replicas": rows})
    return apps


def _worker_app(name: str, worker: Worker) -> dict[str, Any]:
    sessions = worker.sessions.statistics().active if worker.sessions is not None else {}
    rows = [
        {"name": replica, "in_flight": n, "ejected": False, "ejections": 0, "sessions": sessions.get(replica, 0)}
        for replica, n in sorted(worker.in_flight.items())
    ]
    return {"name": name, "replicas": rows}


class _Admin:
    def __init__(self, observe: Callable[[], Observed], top_tenants: int) -> None:
        self.observe = observe
        self.collector = MetricsCollector(observe, top_tenants=top_tenants)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.page = admin_page()

    async def handle(self, request: Request) -> Response:
        await trio.lowlevel.checkpoint()
        path = request.path.partition(b"?")[0]
        if request.method not in (b"GET", b"HEAD"):
            return text_response(405, "the admin listener answers GET only\n", [(b"allow", b"GET, HEAD")])
        if path == b"/metrics":
            body = generate_latest(self.registry)
            headers = [(b"content-type", METRICS_CONTENT_TYPE), (b"content-length", b"%d" % len(body))]
            return Response(200, headers, BytesBody(body))
        if path == b"/healthz":
            return text_response(200, "ok\n")
        if path == b"/readyz":
            ok, why = ready(self.observe())
            return text_response(200 if ok else 503, why + "\n", [(b"cache-control", b"no-store")])
        if path == b"/status.json":
            document = status(self.observe(), self.collector)
            return json_response(200, json.dumps(document, allow_nan=False).encode())
        if path in (b"/", b"/index.html"):
            page = self.page
            headers = [
                (b"content-type", b"text/html; charset=utf-8"),
                (b"content-length", b"%d" % len(page)),
                (b"cache-control", b"no-store"),
            ]
            return Response(200, headers, BytesBody(page))
        return text_response(404, "not found: try /metrics, /healthz, /readyz, /status.json or /\n")


async def serve_admin(
    observe: Callable[[], Observed],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    top_tenants: int = 10,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin endpoints for what ``observe()`` returns (called on every request), on ``host:port``.

    ``GET /metrics`` (Prometheus text, 0.0.4), ``/healthz`` (200 while the
    process runs), ``/readyz`` (200 once every part listens and routes are
    loaded, 503 from the moment a drain starts), ``/status.json`` and ``/``
    (the live page). ``top_tenants`` bounds the ``tenant`` label. Reports
    its :class:`~blocks.transport.listener.HTTPServer`; runs until cancelled.
    """
    admin = _Admin(observe, top_tenants)
    await serve_http(admin.handle, host=host, port=port, config=ADMIN_LISTENER, task_status=task_status)


def _first_seen(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Newest first, each error once: one that crossed several hops of this process (a worker's 502,
    relayed by the proxy and the edge within a second) is kept as the hop nearest its cause saw it."""
    kept: list[dict[str, Any]] = []
    for error in sorted(errors, key=lambda e: e["time"]):
        what = (error["status"], error["reason"], error["method"], error["authority"], error["path"])
        if not any(
            (seen["status"], seen["reason"], seen["method"], seen["authority"], seen["path"]) == what
            and error["time"] - seen["time"] < 1.0
            and seen["hop"] != error["hop"]
            for seen in kept[-8:]
        ):
            kept.append(error)
    return kept[::-1]
