"""What a routing decision costs: a policy's pick with 10 and 1,000 replicas, and the route cache's upkeep.

Everything but etcd (section 3) runs in this process. Figures are the best of
several repeats of a loop of picks, in microseconds per pick, loop and call
included.

1. ``Policy.pick`` for each built-in policy, over an app's candidates as a
   ``RouteCache`` hands them out (a tuple sorted by name), with 10 and with
   1,000 replicas, in three load states (the proxy's in-flight counts, fixed
   while timing): ``idle`` (every replica known at 0), ``half busy`` (half
   at 0, half at 1-4) and ``all busy`` (every replica at 1-8):

       LeastInFlight                     the default
       PowerOfTwo                        two random candidates, the less loaded
       RoundRobin                        one rotation per app
       AffinityHash, repeated keys       keys from 100 sessions (their first choices remembered)
       AffinityHash, new key each pick   a key never seen before: a full rendezvous pass

   Target: at most 20 µs per pick. The headline, which the verdict is over,
   is PowerOfTwo, both sizes, every load state: the policy for large pools,
   O(1) by design. The others are listed against the same target:
   LeastInFlight (the default) is O(1) while some candidate is idle, but
   must look at every candidate when all are busy, and AffinityHash must
   score every candidate for a key it has not seen, and sum the loads when
   the key's replica is busy. What one pass over 1,000 items costs on the
   machine at hand is printed first, since a pick that looks at every
   candidate cannot beat it.

2. ``RouteCache``: a full ``load`` of 10,000 routes (1,000 apps, each with
   a domain and 9 replicas), in milliseconds; one ``apply`` that changes a
   replica of a 1,000-replica app (its tuple is rebuilt); and a lookup
   (``app_for`` + ``replicas``), as the proxy does per request. No target:
   printed for information.

3. A put reaching the caches of two proxies: two ``open_route_cache``
   reconcilers follow one store, and each put waits until both caches hold
   its revision; p50/p99 in milliseconds, for the ``EmbeddedStore`` and for
   a real etcd (Debian's ``etcd-server``, started on loopback for the run).
   No target: printed for information.

The last line is ``verdict: PASS|FAIL ...``. Only this machine's figures
compare with each other; absolute figures drift with the machine and its
load.

Run it from the repository root:

    python bench/routing.py           # 20,000 picks per figure (2,000 with 1,000 replicas), best of 5
    python bench/routing.py --quick   # 4,000 picks per figure (400 with 1,000 replicas), best of 3
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from _harness import ROOT, load_average

PICK_TARGET_US = 20.0  # µs per pick, at most, for 10 and 1,000 replicas
POOL_SIZES = (10, 1000)
STATES = ("idle", "half busy", "all busy")
HEADLINE = "PowerOfTwo"


def _import_project() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def best_of(repeats: int, run: Callable[[], object]) -> float:
    """Best wall time of ``run`` over ``repeats``, in seconds."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


# -- 1. picks -----------------------------------------------------------------------------------


def candidates_of(size: int) -> tuple[Any, ...]:
    """``size`` replicas of one app, from a RouteCache, as the proxy gets them."""
    _import_project()
    from blocks import RouteCache
    from blocks.store import encode_replica, route_key_for_replica

    cache = RouteCache()
    snapshot = {
        route_key_for_replica("app", f"replica-{i:04d}"): encode_replica(
            worker=("10.0.0.1", 9000), address=("127.0.0.1", 10000 + i)
        )
        for i in range(size)
    }
    cache.load(snapshot, 1, 0.0)
    return tuple(cache.replicas("app"))


def in_flight_for(state: str, candidates: tuple[Any, ...], rng: random.Random) -> dict[str, int]:
    if state == "idle":
        return {r.name: 0 for r in candidates}
    if state == "half busy":
        return {r.name: (0 if i % 2 else rng.randint(1, 4)) for i, r in enumerate(candidates)}
    return {r.name: rng.randint(1, 8) for r in candidates}


def policies() -> list[tuple[str, Callable[[], Any], str]]:
    """(row, a fresh policy, which requests: "plain", "repeated" or "new")."""
    _import_project()
    from blocks import LeastInFlight
    from blocks.routing import AffinityHash, PowerOfTwo, RoundRobin

    return [
        ("LeastInFlight", lambda: LeastInFlight(random.Random(1)), "plain"),
        ("PowerOfTwo", lambda: PowerOfTwo(random.Random(2)), "plain"),
        ("RoundRobin", RoundRobin, "plain"),
        ("AffinityHash, repeated keys", AffinityHash, "repeated"),
        ("AffinityHash, new key each pick", lambda: AffinityHash(remember=0), "new"),
    ]


def requests_for(kind: str, picks: int) -> list[Any]:
    _import_project()
    from blocks import Request

    def request(key: bytes | None) -> Any:
        headers = [(b"user-agent", b"bench"), (b"accept", b"*/*")]
        if key is not None:
            headers.append((b"x-affinity-key", key))
        return Request(b"GET", b"https", b"app.example", b"/", headers)

    if kind == "plain":
        return [request(None)] * picks
    if kind == "repeated":
        sessions = [request(b"session-%d" % i) for i in range(100)]
        return [sessions[i % 100] for i in range(picks)]
    # "new": every key distinct, and the policy remembers nothing, so every pick is a full pass
    return [request(b"user-%d" % i) for i in range(picks)]


def time_picks(
    make: Callable[[], Any], requests: list[Any], candidates: tuple[Any, ...], in_flight: Any, repeats: int
) -> float:
    policy = make()
    pick = policy.pick
    for request in requests[:200]:  # warm: seeds computed, first choices of repeated keys remembered
        pick(request, candidates, in_flight)

    def run() -> None:
        for request in requests:
            pick(request, candidates, in_flight)

    return best_of(repeats, run) / len(requests) * 1e6


def picks_for(picks: int, size: int) -> int:
    """Picks per figure: a tenth with 1,000 replicas, where a pass over them costs a hundred times more."""
    return picks if size <= 10 else max(400, picks // 10)


def measure_picks(picks: int, repeats: int) -> dict[tuple[str, str, int], float]:
    rng = random.Random(20240601)
    pools = {size: candidates_of(size) for size in POOL_SIZES}
    results: dict[tuple[str, str, int], float] = {}
    for row, make, kind in policies():
        for state in STATES:
            for size, candidates in pools.items():
                requests = requests_for(kind, picks_for(picks, size))
                in_flight = in_flight_for(state, candidates, rng)
                results[row, state, size] = time_picks(make, requests, candidates, in_flight, repeats)
    return results


def print_picks(results: dict[tuple[str, str, int], float], picks: int, repeats: int) -> None:
    print(
        f"\n1. Policy.pick, µs per pick (best of {repeats} x {picks} picks, {picks_for(picks, 1000)} with 1,000 "
        f"replicas; target <= {PICK_TARGET_US:g})"
    )
    header = "".join(f"{f'{state} {size}':>16}" for state in STATES for size in POOL_SIZES)
    print(f"{'policy':<34}{header}")
    for row, _, _ in policies():
        cells = []
        for state in STATES:
            for size in POOL_SIZES:
                us = results[row, state, size]
                cells.append(f"{us:>15.2f}{'*' if us > PICK_TARGET_US else ' '}")
        print(f"{row:<34}{''.join(cells)}")
    print("(columns: load state and replicas; * marks a figure above the target)", flush=True)


# -- 2. the route cache -------------------------------------------------------------------------


def measure_cache(repeats: int) -> dict[str, float]:
    _import_project()
    from blocks import RouteCache
    from blocks.store import RouteEvent, encode_domain, encode_replica, route_key_for_domain, route_key_for_replica

    snapshot: dict[str, bytes] = {}
    for a in range(1000):
        app = f"app-{a:04d}"
        snapshot[route_key_for_domain(f"{app}.example")] = encode_domain(app)
        for r in range(9):
            snapshot[route_key_for_replica(app, f"{app}-r{r}")] = encode_replica(
                worker=(f"10.0.{a // 250}.{a % 250}", 9000), address=("127.0.0.1", 10000 + r), capacity=8
            )
    assert len(snapshot) == 10_000
    load_s = best_of(repeats, lambda: RouteCache().load(snapshot, 1, 0.0))
    cache = RouteCache()
    cache.load(snapshot, 1, 0.0)
    stats = cache.statistics()
    assert (stats.domains, stats.apps, stats.replicas, stats.bad_values) == (1000, 1000, 9000, {}), stats

    big = RouteCache()
    big.load(
        {
            route_key_for_replica("big", f"big-{i:04d}"): encode_replica(
                worker=("10.0.0.1", 9000), address=("127.0.0.1", 10000 + i)
            )
            for i in range(1000)
        },
        1,
        0.0,
    )
    key = route_key_for_replica("big", "big-0500")
    events = [
        [RouteEvent("put", key, encode_replica(worker=("10.0.0.1", 9000), address=("127.0.0.1", 20000 + i % 2)), 2 + i)]
        for i in range(200)
    ]

    def apply_all() -> None:
        for batch in events:
            big.apply(batch, 0.0)

    apply_s = best_of(1, apply_all) / len(events)  # revisions only grow: one pass

    authorities = [f"app-{a:04d}.example:443".encode() for a in range(0, 1000, 7)]
    app_for, replicas = cache.app_for, cache.replicas

    def lookups() -> None:
        for authority in authorities:
            app = app_for(authority)
            replicas(app)  # type: ignore[arg-type]

    lookup_s = best_of(repeats * 20, lookups) / len(authorities)
    return {"load_ms": load_s * 1e3, "apply_us": apply_s * 1e6, "lookup_us": lookup_s * 1e6}


def measure_propagation(puts: int) -> dict[str, tuple[float, float]]:
    """put -> every proxy's cache holds it: two caches follow one store, as two proxies would.

    Each put waits until both caches reached its revision before the next,
    so the figures are the latency of one change, not a backlog.
    """
    import tempfile
    from pathlib import Path

    import trio

    from blocks import EmbeddedStore, EtcdSource, open_route_cache
    from blocks.store import route_key_for_domain
    from tests.etcd_server import open_etcd

    async def run(source: Any, make: Callable[[], Any], put: Callable[[str, bytes], Any]) -> tuple[float, float]:
        latencies = []
        async with open_route_cache(make()) as first, open_route_cache(make()) as second:
            caches = (first.cache, second.cache)
            for i in range(puts):
                start = time.perf_counter()
                revision = await put(route_key_for_domain(f"d{i}.example"), b'{"app": "a"}')
                while any(cache.revision < revision for cache in caches):
                    await trio.sleep(0)
                latencies.append(time.perf_counter() - start)
        latencies.sort()
        return latencies[len(latencies) // 2] * 1e3, latencies[int(len(latencies) * 0.99)] * 1e3

    async def both() -> dict[str, tuple[float, float]]:
        store = EmbeddedStore()

        async def put_embedded(key: str, value: bytes) -> int:
            return store.put(key, value)

        figures = {"embedded": await run(store, lambda: store, put_embedded)}
        with tempfile.TemporaryDirectory(prefix="proxyblocks-bench-") as tmp:
            async with open_etcd(Path(tmp)) as etcd:
                writer = EtcdSource(etcd.url)
                figures["etcd"] = await run(etcd, lambda: EtcdSource(etcd.url), writer.put)
        return figures

    sys.path.insert(0, str(ROOT))
    return trio.run(both)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4,000 picks per figure, best of 3")
    parser.add_argument("--picks", type=int, default=20_000, help="picks per figure (default 20000)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per figure; the best counts (default 5)")
    args = parser.parse_args()
    picks, repeats = (4000, 3) if args.quick else (max(1, args.picks), max(1, args.repeats))

    print(f"python {sys.version.split()[0]}, load average {load_average()}")
    items = list(range(1000))
    baseline = best_of(repeats * 20, lambda: sum(items)) * 1e6
    print(f"one pass over 1,000 items (sum of a list), for scale: {baseline:.2f} µs")

    results = measure_picks(picks, repeats)
    print_picks(results, picks, repeats)
    cache = measure_cache(repeats)
    print("\n2. RouteCache (no target)")
    print(f"load, 10,000 routes (1,000 apps x 1 domain + 9 replicas):  {cache['load_ms']:.1f} ms")
    print(f"apply, 1 event into a 1,000-replica app (tuple rebuilt):   {cache['apply_us']:.0f} µs")
    print(f"lookup, app_for + replicas:                                {cache['lookup_us']:.2f} µs")
    puts = 100 if args.quick else 300
    propagation = measure_propagation(puts)
    print(f"\n3. put -> both of two proxies' caches updated ({puts} puts, one at a time; no target)")
    for store, (p50, p99) in propagation.items():
        print(f"{store:<10} p50 {p50:.2f} ms  p99 {p99:.2f} ms")

    headline = {key: us for key, us in results.items() if key[0] == HEADLINE}
    worst_key = max(headline, key=headline.__getitem__)
    worst = headline[worst_key]
    ok = worst <= PICK_TARGET_US

    def worst_of(row: str) -> str:
        per_size = [max(results[row, state, size] for state in STATES) for size in POOL_SIZES]
        return "/".join(f"{us:.1f}{'*' if us > PICK_TARGET_US else ''}" for us in per_size)

    others = ", ".join(f"{row} {worst_of(row)}" for row, _, _ in policies() if row != HEADLINE)
    print("\nworst over the load states, µs per pick at 10/1,000 replicas (* above the target):")
    print(f"  {HEADLINE} (headline): {worst_of(HEADLINE)}  (target <= {PICK_TARGET_US:g})")
    print(f"  others: {others}")
    figures = (
        f"headline PowerOfTwo worst {worst:.1f} µs/pick ({worst_key[2]} replicas, {worst_key[1]}; "
        f"target <= {PICK_TARGET_US:g}); others, worst at 10/1,000 replicas: {others}; "
        f"RouteCache.load of 10,000 routes {cache['load_ms']:.0f} ms (no target); put -> caches p50/p99 "
        + ", ".join(f"{store} {p50:.1f}/{p99:.1f} ms" for store, (p50, p99) in propagation.items())
        + " (no target)"
    )
    print(f"verdict: {'PASS' if ok else 'FAIL'} {figures}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
