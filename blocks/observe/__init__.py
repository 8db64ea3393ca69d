"""Observability: Prometheus metrics, health and readiness, the status document and the admin page.

- :class:`Metrics`: a hop :class:`~blocks.hops.Feature` that counts every
  request the hop answers (by app, status class and ``proxyblocks-error``
  reason) and its Server-Timing phases, in plain ints on the request path;
- :func:`serve_admin`: an admin listener on its own port serving ``GET
  /metrics`` (Prometheus text format 0.0.4, rendered at scrape time by
  :class:`MetricsCollector` from every part's ``statistics()``),
  ``/healthz``, ``/readyz`` (503 from the moment a drain starts),
  ``/status.json`` and ``/`` (the live admin page);
  :meth:`~blocks.topology.Chain.start_admin` runs one over a chain.

See docs/observability.md for the endpoints and every metric family.
"""

from blocks.observe._admin import ADMIN_LISTENER, METRICS_CONTENT_TYPE, admin_page, ready, serve_admin, status
from blocks.observe._metrics import (
    DEFAULT_BUCKETS,
    HopErrorRecord,
    Metrics,
    MetricsCollector,
    Observed,
    Part,
    PhaseHistogram,
    hop_metrics,
    named_parts,
    served_hop,
)

__all__ = [
    "ADMIN_LISTENER",
    "DEFAULT_BUCKETS",
    "METRICS_CONTENT_TYPE",
    "HopErrorRecord",
    "Metrics",
    "MetricsCollector",
    "Observed",
    "Part",
    "PhaseHistogram",
    "admin_page",
    "hop_metrics",
    "named_parts",
    "ready",
    "serve_admin",
    "served_hop",
    "status",
]
