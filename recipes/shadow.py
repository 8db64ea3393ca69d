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

import functools

import attrs
import trio

from blocks import Chain, CommandParser, MirrorConfig, run_until_signal, serve_chain, serve_http
from blocks.command import Operations, at_least, between, port_number
from blocks.mirror import MirrorPair, MirrorStatistics
from blocks.routing import AppSettings, MirrorSetting
from blocks.testing import send_shop_traffic, shop_app


@attrs.define(eq=False)
class Shadow:
    """The running topology, as ``main`` reports it: the chain and the mismatching pairs it kept."""

    chain: Chain
    mismatches: list[MirrorPair]

    def statistics(self) -> MirrorStatistics:
        assert self.chain.proxy.mirror is not None
        return self.chain.proxy.mirror.statistics()

    async def shutdown(self, grace: float = 5.0) -> None:
        """Print the comparison report, then drain the chain."""
        print(report(self.statistics(), self.mismatches), flush=True)
        await self.chain.shutdown(grace)


def report(stats: MirrorStatistics, mismatches: list[MirrorPair]) -> str:
    """The comparison report: per route, pairs, matches, mismatches and the latency ratio."""
    lines = [f"{'route':<22} {'pairs':>6} {'match':>6} {'mismatch':>9} {'latency shadow/primary':>23}"]
    for route, c in sorted(stats.routes.items()):
        lines.append(f"{route:<22} {c.pairs:>6} {c.matches:>6} {c.mismatches:>9} {c.latency_ratio:>22.2f}x")
    lines.append(
        f"copied {stats.sampled}, compared {stats.compared}; abandoned {stats.abandoned}, aborted {stats.aborted}, "
        f"failed {stats.failed}, timed out {stats.timed_out}, skipped {stats.skipped}"
    )
    for p in mismatches[:3]:
        lines.append(
            f"  mismatch {p.path.decode()}: {', '.join(p.differences)}: {p.primary.sample!r} vs {p.shadow.sample!r}"
        )
    return "\n".join(lines)


async def main(
    *,
    port: int = 0,
    fraction: float = 1.0,
    requests: int = 0,
    serve: bool = True,
    operations: Operations | None = None,
    announce: bool = True,
    task_status: trio.TaskStatus[Shadow] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start; send ``requests``, print the report; report a :class:`Shadow`; serve (or, not ``serve``, stop)."""
    mismatches: list[MirrorPair] = []
    mirror = MirrorSetting(to="shop-candidate", fraction=fraction, prefixes=["/price", "/search", "/"])

    async def build(chain: Chain) -> None:
        for app, version in (("shop", 1), ("shop-candidate", 2)):
            serve = functools.partial(serve_http, shop_app(version))
            local = {f"{app}-0": await chain.start_replica(f"{app}-0", serve)}
            settings = AppSettings(mirror=mirror) if app == "shop" else None  # in the store, beside the replicas
            await chain.start_worker(local, app=app, domains=["*"] if settings else [], settings=settings)
        config = MirrorConfig(on_mismatch=mismatches.append, report_limit=5, report_interval=60.0)
        await chain.start_proxy(mirror=config)
        await chain.start_edge(port=port)

    async with trio.open_nursery() as nursery:
        shadow = Shadow(
            await nursery.start(functools.partial(serve_chain, build, announce=announce, operations=operations)),
            mismatches,
        )
        if requests:
            await send_shop_traffic((shadow.chain.host, shadow.chain.port), requests)
            for _ in range(500):  # up to 5 s for the last shadows to finish
                if not shadow.statistics().in_flight:
                    break
                await trio.sleep(0.01)
            print(report(shadow.statistics(), shadow.mismatches), flush=True)
        task_status.started(shadow)
        if not serve:
            await shadow.chain.shutdown(5.0)


def run() -> None:
    parser = CommandParser(prog="python -m recipes.shadow", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=port_number, default=0, help="edge port (0: any free port)")
    parser.add_argument("--requests", type=at_least(0), default=300, help="requests to send before the report")
    parser.add_argument("--fraction", type=between(0, 1), default=1.0, help="share of the shop's requests to copy")
    parser.add_argument("--serve", action="store_true", help="keep running after the report, until Ctrl-C")
    args = parser.parse_args()
    start = functools.partial(main, port=args.port, fraction=args.fraction, requests=args.requests, serve=args.serve)
    start = functools.partial(start, operations=args.operations)
    run_until_signal(start, grace=5.0)


if __name__ == "__main__":
    run()
