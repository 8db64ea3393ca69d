"""What one process of the chain runs, checked before anything starts: :class:`ChainPlan`.

The chain recipe (``recipes/chain.py``) turns its flags and config file into
a plan; the plan says, in one place, which flags go with which role (a
wrong combination is a ``ValueError`` naming the flag, before anything
listens) and builds the parts in a :class:`~blocks.topology.Chain`, back to
front: the replicas beside each worker, the workers, the proxies, the edge.

Several of each hop: ``workers`` and ``proxies`` in one process (the
edge spreads over the proxies, each proxy routes every replica behind
each worker), ``next_hops`` for a process that runs one role (an edge's
proxies, a proxy's workers), and ``route_source``, an etcd where a fleet's
hops find each other without restarts: a worker registers the replicas
beside it with its own address, a proxy registers itself, an edge follows
the proxies registered there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import attrs

from blocks.hops import ColdStartConfig, ProxyConfig
from blocks.routing import Address
from blocks.scheduler import SchedulerConfig
from blocks.sessions import WorkerSessionConfig
from blocks.sources import EtcdSource
from blocks.topology._chain import Chain, beside_name
from blocks.topology._records import LOOPBACK, App, replica_from_url
from blocks.transport.multiplexer import UpstreamConfig

ROLES = ("chain", "edge", "proxy", "worker")
ROUTED_COLD_START = ColdStartConfig()
"""A proxy's cold-start wait when it routes from etcd (``--route-source``): an autoscaler elsewhere may
bring an app up from zero; the config file's ``[cold_start]`` table changes it, or turns it off."""
_WILDCARDS = ("0.0.0.0", "::", "")


@attrs.frozen(kw_only=True)
class ChainPlan:
    """The parts one process of the chain runs (``role``), and how they reach each other.

    ``role``: ``chain`` (every hop), or one of ``edge``, ``proxy``,
    ``worker``. ``replicas``: demo replicas beside each worker of a chain
    (none behind ``replica_urls``, your servers, routed as the app ``demo``
    for every domain; ``apps`` adds apps of their own). ``workers`` /
    ``proxies``: how many of each a chain runs; ``next_hops``: a role's own
    (an edge's proxies, a proxy's workers). ``name``: a role's hop name.
    ``route_source``: the fleet's etcd (the proxy's routes; a worker and a
    proxy register there, at ``advertise`` or where they listen; an edge
    finds the proxies there; a proxy holds a request for an app with no
    live replica until one is routed, and publishes what waits there for
    the autoscaler: ``ProxyConfig.cold_start``, :data:`ROUTED_COLD_START`
    unless the config file's ``[cold_start]`` says otherwise). ``options``: each hop's keywords from the
    config file (and ``replica``: each replica's :class:`~blocks.LocalReplica`
    fields, its ``max_sessions``); ``reread``: new ``replica_urls`` and ``apps`` on reload.
    Every other field is the flag of the same name (docs/recipes.md).

    Sessions wherever it runs: a ``worker`` process keeps sessions (the
    ``[sessions]`` of ``options``, else :class:`~blocks.WorkerSessionConfig`'s
    defaults) for every replica a proxy starts one on, and lists the
    replicas beside it by the names it registers them with, each held to
    its ``max_sessions`` whatever proxy starts there.
    """

    role: str = attrs.field(default="chain", validator=attrs.validators.in_(ROLES))
    host: str = LOOPBACK
    port: int = 0
    replicas: int = 2
    replica_protocol: str = "h2"
    replica_timeout: float = 30.0
    replica_ca: Path | None = None
    replica_urls: Sequence[str] = ()
    apps: Mapping[str, App] | None = None
    tls: bool = False
    cert: Path | None = None
    key: Path | None = None
    cert_dir: Path | None = None
    scheduler: SchedulerConfig | None = None
    routes_file: Path | None = None
    next_hops: Sequence[Address] = ()
    proxies: int = 1
    workers: int = 1
    name: str | None = None
    advertise: Address | None = None
    route_source: str | None = None
    options: Mapping[str, Mapping[str, Any]] | None = None
    reread: Callable[[], object] | None = None

    def __attrs_post_init__(self) -> None:
        role, routed = self.role, bool(self.replica_urls or self.apps)
        if not self.next_hops and (
            (role == "edge" and not self.route_source)
            or (role == "proxy" and (routed or not (self.route_source or self.routes_file)))
        ):
            raise ValueError(f"--role {role}" + (" with --replica or apps" if routed else "") + " needs --next-hop")
        if role != "chain" and max(self.proxies, self.workers) > 1:
            raise ValueError(f"--proxies and --workers are for --role chain; run one --role {role} process each")
        if role == "chain" and self.name is not None:
            raise ValueError("--name names the hop of a --role edge, proxy or worker process")
        if role == "worker" and routed and not self.route_source:
            raise ValueError("--role worker registers its --replica servers in the etcd of --route-source")
        if self.route_source and role in ("worker", "proxy") and self.host in _WILDCARDS and not self.advertise:
            raise ValueError(f"--role {role} --host {self.host} registers in --route-source: say where, --advertise")

    def _options(self, hop: str) -> dict[str, Any]:
        return {"port": self.port if self.role == hop else 0, **(self.options or {}).get(hop, {})}

    def _yours(self, urls: Sequence[str], apps: Mapping[str, App] | None) -> dict[str, App]:
        """Your servers as the app ``demo`` (every domain), and ``apps``, each replica with the
        config file's fields for it (``options["replica"]``: its ``max_sessions``)."""
        fields = (self.options or {}).get("replica", {})
        yours = {f"replica-{i}": replica_from_url(url) for i, url in enumerate(urls)}
        every = {"demo": App(("*",), yours), **(apps or {})} if yours else dict(apps or {})
        if not fields:
            return every
        return {
            name: attrs.evolve(app, replicas={key: attrs.evolve(one, **fields) for key, one in app.replicas.items()})
            for name, app in every.items()
        }

    def proxy_options(self, k: int = 1) -> dict[str, Any]:
        """The keywords of proxy ``k`` (from 1): the config file's, and its ``config``, a
        :class:`~blocks.ProxyConfig` with its name and its cold-start wait (:data:`ROUTED_COLD_START`
        when it routes from etcd, unless the file's ``[cold_start]`` says otherwise)."""
        options = self._options("proxy")
        given = options.pop("config", None)
        base = given or ProxyConfig(cold_start=ROUTED_COLD_START if self.route_source else None)
        name = self.name or (f"proxy-{k}" if self.proxies > 1 else "proxy")
        return {**options, "config": attrs.evolve(base, name=name)}

    async def build(self, chain: Chain) -> None:
        """Start this plan's parts in ``chain``, back to front (what :func:`~blocks.topology.serve_chain` calls)."""
        role = self.role
        chain.front = "edge" if role == "chain" else role  # (where the access log goes, unless told)
        behind = list(self.next_hops)  # the proxies' workers
        if role in ("chain", "worker"):
            behind += await self._start_workers(chain)
        if role in ("chain", "proxy"):
            await self._start_proxies(chain, behind)
        if role in ("chain", "edge"):
            await chain.start_edge(
                port=self.port,
                proxies=self.next_hops,
                proxies_from=EtcdSource(self.route_source) if self.route_source and role == "edge" else None,
                name=self.name or "edge",
                tls=self.tls,
                cert=self.cert,
                key=self.key,
                cert_dir=self.cert_dir,
                upstream=UpstreamConfig(response_timeout=self.replica_timeout + 10),
            )

    async def _start_workers(self, chain: Chain) -> list[Address]:
        """Each worker beside its own demo replicas (``replica-I@worker-J`` when there are several)."""
        demo = range(self.replicas if self.role == "chain" and not self.replica_urls else 0)
        # A pooled connection to a replica idles out before common servers' keep-alive (Hypercorn's
        # and uvicorn's 5 s) closes it under a request it could not resend.
        upstream = UpstreamConfig(response_timeout=self.replica_timeout, ca_file=self.replica_ca, h2_idle_timeout=4.0)
        options = self._options("worker")
        fields = (self.options or {}).get("replica", {})  # the demo replicas' max_sessions, as your servers'
        if self.role == "worker":  # a fleet's proxies may open sessions on any replica it reaches
            options.setdefault("sessions", WorkerSessionConfig())
        beside = self._yours(self.replica_urls, self.apps) if self.role == "worker" and self.route_source else {}
        addresses = []
        for j in range(1, self.workers + 1):
            named = f"replica-{{}}@worker-{j}" if self.workers > 1 else "replica-{}"
            local = {
                named.format(i): await chain.start_replica(named.format(i), protocol=self.replica_protocol, **fields)
                for i in demo
            }
            worker = self.name or (f"worker-{j}" if self.workers > 1 else "worker")
            # A worker lists the replicas beside it by the names it registers them with, so it holds
            # each to its max_sessions from the first start, and its load reports them from the first poll.
            listed = local or {
                beside_name(key, worker): one for app in beside.values() for key, one in app.replicas.items()
            }
            server, _ = await chain.start_worker(listed, app=None, upstream=upstream, name=worker, **options)
            addresses.append((self.host, server.port))
            if local:
                chain.route({"demo": App(("*",), local)}, worker=addresses[-1], layer=worker)
            if beside:  # the replicas beside it, for every proxy of the fleet
                await chain.register_replicas(
                    EtcdSource(self.route_source or ""), beside, worker=self.advertise or addresses[-1]
                )
        return addresses

    async def _start_proxies(self, chain: Chain, workers: list[Address]) -> None:
        """The proxies, sharing one route cache: your replicas behind each worker, the route file, etcd."""

        def route(urls: Sequence[str], apps: Mapping[str, App] | None) -> None:
            if workers:
                chain.route({"demo": App(("*",), {}), **self._yours(urls, apps)}, workers=workers)

        route(self.replica_urls, self.apps)
        if self.reread is not None:
            reread = self.reread
            chain.on_reload(lambda: route(*attrgetter("replica_urls", "apps")(reread())))
        if self.routes_file is not None:
            chain.follow_route_file(self.routes_file)
        source = EtcdSource(self.route_source) if self.route_source else None
        upstream = UpstreamConfig(response_timeout=self.replica_timeout + 5)  # > the worker's: its 504 shows
        for k in range(1, self.proxies + 1):
            await chain.start_proxy(source=source, scheduler=self.scheduler, upstream=upstream, **self.proxy_options(k))
        if self.role == "proxy" and source is not None:  # known to every edge that follows the etcd
            await chain.register_proxy(source, address=self.advertise or (self.host, chain.proxy_server.port))
