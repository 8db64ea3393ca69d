"""The three hops of the chain: edge, proxy and worker.

Each hop is a :class:`Hop`: an ordered stack of :class:`Feature` objects
(screen, route, dispatched, response, closed: synchronous, in memory)
around a shared :class:`~blocks.transport.multiplexer.Upstreams`, carried
out by the hop's fast path (``relay``) or handler (``handle``), and a
``serve_*`` function that runs it on a listener::

    client --h1/h2/TLS--> Edge --h2--> Proxy --h2--> Worker --h2|h1--> replica

- :class:`Edge` faces the clients: the listener validates every head there,
  the edge drops hop-by-hop and internal (``x-proxyblocks-*``) fields, sets
  ``x-forwarded-for``/``x-forwarded-proto``, and sends everything to the
  proxy over pooled h2.
- :class:`Proxy` maps the authority to an app and the app to a replica
  (in memory), and forwards to the replica's worker, naming the replica in
  ``x-proxyblocks-replica``. With ``ProxyConfig(cold_start=...)``, a request
  for an app with no live replica waits for one (:class:`AwaitReplica`).
- :class:`Worker` relays each stream to its local replica over h2 or h1 and
  counts what is in flight per replica.

Behind the edge every hop trusts the one before it: heads are validated
once, at the edge, and internal listeners run with ``validate=False``.
Each hop appends its entries to the response's ``server-timing`` header
(see :mod:`blocks.timing`).
"""

from blocks.fields import INTERNAL_PREFIX
from blocks.hops._hop import INTERNAL_LISTENER, Admission, Answer, Exchange, Feature, Forward, Hop, NoteKey
from blocks.hops._websockets import WebSockets
from blocks.hops.edge import Edge, EdgeConfig, ToProxy, forwarded_headers, serve_edge
from blocks.hops.features.cold_start import AwaitReplica, ColdStartConfig, ColdStartStatistics, ReplicaWait
from blocks.hops.proxy import (
    AppLookup,
    Authorize,
    InFlight,
    Mirroring,
    Outliers,
    Proxy,
    ProxyConfig,
    ProxyStatistics,
    ReportRoute,
    Router,
    SessionPin,
    serve_proxy,
)
from blocks.hops.worker import LocalReplica, LocalRoute, Probes, SessionCount, Worker, WorkerStatistics, serve_worker

__all__ = [
    "INTERNAL_LISTENER",
    "INTERNAL_PREFIX",
    "Admission",
    "Answer",
    "AppLookup",
    "Authorize",
    "AwaitReplica",
    "ColdStartConfig",
    "ColdStartStatistics",
    "Edge",
    "EdgeConfig",
    "Exchange",
    "Feature",
    "Forward",
    "NoteKey",
    "Hop",
    "InFlight",
    "LocalReplica",
    "LocalRoute",
    "Mirroring",
    "Outliers",
    "Probes",
    "Proxy",
    "ProxyConfig",
    "ProxyStatistics",
    "ReplicaWait",
    "ReportRoute",
    "Router",
    "SessionCount",
    "SessionPin",
    "ToProxy",
    "WebSockets",
    "Worker",
    "WorkerStatistics",
    "forwarded_headers",
    "serve_edge",
    "serve_proxy",
    "serve_worker",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
