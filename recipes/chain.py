"""The full chain on loopback: edge -> proxy -> worker -> demo replicas, one process.

Run it:

    python -m recipes.chain                 # prints: edge listening on http://127.0.0.1:PORT
    python -m recipes.chain --port 8080 --replicas 3 --replica-protocol h1
    python -m recipes.chain --tls           # also prints the certificate for curl --cacert
    python -m recipes.chain --replica http://127.0.0.1:8000 --replica h2c://127.0.0.1:9000
                                            # your own servers behind the chain, not the demo replicas

Poke it (any authority routes to the demo app, or to your ``--replica`` servers):

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
A second Ctrl-C stops at once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import trio

from blocks import Chain, CommandParser, SchedulerConfig, TenantPolicy, UpstreamConfig, run_until_signal, serve_chain
from blocks.topology import at_least, port_number, replica_from_url, seconds

__all__ = ["FAIR", "Chain", "main"]

FAIR = SchedulerConfig(
    budget=512,
    default_policy=TenantPolicy(max_in_flight=256, max_queued=512, queue_timeout=5.0),
)
"""The chain's fair scheduler: the proxy -> worker pool's 512 stream slots
(8 connections x 64), at most half to one tenant (the ``x-tenant`` header),
up to 512 waiting per tenant for 5 s."""


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
    replica_urls: Sequence[str] = (),
    announce: bool = True,
    task_status: trio.TaskStatus[Chain] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the chain; report a :class:`~blocks.Chain` once the edge takes traffic; run until shut down.

    The proxy routes from a route cache that follows the chain's embedded
    store, holding ``* -> demo -> every replica`` (or, with ``routes_file``,
    that file's routes, reloaded when it changes). With ``replica_urls``
    (``http://`` or ``h2c://host:port``), those servers are the replicas
    instead of ``replicas`` demo ones. With ``announce`` (the default) it
    prints ``edge listening on URL`` then.
    """
    if replicas < 1:
        raise ValueError("--replicas must be at least 1")
    yours = {f"replica-{i}": replica_from_url(url) for i, url in enumerate(replica_urls)}

    async def build(chain: Chain) -> None:
        names = [f"replica-{i}" for i in range(replicas)]
        local = yours or {name: await chain.start_replica(name, protocol=replica_protocol) for name in names}
        upstream = UpstreamConfig(response_timeout=replica_timeout)
        await chain.start_worker(local, app=None if routes_file else "demo", upstream=upstream)
        if routes_file is not None:
            chain.follow_route_file(routes_file)
        # Inner hops wait longer than the worker, so a slow replica surfaces as the worker's 504.
        await chain.start_proxy(scheduler=scheduler, upstream=UpstreamConfig(response_timeout=replica_timeout + 5))
        upstream = UpstreamConfig(response_timeout=replica_timeout + 10)
        await chain.start_edge(port=port, tls=tls, cert_dir=cert_dir, upstream=upstream)

    await serve_chain(build, announce=announce, task_status=task_status)


def run() -> None:
    parser = CommandParser(prog="python -m recipes.chain", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=port_number, default=0, help="edge port (0: any free port)")
    parser.add_argument("--replicas", type=at_least(1), default=2, help="demo replicas behind the worker")
    parser.add_argument("--tls", action="store_true", help="serve HTTPS with a generated self-signed certificate")
    parser.add_argument("--replica-protocol", choices=("h2", "h1"), default="h2", help="worker -> replica protocol")
    parser.add_argument(
        "--replica-timeout", type=seconds, default=30.0, help="seconds before a silent replica is a 504"
    )
    parser.add_argument(
        "--no-scheduler", action="store_true", help="admit proxy -> worker streams without the fair scheduler"
    )
    parser.add_argument("--grace", type=seconds, default=10.0, help="seconds requests in flight get on shutdown")
    parser.add_argument("--routes", type=Path, help="a TOML or JSON route file to load and follow (docs/sources.md)")
    parser.add_argument(
        "--replica", action="append", default=[], metavar="URL", help="your server: http:// or h2c://host:port"
    )
    args = parser.parse_args()
    for url in args.replica:
        try:
            replica_from_url(url)
        except ValueError as exc:
            parser.error(f"--replica {exc}")
    start = functools.partial(
        main,
        port=args.port,
        replicas=args.replicas,
        tls=args.tls,
        replica_protocol=args.replica_protocol,
        replica_timeout=args.replica_timeout,
        scheduler=None if args.no_scheduler else FAIR,
        routes_file=args.routes,
        replica_urls=args.replica,
    )
    run_until_signal(start, grace=args.grace)


if __name__ == "__main__":
    run()
