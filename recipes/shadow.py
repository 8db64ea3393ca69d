"""Shadow traffic: the chain mirrors a primary app to a candidate build and compares the answers.

What it shows: edge -> proxy -> worker -> the "shop" app (v1), with the
proxy copying every request of "shop" to "shop-candidate" (v2, on its own
worker) through the mirror tee. The copies are marked
(``x-proxyblocks-mirror: 1``, host ``<host>-shadow``), their answers are
read and discarded, and the proxy compares each pair: v2 rounds some prices
differently (``/price``), is slower on ``/search``, and is the same
elsewhere. The per-app mirror setting lives in the route store, beside the
replicas (``apps/shop/settings``), so it can be changed while the chain runs.

Run it:

    python -m recipes.shadow                  # sends 300 requests, prints the comparison, exits
    python -m recipes.shadow --serve          # then keeps running: poke it, Ctrl-C prints it again
    python -m recipes.shadow --fraction 0.1   # copy 10 %

Poke it (with --serve; it prints the edge's URL):

    curl -i 'http://127.0.0.1:PORT/price?item=7'    # the primary's answer; the candidate's is compared
    curl -i 'http://127.0.0.1:PORT/search?q=shoes'
"""

from __future__ import annotations

import argparse
import functools
import signal
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

import attrs
import trio

from blocks import (
    AppSettings,
    EdgeConfig,
    EmbeddedStore,
    HTTPServer,
    ListenerConfig,
    LocalReplica,
    MirrorConfig,
    MirrorPair,
    MirrorSetting,
    MirrorStatistics,
    Proxy,
    Request,
    Response,
    RouteCache,
    encode_domain,
    encode_replica,
    encode_settings,
    open_upstreams,
    reconcile,
    route_key_for_domain,
    route_key_for_replica,
    route_key_for_settings,
    serve_edge,
    serve_http,
    serve_proxy,
    serve_worker,
    text_response,
)

HOST = "127.0.0.1"
PATHS = ["/", "/price?item={i}", "/search?q=item{i}", "/price?item={i}", "/about"]


def shop(version: int) -> Callable[[Request], Awaitable[Response]]:
    """The shop app. v2 rounds a price of .xx5 down where v1 rounds it up, and searches more slowly."""

    async def handler(request: Request) -> Response:
        path, _, query = request.path.partition(b"?")
        args = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
        if path == b"/price":
            item = int(args.get("item", "0") or 0)
            cents = item * 1105  # tenths of a cent: 11.05 per unit
            price = (cents + 5) // 10 if version == 1 or item % 4 != 1 else cents // 10
            return text_response(200, f"item {item}: {price // 100}.{price % 100:02d}\n")
        if path == b"/search":
            await trio.sleep(0.02 if version == 2 else 0.002)
            return text_response(200, f"results for {args.get('q', '')!s}\n")
        if path == b"/about":
            return text_response(200, "the shop\n")
        if path == b"/":
            return text_response(200, "welcome\n")
        return text_response(404, "not found\n")

    return handler


@attrs.define(eq=False)
class Shadow:
    """The running topology, as ``main`` reports it."""

    edge: HTTPServer
    proxy_server: HTTPServer
    proxy: Proxy
    store: EmbeddedStore
    servers: list[HTTPServer]
    mismatches: list[MirrorPair]
    _cancel: trio.CancelScope

    def statistics(self) -> MirrorStatistics:
        assert self.proxy.mirror is not None
        return self.proxy.mirror.statistics()

    async def shutdown(self, grace: float = 5.0) -> None:
        await self.edge.aclose(grace)
        for server in (self.proxy_server, *self.servers):
            await server.aclose(1.0)
        self._cancel.cancel()


def report(stats: MirrorStatistics, mismatches: list[MirrorPair]) -> str:
    """The comparison report: per route, pairs, matches, mismatches and the latency ratio."""
    lines = [f"{'route':<22} {'pairs':>6} {'match':>6} {'mismatch':>9} {'latency shadow/primary':>23}"]
    for route, c in sorted(stats.routes.items()):
        lines.append(f"{route:<22} {c.pairs:>6} {c.matches:>6} {c.mismatches:>9} {c.latency_ratio:>22.2f}x")
    lines.append(
        f"copied {stats.sampled}, compared {stats.compared}; abandoned {stats.abandoned}, aborted {stats.aborted}, "
        f"failed {stats.failed}, timed out {stats.timed_out}, skipped {stats.skipped}"
    )
    for pair in mismatches[:3]:
        lines.append(
            f"  mismatch {pair.path.decode()}: {', '.join(pair.differences)}: "
            f"{pair.primary.sample!r} vs {pair.shadow.sample!r}"
        )
    return "\n".join(lines)


async def send_traffic(port: int, requests: int) -> None:
    """``requests`` GETs through the edge, cycling over the shop's paths, eight at a time."""
    async with open_upstreams() as client:
        paths = [PATHS[i % len(PATHS)].format(i=i).encode() for i in range(requests)]

        async def worker(mine: list[bytes]) -> None:
            for path in mine:
                response = await client.request((HOST, port), Request(b"GET", b"http", b"shop.example", path), [])
                await response.body.read_all()

        async with trio.open_nursery() as nursery:
            for k in range(8):
                nursery.start_soon(worker, paths[k::8])


async def main(
    *,
    port: int = 0,
    fraction: float = 1.0,
    announce: bool = True,
    task_status: trio.TaskStatus[Shadow] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the topology; report a :class:`Shadow` once the edge takes traffic; run until shut down."""
    async with trio.open_nursery() as nursery:
        servers = []
        store = EmbeddedStore()
        routes: dict[str, bytes] = {route_key_for_domain("*"): encode_domain("shop")}
        for app, version in (("shop", 1), ("shop-candidate", 2)):
            replica = await nursery.start(functools.partial(serve_http, shop(version), config=ListenerConfig()))
            name = f"{app}-0"
            worker_server, _ = await nursery.start(serve_worker, {name: LocalReplica((HOST, replica.port))})
            servers += [worker_server, replica]
            routes[route_key_for_replica(app, name)] = encode_replica(
                worker=(HOST, worker_server.port), address=(HOST, replica.port)
            )
        mirror = MirrorSetting(to="shop-candidate", fraction=fraction, prefixes=["/price", "/search", "/"])
        routes[route_key_for_settings("shop")] = encode_settings(AppSettings(mirror=mirror))
        store.load_routes(routes)
        cache = RouteCache()
        await nursery.start(reconcile, store, cache)
        mismatches: list[MirrorPair] = []
        config = MirrorConfig(on_mismatch=mismatches.append, report_limit=5, report_interval=60.0)
        proxy_server, proxy = await nursery.start(functools.partial(serve_proxy, cache, mirror=config))
        edge = await nursery.start(
            functools.partial(serve_edge, EdgeConfig(proxy=(HOST, proxy_server.port)), port=port)
        )
        if announce:
            print(f"edge listening on http://{HOST}:{edge.port}", flush=True)
        task_status.started(Shadow(edge, proxy_server, proxy, store, servers, mismatches, nursery.cancel_scope))


async def _run(args: argparse.Namespace) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            shadow: Shadow = await nursery.start(functools.partial(main, port=args.port, fraction=args.fraction))
            await send_traffic(shadow.edge.port, args.requests)
            for _ in range(500):  # up to 5 s for the last shadows to finish
                if not shadow.statistics().in_flight:
                    break
                await trio.sleep(0.01)
            print(report(shadow.statistics(), shadow.mismatches), flush=True)
            if args.serve:
                async for _ in signals:
                    break
                print(report(shadow.statistics(), shadow.mismatches), flush=True)
            await shadow.shutdown()


def run() -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.shadow", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="edge port (0: any free port)")
    parser.add_argument("--requests", type=int, default=300, help="requests to send before the report")
    parser.add_argument("--fraction", type=float, default=1.0, help="share of the shop's requests to copy")
    parser.add_argument("--serve", action="store_true", help="keep running after the report, until Ctrl-C")
    trio.run(_run, parser.parse_args())


if __name__ == "__main__":
    run()
