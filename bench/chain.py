"""Throughput and latency of proxyblocks hops against the reference trio + h2 hop, side by side.

What it measures, all over h2c on 127.0.0.1, every server a separate OS process:

    replica direct            the demo replica (blocks.testing.serve_demo_replica) alone
    proxyblocks 1 hop         one worker hop in front of that replica
    proxyblocks chain         edge -> proxy -> worker -> replica, the three hops in one
                              process as recipes/chain.py runs them (h2c between them all the same)
    proxyblocks chain, a process per hop   the same three hops, each in a process of its own
    reference hop             ../shared/reference/trio_h2_proxy.py in front of the replica
    reference 3-hop chain     three of those in a row
    (and both reference rows again with --novalid)

Every target is started up front and stays up; then several rounds visit
each target in turn (a rotated order each round): a short warm-up in the
first round (h2load -n 500 -c 8 -m 32), then throughput (h2load -n N -c 8
-m 32, req/s) and one-request-at-a-time latency (h2load -n M -c 1 -m 1;
p50/p99 from h2load's --log-file). Figures are medians over the rounds, so
a burst of outside load on a 2-core machine lands on every target alike.
It then prints
the ratios the project aims for and a last line ``verdict: PASS|FAIL ...``:

    proxyblocks 1 hop rps / reference hop rps            >= 1.2
    proxyblocks chain c1 p50 / reference 3-hop c1 p50    <= 0.8

The chain is measured as the recipe runs it: one process for the three
hops, which is what composable blocks allow and three reference scripts
cannot do. At one request at a time, latency is the sum of each process's
CPU for that request, and a Python process woken after the others ran pays
for cold caches: each hop of a process of its own costs about as much as a
reference hop. The chain with a process per hop is printed beside it, with
its own ratio, for comparison.

Any failed, errored, timed-out or non-2xx request makes the verdict FAIL.
The reference scripts run from their own directory; they are never copied
into the project. Only ratios from one run mean anything: absolute figures
drift with the machine.

Run it from the repository root (needs h2load: apt-get install nghttp2-client):

    python bench/chain.py            # N=20000, M=2000, 5 rounds
    python bench/chain.py --quick    # N=3000, M=1000, 3 rounds
    python bench/chain.py -n 50000 -m 5000
    git worktree add /tmp/base HEAD~1 && python bench/chain.py --baseline /tmp/base
                                     # adds the 1 hop and the chain of that checkout, side by side

``python bench/chain.py --serve ROLE PORT [UPSTREAM_PORT...]`` is the helper
mode the benchmark uses to start one proxyblocks hop per process.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from _harness import ROOT, Process, Processes, Result, free_port, load_average, measure, serve_role

REFERENCE = ROOT.parent / "shared" / "reference"
RPS_TARGET = 1.2  # proxyblocks 1 hop rps / reference hop rps, at least
P50_TARGET = 0.8  # proxyblocks chain c1 p50 / reference 3-hop chain c1 p50, at most


# -- helper mode: one proxyblocks hop in this process ------------------------------------


# -- processes -----------------------------------------------------------------------------


def self_argv(role: str, port: int, *upstream: int, root: Path = ROOT) -> list[str]:
    """The helper mode of this script, or of the same script in the checkout ``root``."""
    return [str(root / "bench" / "chain.py"), "--serve", role, str(port), *map(str, upstream)]


def reference_argv(listen: int, upstream: int, novalid: bool) -> list[str]:
    return ["trio_h2_proxy.py", str(listen), str(upstream), *(["--novalid"] if novalid else [])]


# -- the run ----------------------------------------------------------------------------------


Hop = Callable[[int, int], tuple[str, list[str], Path]]
"""(listen port, upstream port) -> (process name, argv after the interpreter, cwd)."""


def targets(replica_port: int, baseline: Path | None = None) -> list[tuple[str, list[Hop]]]:
    """Each target as its hops, innermost first (a reference hop connects upstream as it starts)."""

    def pb(role: str, root: Path = ROOT) -> Hop:
        def hop(port: int, upstream: int) -> tuple[str, list[str], Path]:
            upstreams = [upstream, replica_port] if role == "proxy" else [upstream]
            name = f"pb {role}" if root == ROOT else f"baseline {role}"
            return name, self_argv(role, port, *upstreams, root=root), root

        return hop

    def ref(name: str, novalid: bool) -> Hop:
        return lambda port, upstream: (name, reference_argv(port, upstream, novalid), REFERENCE)

    found: list[tuple[str, list[Hop]]] = [
        ("replica direct", []),
        ("proxyblocks 1 hop", [pb("worker")]),
        ("proxyblocks chain", [pb("chain")]),
        ("proxyblocks chain, a process per hop", [pb("worker"), pb("proxy"), pb("edge")]),
    ]
    if baseline is not None:
        found += [("baseline 1 hop", [pb("worker", baseline)]), ("baseline chain", [pb("chain", baseline)])]
    for novalid in (False, True):
        suffix = " --novalid" if novalid else ""
        found.append((f"reference hop{suffix}", [ref(f"ref hop{suffix}", novalid)]))
        found.append(
            (f"reference 3-hop chain{suffix}", [ref(f"ref chain hop {i}{suffix}", novalid) for i in (1, 2, 3)])
        )
    return found


def run_benchmark(n: int, m: int, rounds: int, verbose: bool, baseline: Path | None = None) -> int:
    if shutil.which("h2load") is None:
        print("h2load not found: install it with `apt-get install nghttp2-client`", file=sys.stderr)
        return 2
    if not (REFERENCE / "trio_h2_proxy.py").exists():
        print(f"reference scripts not found in {REFERENCE}", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="proxyblocks-bench-"))
    procs = Processes(tmp)
    results: dict[str, Result] = {}
    print(
        f"h2load: rps with -n {n} -c 8 -m 32, latency with -n {m} -c 1 -m 1; {rounds} interleaved rounds, "
        f"medians; {os.cpu_count()} CPUs; logs in {tmp}"
    )
    print(f"load average before: {load_average()}", flush=True)
    try:
        # Every target runs for the whole benchmark, and the rounds visit them in
        # turn (a different order each round), so a burst of outside load lands
        # on all of them alike instead of on one.
        replica_port = free_port()
        replica = procs.start("replica", self_argv("replica", replica_port), replica_port)
        ready: dict[str, tuple[int, list[Process]]] = {}
        for label, chain in targets(replica_port, baseline):
            hops: list[Process] = []
            port = replica_port
            try:
                for hop in chain:
                    listen = free_port()
                    name, argv, cwd = hop(listen, port)
                    hops.append(procs.start(name, argv, listen, cwd=cwd))
                    port = listen
            except RuntimeError as exc:
                results[label] = Result(label, problems=[f"could not start: {exc}"])
                continue
            ready[label] = (port, hops)
        samples: dict[str, list[Result]] = {label: [] for label in ready}
        labels = list(ready)
        for round_no in range(rounds):
            order = labels[round_no % len(labels) :] + labels[: round_no % len(labels)]
            print(f"... round {round_no + 1}/{rounds}", flush=True)
            for label in order:
                port, hops = ready[label]
                sample = measure(label, port, n, m, tmp, warm=round_no == 0, verbose=verbose)
                for proc in [*hops, replica]:
                    if (code := proc.popen.poll()) is not None:
                        how = f"killed by signal {-code} (not by this script)" if code < 0 else f"exited with {code}"
                        sample.problems.append(f"{proc.name} {how} during the run")
                samples[label].append(sample)
        for label, runs in samples.items():
            result = results[label] = Result(
                label,
                rps=statistics.median(r.rps for r in runs),
                p50_us=statistics.median(r.p50_us for r in runs),
                p99_us=statistics.median(r.p99_us for r in runs),
                problems=[p for r in runs for p in r.problems],
            )
            if result.problems:
                _, hops = ready[label]
                for proc in [*hops, replica]:
                    result.problems.append(f"output of {proc.name} (last lines):\n{proc.tail() or '(empty)'}")
    finally:
        procs.stop_all()
    print(f"load average after: {load_average()}  (other processes on the machine skew the figures)")
    return report(results)


def report(results: dict[str, Result]) -> int:
    print()
    print(f"{'target':<34} {'rps (c8 m32)':>12} {'c1 p50 µs':>10} {'c1 p99 µs':>10}")
    for r in results.values():
        print(f"{r.name:<34} {r.rps:>12.0f} {r.p50_us:>10.0f} {r.p99_us:>10.0f}")

    problems = [(r.name, p) for r in results.values() for p in r.problems]
    if problems:
        print("\nPROBLEMS:")
        for target, problem in problems:
            print(f"[{target}] {problem}")

    def ratio(a: float, b: float) -> float:
        return a / b if b and not math.isnan(b) else math.nan

    pb_hop, pb_chain = results["proxyblocks 1 hop"], results["proxyblocks chain"]
    rps_ratio = ratio(pb_hop.rps, results["reference hop"].rps)
    p50_ratio = ratio(pb_chain.p50_us, results["reference 3-hop chain"].p50_us)
    print()
    print(f"proxyblocks 1 hop rps / reference hop rps:               {rps_ratio:.2f}  (target >= {RPS_TARGET})")
    print(f"proxyblocks chain c1 p50 / reference 3-hop chain c1 p50: {p50_ratio:.2f}  (target <= {P50_TARGET})")
    apart = ratio(results["proxyblocks chain, a process per hop"].p50_us, results["reference 3-hop chain"].p50_us)
    print("for information:")
    print(f"  the chain with a process per hop, c1 p50 ratio {apart:.2f}")
    novalid_rps = ratio(pb_hop.rps, results["reference hop --novalid"].rps)
    novalid_p50 = ratio(pb_chain.p50_us, results["reference 3-hop chain --novalid"].p50_us)
    print(f"  against the reference with --novalid: 1 hop rps ratio {novalid_rps:.2f}, chain c1 p50 {novalid_p50:.2f}")

    if "baseline chain" in results:
        base_rps = ratio(pb_hop.rps, results["baseline 1 hop"].rps)
        base_p50 = ratio(pb_chain.p50_us, results["baseline chain"].p50_us)
        print(f"  this tree against the baseline: 1 hop rps ratio {base_rps:.2f}, chain c1 p50 ratio {base_p50:.2f}")

    failing_targets = sorted({target for target, _ in problems})
    ok = rps_ratio >= RPS_TARGET and p50_ratio <= P50_TARGET and not failing_targets
    figures = (
        f"1-hop rps ratio {rps_ratio:.2f} (target >= {RPS_TARGET}), "
        f"chain c1 p50 ratio {p50_ratio:.2f} (target <= {P50_TARGET}; a process per hop: {apart:.2f})"
    )
    if failing_targets:
        figures += f", failed/errored requests or dead hops in: {', '.join(failing_targets)} (target: none)"
    print(f"verdict: {'PASS' if ok else 'FAIL'} {figures}")
    return 0 if ok else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        if len(sys.argv) < 4:
            raise SystemExit("usage: chain.py --serve ROLE PORT [UPSTREAM_PORT...]")
        serve_role(sys.argv[2], int(sys.argv[3]), [int(p) for p in sys.argv[4:]])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000, help="requests for the rps run (default 20000)")
    parser.add_argument("-m", type=int, default=2000, help="requests for the c1 latency run (default 2000)")
    parser.add_argument("--quick", action="store_true", help="rps run with -n 3000, latency with -m 1000, 3 rounds")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are medians (default 5)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print h2load's output")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="also measure the 1 hop and the chain of another checkout (git worktree add DIR REV), side by side",
    )
    args = parser.parse_args()
    if args.baseline is not None and not (args.baseline / "bench" / "chain.py").exists():
        parser.error(f"--baseline {args.baseline}: no bench/chain.py there")
    # SIGTERM unwinds like Ctrl-C, so the finally block still stops every server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        baseline = args.baseline.resolve() if args.baseline is not None else None
        if args.quick:
            return run_benchmark(3000, 1000, 3, args.verbose, baseline)
        return run_benchmark(args.n, args.m, max(1, args.rounds), args.verbose, baseline)
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
