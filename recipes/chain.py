"""The full chain: edge -> proxy -> worker -> replicas, in one process on loopback, or one role of it.

Run it:

    python -m recipes.chain                 # prints: edge listening on http://127.0.0.1:PORT
    python -m recipes.chain --port 8080 --replicas 3 --replica-protocol h1
    python -m recipes.chain --tls           # also prints the certificate for curl --cacert
    python -m recipes.chain --cert cert.pem --key key.pem      # HTTPS with your certificate
    python -m recipes.chain --replica http://127.0.0.1:8000 --replica h2c://127.0.0.1:9000
                                            # your own servers behind the chain, not the demo replicas
    python -m recipes.chain --replica https://app.internal:8443 --replica-ca ca.pem   # TLS to them
    python -m recipes.chain --config chain.toml                # settings from a file (flags override it):
                                            # also apps, auth keys, sessions, mirroring (docs/recipes.md)

One role per process, so the hops can live on different machines
(``--host 0.0.0.0`` listens on every interface):

    python -m recipes.chain --role worker --port 9001
    python -m recipes.chain --role proxy --port 9000 --next-hop h2c://WORKER:9001 --replica http://APP:8000
    python -m recipes.chain --role edge --port 8080 --next-hop h2c://PROXY:9000

With ``--route-source ETCD`` a proxy holds a request for an app that has no
live replica (an autoscaler elsewhere scaled it to zero) until one is
routed, and publishes what waits there in etcd for that autoscaler; a
``[cold_start]`` table in the config file tunes it (``timeout``,
``max_waiting``, ``retry_after``, ``apps``) or turns it off (``enabled =
false``): docs/autoscaler.md.

Poke it (any authority routes to the demo app, or to your ``--replica`` servers):

    curl -i http://127.0.0.1:PORT/                         # x-replica, server-timing
    curl -i --http2-prior-knowledge http://127.0.0.1:PORT/
    curl -N 'http://127.0.0.1:PORT/stream?n=5&ms=300'      # a token stream
    curl --http2-prior-knowledge -T big.file http://127.0.0.1:PORT/echo
    curl --cacert CERT https://localhost:PORT/              # with --tls: h2 over ALPN
    curl -H 'x-tenant: alice' http://127.0.0.1:PORT/       # the fair scheduler's tenant

Routes live in an embedded, revisioned store that the proxy's route cache
follows (no outside service), or in etcd (``--route-source``). With
``--routes FILE`` (TOML or JSON, see docs/sources.md) the store also loads
that file, adding to the recipe's routes, and follows its changes: edit it
while the chain runs and the proxy routes by the new version.

Ctrl-C (or SIGTERM) drains: the edge stops accepting, h2 clients get GOAWAY,
requests in flight finish within --grace seconds, and the process exits 0.
A second Ctrl-C stops at once. SIGHUP reloads the config file's replicas and
apps, the route file and the certificate, dropping no connection.

``--processes N`` runs N processes on the port (any role, or the whole chain:
each process then runs every hop), sharing it with SO_REUSEPORT under a
supervising parent that restarts one that dies and drains them all
(docs/scale.md):

    python -m recipes.chain --processes 2 --admin-port 9900   # prints: processes: PID PID (...)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from blocks import Chain, SchedulerConfig, TenantPolicy, serve_chain
from blocks.command import CommandParser, Operations, at_least, run_until_signal, seconds
from blocks.routing import Address
from blocks.topology import LOOPBACK, App, ChainPlan, hop_from_url, hop_options, proxy_sections, replica_url

__all__ = ["FAIR", "Chain", "main"]

FAIR = SchedulerConfig(
    budget=512,
    default_policy=TenantPolicy(max_in_flight=256, max_queued=512, queue_timeout=5.0),
)
"""The fair scheduler: 512 proxy -> worker slots, half at most to one ``x-tenant``, 512 waiting 5 s."""


async def main(
    *,
    role: str = "chain",
    host: str = LOOPBACK,
    port: int = 0,
    replicas: int = 2,
    tls: bool = False,
    cert: Path | None = None,
    key: Path | None = None,
    replica_protocol: str = "h2",
    replica_timeout: float = 30.0,
    cert_dir: Path | None = None,
    replica_ca: Path | None = None,
    scheduler: SchedulerConfig | None = FAIR,
    routes_file: Path | None = None,
    replica_urls: Sequence[str] = (),
    apps: Mapping[str, App] | None = None,
    next_hops: Sequence[Address] = (),
    proxies: int = 1,
    workers: int = 1,
    name: str | None = None,
    advertise: Address | None = None,
    route_source: str | None = None,
    reread: Callable[[], object] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    operations: Operations | None = None,
    announce: bool = True,
    task_status: trio.TaskStatus[Chain] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the chain, or one ``role`` of it (see the flags); report a :class:`~blocks.Chain` once it serves.
    The settings are a :class:`~blocks.topology.ChainPlan`'s (a wrong mix of them: ``ValueError``)."""
    plan = ChainPlan(
        role=role,
        host=host,
        port=port,
        replicas=replicas,
        replica_protocol=replica_protocol,
        replica_timeout=replica_timeout,
        replica_ca=replica_ca,
        replica_urls=replica_urls,
        apps=apps,
        tls=tls,
        cert=cert,
        key=key,
        cert_dir=cert_dir,
        scheduler=scheduler,
        routes_file=routes_file,
        next_hops=next_hops,
        proxies=proxies,
        workers=workers,
        name=name,
        advertise=advertise,
        route_source=route_source,
        options=options,
        reread=reread,
    )
    await serve_chain(plan.build, host=host, announce=announce, operations=operations, task_status=task_status)


def run() -> None:
    sections = proxy_sections(FAIR)
    parser = CommandParser(prog="python -m recipes.chain", description=__doc__.splitlines()[0], sections=sections)
    parser.add_serving_flags()
    flag = parser.add_argument
    flag("--role", choices=("chain", "edge", "proxy", "worker"), default="chain", help="every hop, or this one")
    hop = "the edge's proxies, the proxy's workers (h2c://host:port, repeatable)"
    flag("--next-hop", dest="next_hops", action="append", type=hop_from_url, default=[], metavar="URL", help=hop)
    flag("--proxies", type=at_least(1), default=1, help="proxies in the chain, the edge spreading over them")
    flag("--workers", type=at_least(1), default=1, help="workers in the chain, each with its own demo replicas")
    flag("--name", help="this hop's name, in server-timing, errors and logs (default: its role)")
    where = "the host:port other hops reach this one at, as registered in --route-source (default: --host, --port)"
    flag("--advertise", type=hop_from_url, metavar="HOST:PORT", help=where)
    fleet = "the fleet's etcd (http://host:2379): the proxy's routes; workers and proxies register there"
    flag("--route-source", metavar="URL", help=fleet)
    flag("--replicas", type=at_least(1), default=2, help="demo replicas behind each worker")
    flag("--replica-protocol", choices=("h2", "h1"), default="h2", help="worker -> demo replica protocol")
    flag("--replica-timeout", type=seconds, default=30.0, help="seconds before a silent replica is a 504")
    flag("--no-scheduler", action="store_true", help="admit proxy -> worker streams without the fair scheduler")
    flag("--routes", dest="routes_file", type=Path, help="a TOML or JSON route file to add and follow")
    yours = "your server: http://, h2c:// or https://host:port (repeatable)"
    flag("--replica", dest="replica_urls", action="append", type=replica_url, default=[], metavar="URL", help=yours)
    flag("--replica-ca", type=Path, metavar="FILE", help="trust https replicas signed by these CAs (PEM) only")
    settings = vars(parser.parse_args())
    settings["options"] = hop_options(settings, error=parser.error)
    tables = ("auth", "sessions", "mirror", "cold_start", "log_level")
    grace, config, *_ = (settings.pop(name) for name in ("grace", "config", *tables))
    settings["scheduler"] = None if settings.pop("no_scheduler") else settings["scheduler"] or FAIR
    start = functools.partial(main, reread=parser.reparse if config else None, **settings)
    run_until_signal(start, grace=grace, operations=settings["operations"], listen=(settings["host"], settings["port"]))


if __name__ == "__main__":
    run()
