"""Failover: what a fault or a restart of one hop costs a chain with no single point of failure.

The topology users deploy, a process per hop (``recipes.chain --role ...``):
an edge in front of 2 proxies, each routing to every replica behind each
of 2 workers; the replicas are 2 Hypercorn h2c servers (not this project's
code, ``tests/asgi_replica.py``) and 2 demo replicas, each its own process.
One pooled HTTP/2 client sends ``GET /`` through the edge at a steady rate.

Then, one after the other, for ``proxy-1``, ``worker-1``, a Hypercorn
replica and a demo replica: ``kill -9``, an outage of ``--outage`` seconds,
a start on the same port; and a planned restart (SIGTERM: a drain, then a
start) of ``proxy-1`` and ``worker-1``. For each it prints the requests in
flight at the fault, the requests that failed (started within a second
before the fault and until the part took traffic again), the failures
after that, and the recovery: seconds from the part listening again to
the first request through it.

Targets (the issue's): failed <= in flight at each fault, recovery <= 1 s
after the part listens again, 0 failed for planned restarts, and 0
failures in the first, fault-free period (with the Hypercorn replicas).

Run it from the repository root:

    python bench/failover.py                    # 320 requests/s, 10 s outages, the codec `auto` picks
    python bench/failover.py --codec h2 --quick # 100 requests/s, 3 s outages

The last line is ``verdict: PASS|FAIL ...``.
"""

from __future__ import annotations

import argparse
import collections
import sys

import trio
from _harness import ROOT, load_average

RECOVERY_TARGET = 1.0


def _import_project() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


async def run(codec: str | None, rate: float, outage: float, settle: float) -> bool:
    from blocks.testing import PacedLoad, ProcessFleet

    py = sys.executable
    hyper = [py, "-m", "hypercorn", "tests.asgi_replica:app", "--bind", "127.0.0.1:{port}", "-k", "trio", "-w", "0"]
    demo = [py, "-m", "blocks.testing.replica", "--port", "{port}", "--name", "{name}"]
    replicas = {
        "hyper-0": (hyper, r"Running on", "h2c"),
        "hyper-1": (hyper, r"Running on", "h2c"),
        "demo-0": (demo, r"listening on", "h2c"),
        "demo-1": (demo, r"listening on", "h2c"),
    }
    ok = True
    rows: list[str] = []
    async with trio.open_nursery() as nursery:
        fleet: ProcessFleet = await nursery.start(ProcessFleet(replicas, codec=codec, cwd=ROOT).run)
        load = PacedLoad(fleet.parts["edge"].address, rate)
        await nursery.start(load.run)
        began = trio.current_time()
        await trio.sleep(settle * 3)
        quiet = load.failed_between(began)
        print(f"no fault    {len(load.outcomes):6d} requests, {len(quiet)} failed", flush=True)
        ok &= not quiet

        def tag(part: str) -> str:
            return f"hypercorn-{fleet.parts[part].port}" if part.startswith("hyper") else part

        async def recovered(part: str, since: float) -> float:
            with trio.move_on_after(10):
                while (first := load.first_through(tag(part), since)) is None:
                    await trio.sleep(0.01)
                return first - since
            return float("inf")

        for part in ("proxy-1", "worker-1", "hyper-0", "demo-0"):
            fault = trio.current_time()
            in_flight = load.in_flight_at(fault)
            fleet.kill(part)
            await fleet.wait_dead(part)
            await trio.sleep(outage)
            await fleet.start(part)
            listening = trio.current_time()
            recovery = await recovered(part, listening)
            back = listening + recovery
            failed = load.failed_between(fault - 1.0, back)
            await trio.sleep(settle)
            after = load.failed_between(back, trio.current_time() - 0.5)
            good = len(failed) <= in_flight and not after and recovery <= RECOVERY_TARGET
            ok &= good
            reasons = collections.Counter(o.error.partition(";")[0] or str(o.status) for o in failed + after)
            rows.append(
                f"kill -9 {part:9s} in flight {in_flight:3d}  failed {len(failed):4d}  after {len(after):3d}"
                f"  recovery {recovery:6.3f} s  {'ok' if good else 'FAIL'}  {dict(reasons)}"
            )
            print(rows[-1], flush=True)
            for o in (failed + after)[:3]:
                print(f"    failed {o.start - fault:+.3f} s after the kill: {o.status} {o.error}", flush=True)
        for part in ("proxy-1", "worker-1"):
            planned = trio.current_time()
            await fleet.stop(part)
            await fleet.start(part)
            listening = trio.current_time()
            recovery = await recovered(part, listening)
            await trio.sleep(settle)
            failed = load.failed_between(planned - 0.5, trio.current_time() - 0.5)
            good = not failed and recovery <= RECOVERY_TARGET
            ok &= good
            reasons = collections.Counter(o.error.partition(";")[0] or str(o.status) for o in failed)
            rows.append(
                f"restart {part:9s}                failed {len(failed):4d}              recovery {recovery:6.3f} s"
                f"  {'ok' if good else 'FAIL'}  {dict(reasons)}"
            )
            print(rows[-1], flush=True)
        total = collections.Counter(o.status for o in load.outcomes)
        print(f"all         {len(load.outcomes):6d} requests, statuses {dict(total)}", flush=True)
        nursery.cancel_scope.cancel()
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", choices=("auto", "h2", "nghttp2"), help="default: $PROXYBLOCKS_CODEC, else auto")
    parser.add_argument("--rate", type=float, default=320.0, help="requests per second through the edge")
    parser.add_argument("--outage", type=float, default=10.0, help="seconds each killed part stays down")
    parser.add_argument("--quick", action="store_true", help="100 requests/s, 3 s outages")
    args = parser.parse_args()
    if args.quick:
        args.rate, args.outage = 100.0, 3.0
    _import_project()
    print(f"load average {load_average()}, codec {args.codec}, {args.rate:.0f} requests/s, outages {args.outage} s")
    ok = trio.run(run, args.codec, args.rate, args.outage, 2.0)
    print(
        f"verdict: {'PASS' if ok else 'FAIL'} failed <= in flight at each kill, recovery <= {RECOVERY_TARGET} s, "
        "0 failed for planned restarts and with no fault"
    )


if __name__ == "__main__":
    main()
