"""Every field and path the hops use to talk to each other, defined once: who writes it, who reads it.

The edge drops every ``x-proxyblocks-*`` field a client sends
(:data:`INTERNAL_PREFIX`), so a field below reaches a hop only when a hop
behind the edge wrote it. The ``/.proxyblocks/*`` paths are answered by a
hop only when the request also carries such a field; without one, a
client's request for the same path reaches its app like any other.

Readers find a field by name, never by its position among the fields.
"""

from __future__ import annotations

INTERNAL_PREFIX = b"x-proxyblocks-"
"""The prefix of every field below: the edge drops a client's fields that start with it."""

REPLICA_HEADER = b"x-proxyblocks-replica"
"""Written by the proxy (its route or a session's pin): the replica it picked.
Read, and removed, by the worker, which forwards the request to that replica."""

TARGET_HEADER = b"x-proxyblocks-target"
"""Written by the proxy beside :data:`REPLICA_HEADER`: how the worker reaches
that replica, as its route entry says (``h2 host:port`` or ``h1 host:port``,
:attr:`~blocks.routing.Replica.target`). Read, and removed, by the worker for
a replica it is not configured with, so a route file or an etcd entry naming
any server works; a replica the worker is configured with is reached as
configured. The proxy's session starts and ends carry it too, so a worker
with sessions keeps them for such a replica. A worker forwards wherever this
field says: like every internal listener, it must only be reachable from the
proxies."""

SESSION_HEADER = b"x-proxyblocks-session"
"""Written by the proxy for a request of a session (its id, from the signed
session token). Read by the worker, which counts the request in that session
(a 410 if it does not host it), and seen by the replica."""

SESSION_LIMIT_HEADER = b"x-proxyblocks-session-limit"
"""Written by the proxy on its session starts and ends: the most sessions one
replica of the app hosts (its ``max_per_replica``), when it has a limit. Read
by a worker taking on a replica it does not list (reached by its route), which
holds it to that limit from then on: the worker has the last word on a place,
so several proxies' starts never take a replica past the limit."""

PROBE_HEADER = b"x-proxyblocks-probe"
"""Written by the proxy's prober and session broker on their own requests.
Read by the worker: with it, :data:`LOAD_PATH` and :data:`SESSIONS_PATH`
are answered by the worker itself; and by every hop: with it, :data:`HEALTH_PATH`
is answered by the hop itself."""

MIRROR_HEADER = b"x-proxyblocks-mirror"
"""Written by the proxy's mirror on every copy it sends a shadow (the default
of ``MirrorConfig.header``), so a shadow can tell a copy from live traffic.
Read by the shadow's app, if it cares; no hop reads it."""

ENDED_HEADER = b"proxyblocks-session-ended"
"""Written by the proxy or the worker on a ``session_lost`` answer, for the client: why
(``replica-gone``, ``not-hosted``, ``drained``, ``replica-unreachable``; see
:class:`~blocks.errors.SessionLost`). (Not internal: it is meant to reach the client.)"""

SESSION_TOKEN_HEADER = b"proxyblocks-session-token"
"""Written by the proxy on the response to a request of a session it restarted on another
replica (the app's ``on_replica_loss = "restart"``): the new session token, which the client
sends from then on (the cookie, when the app sets one, is set too). (Meant for the client.)"""

ERROR_HEADER = b"proxyblocks-error"
"""Written on every error a hop answers itself, for the client: ``REASON; hop=NAME``
(:data:`blocks.errors.REASONS`; docs/errors.md). A hop relaying an error from
behind keeps it as it came; the proxy reads the worker's to retry a request
that reached no replica. (Not internal: it is meant to reach the client.)"""

REPORT_HEADER = b"x-proxyblocks-report"
"""Written by the edge's access log as a request's last field: the proxy is to
report where the request went. Read, and removed, by the proxy, which then
writes :data:`ROUTED_HEADER` on the response."""

ROUTED_HEADER = b"x-proxyblocks-routed"
"""Written by the proxy on the response to a request that carried
:data:`REPORT_HEADER`: ``APP REPLICA TENANT`` (``-`` for unknown). Read, and
removed from the response, by the edge's access log."""

LOAD_PATH = b"/.proxyblocks/load"
"""``GET`` with :data:`PROBE_HEADER`: the worker answers with its replicas'
load as JSON (written by the prober, read by the worker)."""

HEALTH_PATH = b"/.proxyblocks/health"
"""``GET`` with :data:`PROBE_HEADER`: every hop (edge, proxy, worker) answers 200 while it serves
and 503 once it drains (written by the health checker, :func:`blocks.prober.open_health_checker`;
read by the hop itself). To a worker, with :data:`REPLICA_HEADER` (and :data:`TARGET_HEADER`):
200 if it can reach that replica now (a pooled connection, or a fresh connect), else 502."""

SESSIONS_PATH = b"/.proxyblocks/sessions"
"""At the proxy, from a client: ``POST`` starts a session of a sessioned app,
``DELETE`` (with its session token) ends it. From the proxy's session broker
to the worker, with :data:`PROBE_HEADER` and :data:`SESSION_HEADER`: open or
end that session on the replica :data:`REPLICA_HEADER` names. From the
autoscaler to the worker, ``DELETE`` with :data:`PROBE_HEADER` and
:data:`REPLICA_HEADER` but no :data:`SESSION_HEADER`: that replica was
drained past its time, end every session it hosts (``drained``) and close
every WebSocket to it with a Close frame."""

__all__ = [
    "ENDED_HEADER",
    "ERROR_HEADER",
    "HEALTH_PATH",
    "INTERNAL_PREFIX",
    "LOAD_PATH",
    "MIRROR_HEADER",
    "PROBE_HEADER",
    "REPLICA_HEADER",
    "REPORT_HEADER",
    "ROUTED_HEADER",
    "SESSIONS_PATH",
    "SESSION_HEADER",
    "SESSION_TOKEN_HEADER",
    "SESSION_LIMIT_HEADER",
    "TARGET_HEADER",
]
