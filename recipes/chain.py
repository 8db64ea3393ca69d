"""The full chain on loopback: edge -> proxy -> worker -> demo replicas, one process.

Run it:

    python -m recipes.chain                 # prints: edge listening on http://127.0.0.1:PORT
    python -m recipes.chain --port 8080 --replicas 3 --replica-protocol h1
    python -m recipes.chain --tls           # also prints the certificate for curl --cacert

Poke it (any authority routes to the demo app):

    curl -i http://127.0.0.1:PORT/                         # x-replica, server-timing
    curl -i --http2-prior-knowledge http://127.0.0.1:PORT/
    curl -N 'http://127.0.0.1:PORT/stream?n=5&ms=300'      # a token stream
    curl --http2-prior-knowledge -T big.file http://127.0.0.1:PORT/echo
    curl --cacert CERT https://localhost:PORT/              # with --tls: h2 over ALPN
    curl -H 'x-tenant: alice' http://127.0.0.1:PORT/       # the fair scheduler's tenant

Routes live in an embedded, revisioned store that the proxy's route cache
follows (no outside service). With ``--routes FILE`` (TOML or JSON, see
docs/sources.md) the store also loads that file and follows its changes:
edit it while the chain runs and the proxy routes by the new version.

Ctrl-C (or SIGTERM) drains: the edge stops accepting, h2 clients get GOAWAY,
requests in flight finish within --grace seconds, and the process exits 0.
"""

from __future__ import annotations

import argparse
import functools
import signal
import tempfile
from pathlib import Path

import attrs
import trio

from blocks import (
    EdgeConfig,
    EmbeddedStore,
    HTTPServer,
    LocalReplica,
    Proxy,
    RouteCache,
    SchedulerConfig,
    TenantPolicy,
    UpstreamConfig,
    Worker,
    encode_domain,
    encode_replica,
    make_self_signed,
    reconcile,
    route_key_for_domain,
    route_key_for_replica,
    serve_demo_replica,
    serve_edge,
    serve_proxy,
    serve_worker,
    server_context,
)

HOST = "127.0.0.1"

FAIR = SchedulerConfig(
    budget=512,
    default_policy=TenantPolicy(max_in_flight=256, max_queued=512, queue_timeout=5.0),
)
"""The chain's fair scheduler: the proxy -> worker pool's 512 stream slots
(8 connections x 64), at most half to one tenant (the ``x-tenant`` header),
up to 512 waiting per tenant for 5 s."""


@attrs.define(eq=False)
class Chain:
    """A running chain, as ``main`` reports it to ``task_status``."""

    edge: HTTPServer
    proxy_server: HTTPServer
    proxy: Proxy
    worker_server: HTTPServer
    worker: Worker
    replicas: list[HTTPServer]
    cert: Path | None
    store: EmbeddedStore
    routes: RouteCache
    _cancel: trio.CancelScope

    @property
    def url(self) -> str:
        host = "localhost" if self.cert is not None else HOST
        return f"{self.edge.scheme}://{host}:{self.edge.port}"

    async def shutdown(self, grace: float = 10.0) -> None:
        """Drain front to back, then stop everything."""
        await self.edge.aclose(grace)
        for server in (self.proxy_server, self.worker_server, *self.replicas):
            await server.aclose(1.0)
        self._cancel.cancel()


async def main(
    *,
    port: int = 0,
    replicas: int = 2,
    tls: bool = False,
    replica_protocol: str = "h2",
    replica_timeout: float = 30.0,
    cert_dir: Path | None = None,
    scheduler: SchedulerConfig | None = FAIR,
    routes_file: Path | None = None,
    announce: bool = True,
    task_status: trio.TaskStatus[Chain] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the chain; report a :class:`Chain` once the edge takes traffic; run until shut down.

    The proxy routes from a :class:`RouteCache` that follows an
    :class:`EmbeddedStore` holding ``* -> demo -> every replica`` (and, with
    ``routes_file``, that file's routes, reloaded when it changes). With
    ``announce`` (the default) it prints ``edge listening on URL`` then.
    """
    if replicas < 1:
        raise ValueError("--replicas must be at least 1")
    async with trio.open_nursery() as nursery:
        servers = []
        local: dict[str, LocalReplica] = {}
        for i in range(replicas):
            name = f"replica-{i}"
            server = await nursery.start(serve_demo_replica, name)
            servers.append(server)
            local[name] = LocalReplica((HOST, server.port), replica_protocol)
        worker_server, worker = await nursery.start(
            functools.partial(serve_worker, local, upstream=UpstreamConfig(response_timeout=replica_timeout))
        )
        worker_address = (HOST, worker_server.port)
        store = EmbeddedStore()
        if routes_file is not None:
            store.load_file(routes_file)
            nursery.start_soon(store.watch_file, routes_file)
        else:
            store.transact(
                {
                    route_key_for_domain("*"): encode_domain("demo"),
                    **{
                        route_key_for_replica("demo", n): encode_replica(
                            worker=worker_address, address=r.address, protocol=r.protocol
                        )
                        for n, r in local.items()
                    },
                }
            )
        routes = RouteCache()
        await nursery.start(reconcile, store, routes)
        # Inner hops wait longer than the worker, so a slow replica surfaces as the worker's 504.
        inner = UpstreamConfig(response_timeout=replica_timeout + 5)
        proxy_server, proxy = await nursery.start(
            functools.partial(serve_proxy, routes, upstream=inner, scheduler=scheduler)
        )
        cert = None
        context = None
        if tls:
            cert, key = make_self_signed(cert_dir or Path(tempfile.mkdtemp(prefix="proxyblocks-")))
            context = server_context(cert, key)
        edge = await nursery.start(
            functools.partial(
                serve_edge,
                EdgeConfig(proxy=(HOST, proxy_server.port)),
                port=port,
                ssl_context=context,
                upstream=UpstreamConfig(response_timeout=replica_timeout + 10),
            )
        )
        chain = Chain(
            edge, proxy_server, proxy, worker_server, worker, servers, cert, store, routes, nursery.cancel_scope
        )
        if announce:
            print(f"edge listening on {edge.scheme}://{HOST}:{edge.port}", flush=True)
            if cert is not None:
                print(f"certificate: {cert}  (curl --cacert {cert} {chain.url}/)", flush=True)
        task_status.started(chain)


async def _run(args: argparse.Namespace) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            chain: Chain = await nursery.start(
                functools.partial(
                    main,
                    port=args.port,
                    replicas=args.replicas,
                    tls=args.tls,
                    replica_protocol=args.replica_protocol,
                    replica_timeout=args.replica_timeout,
                    scheduler=None if args.no_scheduler else FAIR,
                    routes_file=args.routes,
                )
            )
            async for _ in signals:
                break
            print("draining...", flush=True)
            await chain.shutdown(args.grace)
    print("stopped", flush=True)


def run() -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.chain", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="edge port (0: any free port)")
    parser.add_argument("--replicas", type=int, default=2, help="demo replicas behind the worker")
    parser.add_argument("--tls", action="store_true", help="serve HTTPS with a generated self-signed certificate")
    parser.add_argument("--replica-protocol", choices=("h2", "h1"), default="h2", help="worker -> replica protocol")
    parser.add_argument("--replica-timeout", type=float, default=30.0, help="seconds before a silent replica is a 504")
    parser.add_argument(
        "--no-scheduler", action="store_true", help="admit proxy -> worker streams without the fair scheduler"
    )
    parser.add_argument("--grace", type=float, default=10.0, help="seconds requests in flight get on shutdown")
    parser.add_argument("--routes", type=Path, help="a TOML or JSON route file to load and follow (docs/sources.md)")
    trio.run(_run, parser.parse_args())


if __name__ == "__main__":
    run()
