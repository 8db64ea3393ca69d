"""Noisy neighbour: one tenant floods the chain, another stays fast.

Run it:

    python -m recipes.noisy_neighbour                 # 15 s, fair scheduler on
    python -m recipes.noisy_neighbour --no-scheduler  # the same flood, no scheduler
    python -m recipes.noisy_neighbour --seconds 30 --flood 256

It starts the full chain with a small fair-scheduler budget (``SCHEDULER``,
sized to what the demo chain can serve), then, through the edge over h2:

- tenant ``noisy`` keeps ``--flood`` requests in flight, as fast as it can;
- tenant ``quiet`` sends ``--rate`` requests per second;

both to ``/sleep?ms=20`` (a replica that takes 20 ms). Every second it
prints each tenant's requests, statuses and latency p50/p99. With the
scheduler, ``noisy`` is held to its share (its excess is queued, then
refused with 429 or 503) and ``quiet`` keeps its solo latency; without it,
``noisy`` takes what it wants. Poke the running chain yourself with
``curl -H 'x-tenant: NAME' http://127.0.0.1:PORT/``. Ctrl-C (or SIGTERM)
before the end drains the chain; a second stops at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import trio

from blocks import Address, Chain, CommandParser, SchedulerConfig, TenantPolicy, open_upstreams, serve_chain
from blocks.command import Operations, at_least, between, run_until_signal, seconds
from blocks.testing import SLEEP_20MS, TenantLoad, flood, steady

SCHEDULER = SchedulerConfig(
    budget=8,
    default_policy=TenantPolicy(max_in_flight=6, max_queued=128, queue_timeout=2.0, retry_after=1.0),
)
"""8 proxy -> worker slots, at most 6 to one tenant; 128 may wait 2 s (a quiet tenant waits one turn,
which a busy machine stretches).

Sized to what the demo chain serves, as a budget must be: 8 slots of a
20 ms request are about 400 requests a second, well inside what four
Python hops on two cores carry, so the slots, not the CPU, are what runs
out first, and that is what a slot scheduler can share fairly. With
room in the queue for the whole default flood, ``noisy``'s excess waits
and is refused by deadline (503) rather than answered 429 at once: a
client that retries a 429 at once, on the same machine, costs as much
CPU as serving it.
"""

PATH = SLEEP_20MS


async def run_load(
    edge: Address,
    *,
    seconds: float,
    flood_concurrency: int,
    rate: float,
    report: Callable[[str], None] | None = print,
) -> tuple[TenantLoad, TenantLoad]:
    """Flood as ``noisy`` and pace ``quiet`` against ``edge`` for ``seconds``; return what each saw."""
    noisy, quiet = TenantLoad("noisy"), TenantLoad("quiet")
    async with open_upstreams() as upstreams, trio.open_nursery() as nursery:
        if flood_concurrency:
            nursery.start_soon(flood, upstreams, edge, noisy, flood_concurrency, PATH)
        nursery.start_soon(steady, upstreams, edge, quiet, rate, PATH)
        end = trio.current_time() + seconds
        while trio.current_time() < end:
            await trio.sleep(min(1.0, end - trio.current_time()))
            if report is not None:
                report(f"{noisy.line()}\n{quiet.line()}\n")
        nursery.cancel_scope.cancel()
    return noisy, quiet


async def main(
    *,
    seconds: float = 15.0,
    flood_concurrency: int = 128,
    rate: float = 10.0,
    scheduler: SchedulerConfig | None = SCHEDULER,
    report: Callable[[str], None] | None = print,
    operations: Operations | None = None,
    task_status: trio.TaskStatus[Chain] = trio.TASK_STATUS_IGNORED,
) -> tuple[TenantLoad, TenantLoad]:
    """Start the chain, run the load, shut the chain down; return ``(noisy, quiet)``."""

    async def build(chain: Chain) -> None:
        await chain.start_worker({name: await chain.start_replica(name) for name in ("replica-0", "replica-1")})
        await chain.start_proxy(scheduler=scheduler)
        await chain.start_edge()

    async with trio.open_nursery() as nursery:
        chain: Chain = await nursery.start(
            functools.partial(serve_chain, build, announce=report is not None, operations=operations)
        )
        task_status.started(chain)
        if report is not None:
            report(f"edge listening on {chain.url}; scheduler {'on' if scheduler else 'off'}\n")
        result = await run_load(
            (chain.host, chain.port), seconds=seconds, flood_concurrency=flood_concurrency, rate=rate, report=report
        )
        if report is not None and scheduler is not None:
            stats = chain.proxy.scheduler.statistics() if chain.proxy.scheduler else None
            report(f"scheduler: {stats}\n")
        await chain.shutdown(1.0)
    return result


def run() -> None:
    parser = CommandParser(prog="python -m recipes.noisy_neighbour", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=seconds, default=15.0, help="how long to run")
    parser.add_argument("--flood", type=at_least(0), default=128, help="requests the noisy tenant keeps in flight")
    parser.add_argument(
        "--rate", type=between(0.1, 10_000), default=10.0, help="requests per second of the quiet tenant"
    )
    parser.add_argument("--no-scheduler", action="store_true", help="run the same load without the fair scheduler")
    args = parser.parse_args()

    def report(text: str) -> None:
        print(text, end="", flush=True)

    async def start(task_status: trio.TaskStatus[Chain]) -> None:
        scheduler = None if args.no_scheduler else SCHEDULER
        await main(
            seconds=args.seconds,
            flood_concurrency=args.flood,
            rate=args.rate,
            scheduler=scheduler,
            report=report,
            operations=args.operations,
            task_status=task_status,
        )

    run_until_signal(start, grace=5.0)  # the first Ctrl-C drains the chain, a second stops at once


if __name__ == "__main__":
    run()
