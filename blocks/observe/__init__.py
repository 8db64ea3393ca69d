"""Observability: Prometheus metrics, health and readiness, the admin page, the access log, request ids.

- :class:`Metrics`: a hop :class:`~blocks.hops.Feature` that counts every
  request the hop answers (by app, status class and ``proxyblocks-error``
  reason) and its Server-Timing phases, in plain ints on the request path;
- :func:`serve_admin`: an admin listener on its own port serving ``GET
  /metrics`` (Prometheus text format 0.0.4, rendered at scrape time by
  :class:`MetricsCollector` from every part's ``statistics()``),
  ``/healthz``, ``/readyz`` (503 from the moment a drain starts),
  ``/status.json`` and ``/`` (the live admin page);
  :meth:`~blocks.topology.Chain.start_admin` runs one over a chain;
- :class:`RequestIds`: an edge feature that keeps or starts ``x-request-id``
  and W3C ``traceparent``, on the way up and back;
- :func:`open_access_log`: one JSON line per request (:class:`AccessLog`,
  a feature), written by a task of its own, never blocking a request;
- :func:`configure_logging`: what ``--log-level`` sets;
- :func:`serve_merged_admin`: the admin listener of a supervising parent
  (``--processes N``): every child's ``/metrics`` with a ``process`` label,
  ``/status.json`` per child, ``/healthz`` and ``/readyz`` for all.

See docs/observability.md for the endpoints, every metric family and every log field.
"""

from blocks.observe._accesslog import AccessLog, AccessLogStatistics, open_access_log
from blocks.observe._admin import ADMIN_LISTENER, METRICS_CONTENT_TYPE, admin_page, ready, serve_admin, status
from blocks.observe._ids import (
    REQUEST_IDS,
    RequestIds,
    new_request_id,
    new_traceparent,
    valid_request_id,
    valid_traceparent,
)
from blocks.observe._logging import LEVELS, configure_logging
from blocks.observe._merged import ProcessAdmin, merge_metrics, serve_merged_admin
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
    "REQUEST_IDS",
    "ADMIN_LISTENER",
    "DEFAULT_BUCKETS",
    "LEVELS",
    "METRICS_CONTENT_TYPE",
    "AccessLog",
    "AccessLogStatistics",
    "HopErrorRecord",
    "Metrics",
    "MetricsCollector",
    "Observed",
    "Part",
    "PhaseHistogram",
    "ProcessAdmin",
    "RequestIds",
    "admin_page",
    "configure_logging",
    "hop_metrics",
    "merge_metrics",
    "named_parts",
    "new_request_id",
    "new_traceparent",
    "open_access_log",
    "ready",
    "serve_admin",
    "serve_merged_admin",
    "served_hop",
    "status",
    "valid_request_id",
    "valid_traceparent",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
