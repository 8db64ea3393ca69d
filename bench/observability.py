"""The cost of watching the chain: its rps and c1 p50 with metrics and the access log off and on.

What it measures, over h2c on 127.0.0.1, every server a separate OS process:

    off         the chain (edge, proxy and worker in one process, as the chain recipe runs them)
    on          the same chain with an admin listener (every hop counting its requests with the
                ``Metrics`` feature) and an access log written to a file, one JSON line per request

Both chains sit in front of the same demo replica. Each round measures both
cases in turn, in a rotated order (h2load -n N -c 8 -m 32 for rps, then
-n M -c 1 -m 1 for latency); figures are medians over the rounds. After the
runs, the access log must hold one line per request sent to ``on`` and the
admin listener's ``/metrics`` must count them: the cost measured is the cost
of the work being done.

Target (issue 17): ``on`` rps >= 0.95x ``off`` rps. The last line is
``verdict: PASS|FAIL ...``.

Run it from the repository root (needs h2load: apt-get install nghttp2-client):

    python bench/observability.py            # N=20000, M=2000, 5 rounds
    python bench/observability.py --quick    # N=3000, M=1000, 3 rounds

``python bench/observability.py --serve ROLE PORT ...`` is the helper mode
that starts one server per process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _harness import ROOT, Processes, Result, free_port, load_average, measure, serve_role

TARGET = 0.95


def argv(role: str, port: int, *upstream: int) -> list[str]:
    return [str(ROOT / "bench" / "observability.py"), "--serve", role, str(port), *map(str, upstream)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000, help="requests for the rps run")
    parser.add_argument("-m", type=int, default=2000, help="requests for the c1 latency run")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; figures are medians")
    parser.add_argument("--quick", action="store_true", help="-n 3000 -m 1000, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.n, args.m, args.rounds = 3000, 1000, 3
    tmp = Path(tempfile.mkdtemp(prefix="proxyblocks-bench-"))
    log = tmp / "access.jsonl"
    print(f"h2load: rps with -n {args.n} -c 8 -m 32, latency with -n {args.m} -c 1 -m 1; {args.rounds} rounds")
    print(f"load average before: {load_average()}")
    procs = Processes(tmp)
    try:
        replica = free_port()
        procs.start("replica", argv("replica", replica), replica)
        ports = {"off": free_port(), "on": free_port()}
        procs.start("off", argv("chain", ports["off"], replica), ports["off"])
        os.environ["PROXYBLOCKS_BENCH_ACCESS_LOG"] = str(log)
        on = procs.start("on", argv("chain+observed", ports["on"], replica), ports["on"])
        results: dict[str, list[Result]] = {"off": [], "on": []}
        for i in range(args.rounds):
            print(f"... round {i + 1}/{args.rounds}", flush=True)
            for case in ("off", "on") if i % 2 == 0 else ("on", "off"):
                results[case].append(measure(case, ports[case], args.n, args.m, tmp, warm=i == 0))
        sent_on = args.rounds * (args.n + args.m) + 500  # (the warm-up's too)
        deadline = time.monotonic() + 10  # the log is written every 0.2 s: wait for the last batch
        while (lines := _lines(log)) < sent_on and time.monotonic() < deadline:
            time.sleep(0.1)
        admin = _admin_port(on.log)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10).read().decode()
    finally:
        procs.stop_all()
    counted = sum(
        float(line.rpartition(" ")[2])
        for line in metrics.splitlines()
        if line.startswith("proxyblocks_requests_total{") and 'hop="edge"' in line
    )
    problems = [p for case in results.values() for r in case for p in r.problems]
    print(f"load average after: {load_average()}\n")
    print(f"{'case':<8} {'rps (c8 m32)':>13} {'c1 p50 µs':>10} {'c1 p99 µs':>10}")
    figures = {}
    for case, runs in results.items():
        figures[case] = (
            statistics.median(r.rps for r in runs),
            statistics.median(r.p50_us for r in runs),
            statistics.median(r.p99_us for r in runs),
        )
        print(f"{case:<8} {figures[case][0]:>13.0f} {figures[case][1]:>10.0f} {figures[case][2]:>10.0f}")
    ratio = figures["on"][0] / figures["off"][0]
    p50 = figures["on"][1] / figures["off"][1]
    print(f"\n'on' sent {sent_on} requests: {lines} access-log lines, {counted:.0f} counted by /metrics at the edge")
    print(f"rps on / off: {ratio:.3f} (target >= {TARGET}); c1 p50 on / off: {p50:.3f} (for information)")
    ok = ratio >= TARGET and not problems and lines == sent_on and counted == sent_on
    if problems:
        print("problems:", *problems[:5], sep="\n  ")
    print(
        f"verdict: {'PASS' if ok else 'FAIL'} rps with metrics and the access log on {ratio:.3f}x off "
        f"(target >= {TARGET}); c1 p50 {p50:.3f}x; {lines}/{sent_on} log lines, {counted:.0f} counted"
    )


def _lines(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def _admin_port(log: Path) -> int:
    for line in log.read_text().splitlines():
        if line.startswith("admin listening on "):
            return int(line.rpartition(":")[2])
    raise SystemExit(f"the observed chain printed no admin port: {log}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve_role(sys.argv[2], int(sys.argv[3]), [int(p) for p in sys.argv[4:]])
    else:
        main()
