"""A chain in one process, started part by part: :class:`Chain`, :func:`open_chain`, :func:`serve_chain`."""

from __future__ import annotations

import functools
import shutil
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from blocks.autoscaler import AutoscalePolicy, Autoscaler, ReplicaTemplate, serve_autoscaler
from blocks.command import Operations
from blocks.hops import (
    INTERNAL_LISTENER,
    EdgeConfig,
    Feature,
    LocalReplica,
    Proxy,
    Worker,
    serve_edge,
    serve_proxy,
    serve_worker,
)
from blocks.observe import (
    AccessLog,
    Metrics,
    Observed,
    RequestIds,
    named_parts,
    open_access_log,
    serve_admin,
    served_hop,
)
from blocks.routing import (
    Address,
    AppSettings,
    RouteCache,
    encode_replica,
    route_key_for_replica,
)
from blocks.sources import EmbeddedStore, EtcdSource, RouteSource, reconcile
from blocks.sources.demand import serve_demand
from blocks.sources.register import PROXIES_APP, PROXIES_PREFIX, serve_registration
from blocks.testing import make_self_signed, serve_demo_replica
from blocks.topology._records import LOOPBACK, App, route_records
from blocks.transport.listener import HTTPServer, ListenerConfig
from blocks.transport.streams import codec_in_use
from blocks.transport.tls import server_context

ServeReplica = Callable[..., Awaitable[None]]
"""A ``serve_*`` function for one replica, called as ``serve(host=HOST, task_status=...)``
(a ``functools.partial`` of :func:`~blocks.serve_http`, say); it reports its :class:`HTTPServer`."""

BuildChain = Callable[["Chain"], Awaitable[None]]
"""What :func:`serve_chain` calls to start a chain's parts, in order."""


@attrs.define(eq=False)
class Chain:
    """A chain in one process, started part by part in the nursery it owns (see :func:`open_chain`).

    ``replicas``: the replica servers it started, by name; ``workers`` and
    ``proxies``: every worker and proxy it started, in order
    (``worker``/``worker_server`` and ``proxy``/``proxy_server`` are the first);
    ``store`` and ``cache``: the routes and the proxy's copy of them;
    ``cert``: the edge's certificate with ``tls=True``. Reading a part that
    has not started (``edge`` before :meth:`start_edge`) raises
    ``RuntimeError``.
    """

    host: str
    store: EmbeddedStore
    cache: RouteCache
    _nursery: trio.Nursery
    replicas: dict[str, HTTPServer] = attrs.field(factory=dict)
    workers: list[tuple[HTTPServer, Worker]] = attrs.field(factory=list)
    cert: Path | None = None
    proxies: list[tuple[HTTPServer, Proxy]] = attrs.field(factory=list)
    _edge: HTTPServer | None = None
    _scratch: tempfile.TemporaryDirectory[str] | None = None  # the self-signed key's, removed with the chain
    _reloads: list[Callable[[], object]] = attrs.field(factory=list)
    operations: Operations = attrs.field(factory=Operations, kw_only=True)
    front: str = attrs.field(default="edge", kw_only=True)
    """The hop facing this process's clients (a process running one role: that role): where the
    access log is written when :attr:`operations` name no hops."""
    admin: HTTPServer | None = None
    _access_log: AccessLog | None = None
    _registrations: list[tuple[trio.CancelScope, trio.Event]] = attrs.field(factory=list)

    async def _observed(self, hop: str, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` for ``hop`` (``edge``, ``proxy``, ``worker``) with the features its operators
        asked for: request ids at the edge (first, so every later feature sees them),
        :class:`~blocks.observe.Metrics` with an admin port, and the chain's one access log (last, so
        its line has what the others decided) at the hops :attr:`operations` name."""
        operations = self.operations
        features: list[Feature] = [RequestIds()] if hop == "edge" else []
        features += options.get("features", ())
        if operations.admin_port is not None:
            features.append(Metrics())
        if operations.access_log is not None and hop in (operations.access_log_hops or {self.front}):
            if self._access_log is None:
                self._access_log = await self._nursery.start(_serve_access_log, operations.access_log)
            features.append(self._access_log)
        return {**options, "features": features}

    def _shared(self, options: dict[str, Any], port: int, default: ListenerConfig) -> dict[str, Any]:
        """``options`` of a hop listening on ``port``: when :attr:`operations` say several processes
        serve it (``processes``), a fixed port is bound with ``SO_REUSEPORT`` (their shared port)."""
        if self.operations.processes > 1 and port:
            listener = options.get("listener") or default
            return {**options, "listener": attrs.evolve(listener, reuse_port=True)}
        return options

    @property
    def edge(self) -> HTTPServer:
        if self._edge is None:
            raise RuntimeError("the chain's edge has not started")
        return self._edge

    @property
    def proxy_server(self) -> HTTPServer:
        if not self.proxies:
            raise RuntimeError("the chain's proxy has not started")
        return self.proxies[0][0]

    @property
    def proxy(self) -> Proxy:
        if not self.proxies:
            raise RuntimeError("the chain's proxy has not started")
        return self.proxies[0][1]

    @property
    def worker_server(self) -> HTTPServer:
        if not self.workers:
            raise RuntimeError("the chain has no worker")
        return self.workers[0][0]

    @property
    def worker(self) -> Worker:
        if not self.workers:
            raise RuntimeError("the chain has no worker")
        return self.workers[0][1]

    @property
    def port(self) -> int:
        """The edge's port."""
        return self.edge.port

    @property
    def url(self) -> str:
        """The edge's URL: ``http://HOST:PORT``, or ``https://localhost:PORT`` (what its certificate names)."""
        host = "localhost" if self.cert is not None else self.host
        return f"{self.edge.scheme}://{host}:{self.edge.port}"

    async def start_replica(
        self,
        name: str,
        serve: ServeReplica | None = None,
        *,
        protocol: str = "h2",
        capacity: int = 0,
        max_sessions: int = 0,
    ) -> LocalReplica:
        """Start replica ``name`` on a free port; return it as a worker reaches it.

        ``serve`` (default: :func:`~blocks.testing.serve_demo_replica` of
        ``name``) is called with ``host`` and ``task_status``. ``protocol``,
        ``capacity`` and ``max_sessions`` go to the :class:`LocalReplica`.
        """
        serve = serve or functools.partial(serve_demo_replica, name)
        server: HTTPServer = await self._nursery.start(functools.partial(serve, host=self.host))
        self.replicas[name] = server
        return LocalReplica((self.host, server.port), protocol, capacity=capacity, max_sessions=max_sessions)

    async def start_worker(
        self,
        replicas: Mapping[str, LocalReplica],
        *,
        app: str | None = "demo",
        domains: Iterable[str] = ("*",),
        settings: AppSettings | None = None,
        **options: Any,
    ) -> tuple[HTTPServer, Worker]:
        """Start a worker in front of ``replicas`` (running or not), then route ``app`` to them.

        With ``app`` (None: write no routes), the store gets
        :func:`route_records` of ``app``, ``domains``, ``settings`` and every
        replica, in one transaction. ``options`` go to
        :func:`~blocks.serve_worker` (``upstream``, ``sessions``, ``name``...).
        """
        options = self._shared(await self._observed("worker", options), options.get("port", 0), INTERNAL_LISTENER)
        started: tuple[HTTPServer, Worker] = await self._nursery.start(
            functools.partial(serve_worker, replicas, host=self.host, **options)
        )
        self.workers.append(started)
        if app is not None:
            address = (self.host, started[0].port)
            self.store.transact(route_records(app, replicas, worker=address, domains=domains, settings=settings))
        return started

    async def start_autoscaler(
        self,
        policy: AutoscalePolicy,
        templates: Mapping[str, ReplicaTemplate],
        *,
        worker: Address | None = None,
        **options: Any,
    ) -> Autoscaler:
        """Start an autoscaler (:func:`~blocks.autoscaler.serve_autoscaler`) whose replicas are
        routed in :attr:`store`, behind ``worker`` (default: the chain's first worker, which reaches
        each replica by its route: start it with ``app=None``); return it.

        A template whose program is not there is a ``ValueError``, before anything starts.
        ``options`` go to it (``config``, ``prober``). It stops with the chain, once the chain
        drained, and its replica processes with it. A proxy given
        :class:`~blocks.autoscaler.ColdStartGate` of it holds a request for an app at zero until
        that app's first replica serves.
        """
        for app, template in templates.items():
            program = template.argv(app=app, name=app, port=0)[0]
            if shutil.which(program) is None:
                raise ValueError(f"{app}: command {template.command!r}: no program {program!r}")
        address = worker or (self.host, self.worker_server.port)
        serve = functools.partial(serve_autoscaler, policy, templates, self.store, worker=address, **options)
        scaler: Autoscaler = await self._nursery.start(serve)
        return scaler

    async def start(self, serve: Callable[..., Awaitable[object]], *args: object) -> Any:
        """Start another service in the chain's nursery (``nursery.start``: ``serve`` takes
        ``task_status``); return what it reports. It stops with the chain, after its parts drained."""
        return await self._nursery.start(serve, *args)

    def route(
        self,
        apps: Mapping[str, App],
        *,
        worker: Address | None = None,
        workers: Sequence[Address] = (),
        layer: str = "chain",
    ) -> int:
        """Route ``apps`` whose replicas sit behind ``worker``: the store's ``layer`` (see
        :meth:`EmbeddedStore.load_routes`) becomes their :func:`route_records`, in one revision.

        Several ``workers`` (instead of one ``worker``) each reach every replica: each
        replica is routed once behind each (:func:`behind_workers`), so that
        a dead worker takes out only the routes through it.

        An app without replicas is left out (its domains would lead nowhere);
        an app's ``settings`` (what it mirrors) is written with it.
        Called again, it replaces what it wrote before: apps and domains it
        no longer names are removed. Returns the store's revision.
        """
        workers = [worker, *workers] if worker is not None else list(workers)
        if not workers:
            raise ValueError("route() needs the worker (or workers) the replicas sit behind")
        records: dict[str, bytes] = {}
        for name, app in apps.items():
            if app.replicas:
                for address, replicas in behind_workers(app.replicas, workers):
                    records |= route_records(name, replicas, worker=address, domains=app.domains, settings=app.settings)
        return self.store.load_routes(records, layer=layer)

    def follow_route_file(self, path: Path) -> None:
        """Load a route file (TOML or JSON, docs/sources.md) into the store now, and reload it as it changes.

        Its routes add to those the chain wrote (:meth:`EmbeddedStore.load_file`).
        Raises ``RouteFileError`` if the file cannot be loaded now. :meth:`reload`
        loads it at once (the watch notices a change within two seconds).
        """
        self.store.load_file(path)
        self._nursery.start_soon(self.store.watch_file, path)
        self.on_reload(functools.partial(self.store.load_file, path))

    def on_reload(self, reload: Callable[[], object]) -> None:
        """Call ``reload`` (a plain function, which may raise) on each :meth:`reload`, after those added before it."""
        self._reloads.append(reload)

    async def reload(self) -> None:
        """Load again what the chain loaded from files: route files, the edge's certificate, and
        whatever :meth:`on_reload` added (a recipe's config file). No connection is dropped.

        What :func:`~blocks.run_until_signal` calls on SIGHUP. Each step is all or
        nothing; the first that fails raises its ``OSError`` or ``ValueError``
        (``RouteFileError`` is one), and the steps after it do not run.
        """
        await trio.lowlevel.checkpoint()
        for reload in self._reloads:
            reload()

    async def start_proxy(self, *, source: RouteSource | None = None, **options: Any) -> tuple[HTTPServer, Proxy]:
        """Keep :attr:`cache` equal to ``source`` (default: :attr:`store`), then start the proxy routing from it.

        Returns once the cache holds the source's first snapshot and the
        proxy listens; from then on the cache follows the source's changes
        (:func:`~blocks.reconcile`). ``source`` is any :class:`RouteSource`
        (an :class:`EtcdSource` shared by several proxies, say); a proxy that
        holds requests for a replica (``config=ProxyConfig(cold_start=...)``)
        or has ``sessions`` publishes what waits there in it
        (:meth:`publish_demand`), for an autoscaler to read. ``options``
        go to :func:`~blocks.serve_proxy` (``port``, ``scheduler``,
        ``upstream``, ``policy``, ``sessions``, ``mirror``...).
        """
        if not self.proxies:  # (the proxies of one chain share its cache)
            await self._nursery.start(reconcile, source or self.store, self.cache)
        options = self._shared(await self._observed("proxy", options), options.get("port", 0), INTERNAL_LISTENER)
        if self.operations.processes > 1 and options.get("scheduler") is not None:  # this process's share
            options["scheduler"] = options["scheduler"].split(self.operations.processes, self.operations.process or 0)
        serve = functools.partial(serve_proxy, self.cache, host=self.host, **options)
        started: tuple[HTTPServer, Proxy] = await self._nursery.start(serve)
        self.proxies.append(started)
        proxy, store = started[1], source or self.store
        if (proxy.cold_start is not None or proxy.sessions is not None) and isinstance(
            store, (EmbeddedStore, EtcdSource)
        ):
            await self.publish_demand(store, proxy)
        return started

    async def publish_demand(self, store: EmbeddedStore | EtcdSource, proxy: Proxy) -> None:
        """Publish what waits at ``proxy`` (:meth:`Proxy.demand`) in ``store`` while the chain serves, for
        an autoscaler in another process (:func:`~blocks.sources.demand.serve_demand`).

        :meth:`start_proxy` does it for a proxy that holds requests for a
        replica (``ProxyConfig.cold_start``) or keeps session queues, in the
        store it routes from.
        """
        arrival = proxy.cold_start.wait_arrival if proxy.cold_start is not None else None
        await self._nursery.start(functools.partial(serve_demand, store, proxy.name, proxy.demand, arrival=arrival))

    async def start_edge(
        self,
        *,
        port: int = 0,
        proxy: Address | None = None,
        proxies: Sequence[Address] = (),
        proxies_from: EtcdSource | None = None,
        name: str = "edge",
        tls: bool = False,
        cert_dir: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        **options: Any,
    ) -> HTTPServer:
        """Start the edge on ``port`` (0: a free one), in front of ``proxies`` (or the one ``proxy``;
        default: every proxy this chain started), spreading requests across them.
        With ``proxies_from`` (an etcd), also the proxies registered there
        (:meth:`register_proxy`), followed as they come and go.

        With ``tls``, it serves HTTPS (ALPN ``h2``, ``http/1.1``) with a
        self-signed certificate for ``localhost`` and ``127.0.0.1`` written
        into ``cert_dir`` (default: a new temporary directory, removed with
        its key when the chain's block is left); :attr:`cert` is its path.
        With ``cert`` and ``key`` (PEM files: the certificate chain and its
        private key), it serves HTTPS with them instead, and :meth:`reload`
        loads them again (a renewed certificate; connections open stay on
        the old one). A file that is missing or not a certificate and its key
        is a ``ValueError`` naming it. ``options`` go to
        :func:`~blocks.serve_edge` (``upstream``, ``listener``...).
        """
        context = None
        if cert is not None and key is not None:
            context = _certified(cert, key)
            self.cert = cert
            self.on_reload(functools.partial(_certified, cert, key, context))
        elif tls:
            if cert_dir is None:
                self._scratch = tempfile.TemporaryDirectory(prefix="proxyblocks-")
                cert_dir = Path(self._scratch.name)
            self.cert, key = make_self_signed(cert_dir)
            context = server_context(self.cert, key)
        if proxy is not None:
            proxies = (proxy, *proxies)
        next_hops = None
        if proxies_from is not None:
            found = RouteCache()
            hops = EtcdSource(proxies_from.url, PROXIES_PREFIX, request_timeout=proxies_from.request_timeout)
            await self._nursery.start(reconcile, hops, found)
            next_hops = functools.partial(found.replicas, PROXIES_APP)
        elif not proxies:
            if not self.proxies:
                raise RuntimeError("the chain's proxy has not started")
            proxies = [(self.host, server.port) for server, _ in self.proxies]
        config = EdgeConfig(proxies=proxies, name=name)
        options = self._shared(await self._observed("edge", options), port, ListenerConfig())
        serve = functools.partial(
            serve_edge, config, host=self.host, port=port, ssl_context=context, next_hops=next_hops, **options
        )
        self._edge = await self._nursery.start(serve)
        return self._edge

    async def register(
        self, source: EtcdSource, records: Mapping[str, bytes], *, lasting: Mapping[str, bytes] | None = None
    ) -> None:
        """Keep ``records`` in etcd while the chain serves (:func:`~blocks.sources.register.serve_registration`:
        bound to a lease, renewed, revoked first thing in :meth:`shutdown`); ``lasting`` are written once."""
        scope = trio.CancelScope()
        done = trio.Event()

        async def run(task_status: trio.TaskStatus[None]) -> None:
            try:
                with scope:
                    await serve_registration(source, records, lasting=lasting, task_status=task_status)
            finally:
                done.set()

        await self._nursery.start(run)
        self._registrations.append((scope, done))

    async def register_replicas(
        self, source: EtcdSource, apps: Mapping[str, App], *, worker: Address, name: str | None = None
    ) -> None:
        """Register ``apps``' replicas in etcd as behind ``worker`` (a worker of this chain, ``name``,
        by default the first, at its reachable address), each named ``NAME@<worker's name>``, for as
        long as the chain serves; their domains and settings are written once (:meth:`register`)."""
        name = name or self.worker.name
        records: dict[str, bytes] = {}
        for app, spec in apps.items():
            renamed = {beside_name(replica, name): local for replica, local in spec.replicas.items()}
            records |= route_records(app, renamed, worker=worker, domains=spec.domains, settings=spec.settings)
        lasting = {key: value for key, value in records.items() if "/replicas/" not in key}
        await self.register(source, {k: v for k, v in records.items() if k not in lasting}, lasting=lasting)

    async def register_proxy(self, source: EtcdSource, *, address: Address) -> None:
        """Register this chain's proxy for the edges that follow ``source`` (:meth:`start_edge`'s
        ``proxies_from``): under :data:`~blocks.sources.register.PROXIES_PREFIX`, at ``address``."""
        hops = EtcdSource(source.url, PROXIES_PREFIX, request_timeout=source.request_timeout)
        record = route_key_for_replica(PROXIES_APP, self.proxy.name)
        await self.register(hops, {record: encode_replica(worker=address, address=address)})

    async def start_admin(self, *, port: int = 0, host: str | None = None, top_tenants: int = 10) -> HTTPServer:
        """Start the admin listener (:func:`~blocks.observe.serve_admin`) on ``host:port`` (default: the
        chain's host, a free port) over every part the chain runs, started before or after it.

        Its ``/readyz`` is 200 once a part listens and the proxy's routes are
        loaded (a chain without a proxy needs none), and 503 from the moment
        :meth:`shutdown` starts draining. Per-request counts come from the
        hops given a :class:`~blocks.observe.Metrics` feature
        (``features=[Metrics()]``). It stops with the chain.
        """

        def observed() -> Observed:
            parts: list[tuple[str, HTTPServer, Any]] = []
            if self._edge is not None:
                parts.append(("edge", self._edge, served_hop(self._edge)))
            parts += [(proxy.name, server, proxy) for server, proxy in self.proxies]
            parts += [(worker.name, server, worker) for server, worker in self.workers]
            return Observed(parts=named_parts(parts), routes=self.cache if self.proxies else None)

        serve = functools.partial(serve_admin, observed, host=host or self.host, port=port, top_tenants=top_tenants)
        server: HTTPServer = await self._nursery.start(serve)
        return server

    async def shutdown(self, grace: float = 10.0) -> None:
        """Drain front to back, then stop everything the chain runs.

        The front-most parts started (the edge, else the proxies, else the
        workers) drain first, together: they stop accepting, h2 clients get
        GOAWAY, h1 clients ``connection: close``, and requests in flight get
        up to ``grace`` seconds. The tiers behind them then close one after
        the other, each with a 1-second grace (they are idle by then), and
        the chain's nursery is cancelled.
        """
        await self._unregister()
        tiers = [
            [self._edge] if self._edge is not None else [],
            [server for server, _ in self.proxies],
            [server for server, _ in self.workers],
            list(self.replicas.values()),
        ]
        first = True
        for tier in tiers:
            if tier:
                async with trio.open_nursery() as nursery:
                    for server in tier:
                        nursery.start_soon(server.aclose, grace if first else 1.0)
                first = False
        self.cancel()

    async def _unregister(self) -> None:
        """Revoke this chain's registrations (the hops behind it stop sending new requests here)."""
        for scope, _ in self._registrations:
            scope.cancel()
        for _, done in self._registrations:
            await done.wait()

    def cancel(self) -> None:
        """Stop everything the chain runs at once, without a drain (its nursery is cancelled)."""
        self._nursery.cancel_scope.cancel()


def beside_name(replica: str, worker: str) -> str:
    """The name replica ``replica`` beside worker ``worker`` is registered (and listed) by: ``replica@worker``."""
    return f"{replica}@{worker}"


def behind_workers(
    replicas: Mapping[str, LocalReplica], workers: Sequence[Address]
) -> list[tuple[Address, dict[str, LocalReplica]]]:
    """``replicas`` as routed behind each of ``workers``: one worker keeps their names; with several,
    replica ``NAME`` behind the ``j``-th worker (from 1) is ``NAME@worker-j``, a route of its own."""
    if len(workers) == 1:
        return [(workers[0], dict(replicas))]
    return [
        (worker, {f"{name}@worker-{j}": replica for name, replica in replicas.items()})
        for j, worker in enumerate(workers, 1)
    ]


def _certified(cert: Path, key: Path, context: ssl.SSLContext | None = None) -> ssl.SSLContext:
    """A server context with ``cert`` and ``key``; or, given ``context``, those loaded into it,
    once a fresh context took them (a bad pair leaves ``context`` as it was)."""
    for path in (cert, key):
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
    try:
        fresh = server_context(cert, key)
        if context is not None:
            context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(f"{cert}, {key}: not a PEM certificate chain and its key ({exc.reason or exc})") from None
    return context or fresh


async def _serve_access_log(path: str, task_status: trio.TaskStatus[AccessLog]) -> None:
    async with open_access_log(path) as log:
        task_status.started(log)
        await trio.sleep_forever()


@asynccontextmanager
async def open_chain(
    *, host: str = LOOPBACK, store: EmbeddedStore | None = None, operations: Operations | None = None
) -> AsyncIterator[Chain]:
    """An empty :class:`Chain` on ``host`` whose nursery runs every part it starts.

    ``store`` (default: a new, empty :class:`EmbeddedStore`) holds its
    routes. ``operations`` (:class:`~blocks.command.Operations`): with an
    ``admin_port``, every hop it starts counts its requests
    (:class:`~blocks.observe.Metrics`); with an ``access_log``, the hops it
    names (default: :attr:`Chain.front`, the edge) write one; :func:`serve_chain` opens the admin listener. Leaving the
    block cancels whatever still runs (no drain: call :meth:`Chain.shutdown`
    for that, which also cancels the block's body), and removes the
    temporary self-signed key of a ``tls`` edge.
    """
    async with trio.open_nursery() as nursery:
        chain = Chain(host, store or EmbeddedStore(), RouteCache(), nursery, operations=operations or Operations())
        try:
            yield chain
            nursery.cancel_scope.cancel()
        finally:
            if chain._scratch is not None:
                chain._scratch.cleanup()  # the private key never outlives the chain


async def serve_chain(
    build: BuildChain,
    *,
    host: str = LOOPBACK,
    store: EmbeddedStore | None = None,
    announce: bool = False,
    operations: Operations | None = None,
    task_status: trio.TaskStatus[Chain] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open a chain, let ``build`` start its parts, report the :class:`Chain`, run until it shuts down.

    With ``operations`` (see :func:`open_chain`) that name an ``admin_port``,
    the admin listener (:meth:`Chain.start_admin`) opens once ``build`` has
    returned (:attr:`Chain.admin`).

    With ``announce``, once ``build`` has returned it prints ``edge
    listening on http://HOST:PORT`` (or ``https://``) if it started an
    edge, with a self-signed certificate a line ``certificate: PATH  (curl
    --cacert PATH URL/)``, then the address of every other part it started
    (``proxy listening on h2c://HOST:PORT``,
    ``worker listening on ...``, ``replica NAME listening on ...``): the
    internal hops speak cleartext HTTP/2 with prior knowledge; and last
    ``admin listening on http://HOST:PORT``.
    """
    async with open_chain(host=host, store=store, operations=operations) as chain:
        await build(chain)
        supervised = chain.operations.process is not None  # its parent serves the admin port asked for
        if chain.operations.admin_port is not None:
            chain.admin = await chain.start_admin(
                port=chain.operations.admin_port, host=LOOPBACK if supervised else None
            )
        if announce and chain._edge is not None:
            print(f"edge listening on {chain.edge.scheme}://{host}:{chain.edge.port}", flush=True)
            if chain.cert is not None and chain._scratch is not None:
                print(f"certificate: {chain.cert}  (curl --cacert {chain.cert} {chain.url}/)", flush=True)
        if announce:
            parts = [(proxy.name, server) for server, proxy in chain.proxies]
            parts += [(worker.name, server) for server, worker in chain.workers]
            parts += [(f"replica {name}", server) for name, server in chain.replicas.items()]
            for part, server in parts:
                print(f"{part} listening on h2c://{host}:{server.port}", flush=True)
            if chain.admin is not None and not supervised:
                print(f"admin listening on http://{host}:{chain.admin.port}", flush=True)
            if not supervised:
                print(f"http/2 codec: {codec_in_use()}", flush=True)
        task_status.started(chain)
        await trio.sleep_forever()
