"""A fleet: proxy processes share their routes through one etcd, and share no fate; hops find each other there.

What it shows: routing state that lives in etcd and in every proxy's
memory at once. Each proxy keeps a RouteCache in sync with etcd in the
background (``open_route_cache``) and routes from memory, never calling
etcd on a request. A route changed with ``routectl`` reaches both proxies
within a moment; a proxy killed with ``kill -9`` takes nothing down with it;
and if etcd itself goes away, both proxies keep routing with the last routes
they had (each says so once on stderr, then retries quietly with backoff),
catching up when it is back. The etcd this starts is started again on the
same port and data dir when it dies, so its routes survive; if it cannot be
(its data dir is gone, or three starts fail), one line says
``proxyblocks: etcd at URL is gone (...)`` and the proxies go on without it.

No single point of failure: each worker registers the replicas beside it
in etcd, with its own address, and each proxy registers itself; the edge
(in this process) finds the proxies there, spreads requests over them and
sends a request that reached no proxy to another; a proxy sends one whose
worker is gone to a replica behind another (docs/deploy.md).

Run it (it starts etcd on loopback from Debian's ``etcd-server``, the
workers, each with two demo replicas, and the edge in this process, and
two proxy processes):

    python -m recipes.fleet
    python -m recipes.fleet --workers 2 --proxies 3
    python -m recipes.fleet --etcd http://127.0.0.1:2379      # use an etcd you run

It prints the etcd URL, its own PID (FLEET_PID), the edge's URL, and each proxy's URL and PID. Poke it:

    curl -H 'host: demo.example' http://127.0.0.1:EDGE/          # through the edge, either proxy
    curl -H 'host: demo.example' http://127.0.0.1:PORT_A/        # hello from replica-N@worker-1
    curl -H 'host: new.example' http://127.0.0.1:PORT_B/         # 503: no route for it yet
    python -m blocks.routectl --etcd ETCD_URL put-domain new.example demo
    curl -H 'host: new.example' http://127.0.0.1:PORT_A/         # now 200, on both proxies
    python -m blocks.routectl --etcd ETCD_URL list
    kill -9 PID_A; curl -H 'host: demo.example' http://127.0.0.1:EDGE/     # the edge goes to B
    kill -9 $(pgrep -P FLEET_PID -x etcd)      # "etcd at ... exited (killed by SIGKILL)", then "is back"

With ``--processes N``, each proxy is N processes sharing its port (SO_REUSEPORT), under a
supervising parent (docs/scale.md); each follows etcd on its own and prints its own ``proxy a
listening on ... pid PID`` line, so ``kill -9 PID_A`` kills one of proxy a's processes, not the
proxy: its parent says so on stderr (``proxyblocks: process 0 (pid PID_A) was killed by SIGKILL;
starting it again in 0.1s``) and starts it again (``[a] process 0 serving again: pid NEW``), and
a's other processes serve its port meanwhile.

Ctrl-C (or SIGTERM) stops the proxies (each drains), then the rest; a second
Ctrl-C stops at once. ``--proxy NAME`` is how this script starts each proxy
process; it is not meant to be run by hand (though it can be, pointed at any
etcd holding routes).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import NamedTuple

import attrs
import trio

from blocks import Chain, CommandParser, EtcdSource, ProxyConfig, run_until_signal, serve_chain
from blocks.command import Operations, at_least, between, port_number, seconds
from blocks.observe import configure_logging
from blocks.testing import run_child_process, serve_etcd
from blocks.topology import App

ProxyProcess = NamedTuple("ProxyProcess", [("name", str), ("url", str), ("process", trio.Process)])  # noqa: UP014


@attrs.define(eq=False)
class Fleet:
    """What ``main`` reports: etcd, the proxies (``proxy.process.kill()``: a crash), and the rest's chain."""

    etcd: str
    proxies: list[ProxyProcess]
    chain: Chain

    async def shutdown(self, grace: float = 5.0) -> None:
        """Drain the edge, then the proxies (SIGTERM), then stop the workers, the replicas and etcd."""
        await self.chain.edge.aclose(grace)
        for proxy in self.proxies:
            proxy.process.terminate()  # (nothing, if it has exited)
        with trio.move_on_after(grace + 2):
            for proxy in self.proxies:
                await proxy.process.wait()
        await self.chain.shutdown(1.0)


async def serve_fleet_proxy(
    etcd: str, name: str, port: int, tick: float | None, ops: Operations, *, task_status: trio.TaskStatus[Chain]
) -> None:
    """One proxy of the fleet (what ``--proxy NAME`` runs): routes from a cache that follows etcd."""

    async def build(chain: Chain) -> None:  # (etcd's progress notices every tick s; by default, etcd's 600)
        source = EtcdSource(etcd, progress_interval=tick or 600.0)
        server, _ = await chain.start_proxy(source=source, port=port, config=ProxyConfig(name=f"proxy-{name}"))
        await chain.register_proxy(source, address=(chain.host, server.port))  # the edges find it there
        print(f"proxy {name} listening on {server.scheme}://{chain.host}:{server.port} pid {os.getpid()}", flush=True)

    await serve_chain(build, operations=ops, task_status=task_status)


async def main(
    *,
    etcd: str | None = None,
    proxies: int = 2,
    workers: int = 1,
    replicas: int = 2,
    progress_interval: float | None = None,
    operations: Operations | None = None,
    announce: bool = True,
    task_status: trio.TaskStatus[Fleet] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start etcd (unless given), workers and replicas, their routes, the proxies, an edge; report a Fleet."""
    started: list[ProxyProcess] = []
    interval = progress_interval or (600.0 if etcd else 1.0)  # s: an idle watch silent for 3 is reopened

    async def build(chain: Chain) -> None:
        nonlocal etcd
        etcd = etcd or await chain.start(partial(serve_etcd, progress_interval=interval))
        for name in [f"worker-{j}" for j in range(1, workers + 1)]:  # each registers the replicas beside it
            local = {f"replica-{i}": await chain.start_replica(f"replica-{i}@{name}") for i in range(replicas)}
            worker, _ = await chain.start_worker(local, app=None, name=name)
            demo, at = {"demo": App(("demo.example",), local)}, (chain.host, worker.port)
            await chain.register_replicas(EtcdSource(etcd), demo, worker=at, name=name)
        for name in "abcdefghijklmnopqrstuvwxyz"[:proxies]:
            command = [sys.executable, "-m", "recipes.fleet", "--proxy", name, "--etcd", etcd]
            command += ["--progress-interval", str(interval), *(operations or Operations()).process_flags()]
            process, line = await chain.start(run_child_process, command, f"proxy {name} listening on ", name)
            started.append(ProxyProcess(name, line.split()[4], process))
        await chain.start_edge(proxies_from=EtcdSource(etcd))  # the proxies registered there, as they come and go

    async with trio.open_nursery() as nursery:
        chain: Chain = await nursery.start(partial(serve_chain, build, operations=operations))
        assert etcd is not None
        if announce:
            print(f"etcd at {etcd} (python -m blocks.routectl --etcd {etcd} list), fleet pid {os.getpid()}", flush=True)
            print(f"try: curl -H 'host: demo.example' {chain.url}/   (the edge, in front of the proxies)", flush=True)
        task_status.started(Fleet(etcd, started, chain))


def run() -> None:
    parser = CommandParser(prog="python -m recipes.fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", metavar="URL", help="use this etcd instead of starting one")
    parser.add_argument("--progress-interval", type=between(0.1), help="etcd progress notices, every S (1; etcd: 600)")
    parser.add_argument("--proxies", type=at_least(1, most=26), default=2, help="proxy processes")
    parser.add_argument("--workers", type=at_least(1), default=1, help="workers, each beside its own replicas")
    parser.add_argument("--replicas", type=at_least(1), default=2, help="demo replicas behind each worker")
    parser.add_argument("--grace", type=seconds, default=5.0, help="seconds requests in flight get on shutdown")
    parser.add_argument("--proxy", metavar="NAME", help=argparse.SUPPRESS)  # (be one proxy, as main starts each)
    parser.add_argument("--port", type=port_number, default=0, help=argparse.SUPPRESS)
    parser.add_processes_flag()  # (per proxy: each is a supervising parent of N processes)
    args = parser.parse_args()
    if args.proxy is not None and args.etcd is None:
        parser.error("--proxy needs --etcd URL")
    start = partial(main, etcd=args.etcd, proxies=args.proxies, workers=args.workers, replicas=args.replicas)
    start = partial(start, progress_interval=args.progress_interval, operations=args.operations)
    if args.proxy is not None:  # one proxy, as main starts each
        configure_logging(args.log_level, prefix=f"proxy {args.proxy}: ")  # (its route source's lost and back)
        start = partial(serve_fleet_proxy, args.etcd, args.proxy, args.port, args.progress_interval, args.operations)
    proxy = args.operations if args.proxy is not None else None  # (--processes: N per proxy, not N fleets)
    run_until_signal(start, grace=args.grace, operations=proxy, listen=("127.0.0.1", args.port))


if __name__ == "__main__":
    run()
