"""The cost of mirroring to the primary: the chain's rps and c1 p50 with the mirror tee off and on.

What it measures, over h2c on 127.0.0.1, every server a separate OS process:

    off                 edge -> proxy (no mirror) -> worker -> replica
    10% healthy         the same proxy mirroring 10 % of requests to a shadow app (its own worker and replica)
    100% healthy        mirroring every request to that shadow
    100% never reads    mirroring every request to an h2 server that takes the stream and never reads nor answers

Each case is its own edge and proxy in front of the same primary worker and
replica (started once and kept up), so the only difference is the proxy's
mirror. The rounds visit the cases in turn (a rotated order each round):
throughput (h2load -n N -c 8 -m 32, req/s) and, once the shadows that
run left behind are done, one-request-at-a-time latency (h2load -n M -c 1
-m 1; p50 from --log-file). Figures are medians
over the rounds, so a burst of outside load on a 2-core machine lands on
every case alike. The mirroring proxies print their mirror statistics and
resident memory to their logs every half second; the last figures and the
peak memory are reported, to show the never-read shadow's cost bounded
(``max_in_flight`` shadows, each given up after ``stall_timeout``).

Target: each case's c1 p50 within 1.1x of ``off``; no failed request; the
never-read proxy's memory bounded (its peak RSS under 2x the ``off``
proxy's). The last line is ``verdict: PASS|FAIL ...``.

Run it from the repository root (needs h2load: apt-get install nghttp2-client):

    python bench/mirror.py            # N=20000, M=2000, 5 rounds
    python bench/mirror.py --quick    # N=3000, M=1000, 3 rounds

``python bench/mirror.py --serve ROLE PORT ...`` is the helper mode that
starts one server per process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import HOST, ROOT, Process, Processes, Result, free_port, load_average, measure, serve_role

P50_TARGET = 1.1  # each case's c1 p50 / off's, at most
RSS_TARGET = 2.0  # the never-read proxy's peak RSS / the off proxy's, at most
CASES = ["off", "10% healthy", "100% healthy", "100% never reads"]


# -- helper mode ----------------------------------------------------------------------------


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def serve_mirroring_proxy(port: int, worker: int, replica: int, fraction: float, shadow: list[int]) -> None:
    """A proxy mirroring ``fraction`` to the shadow app (``shadow`` = [worker, replica]) or address ([port])."""
    sys.path.insert(0, str(ROOT))
    import trio

    import blocks

    if len(shadow) == 2:
        setting = blocks.MirrorSetting(to="shadow", fraction=fraction)
    else:
        setting = blocks.MirrorSetting(address=(HOST, shadow[0]), fraction=fraction)
    apps = {"demo": [blocks.Replica(name="r0", worker=(HOST, worker), address=(HOST, replica))]}
    if len(shadow) == 2:
        # the shadow worker knows its replica as r0 (bench/_harness.py); the names are per app here
        apps["shadow"] = [blocks.Replica(name="r0", worker=(HOST, shadow[0]), address=(HOST, shadow[1]))]
    routes = blocks.RouteTable.build({"*": "demo"}, apps, {"demo": blocks.AppSettings(mirror=setting)})

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            _, proxy = await nursery.start(
                functools.partial(blocks.serve_proxy, routes, host=HOST, port=port, mirror=blocks.MirrorConfig())
            )
            while True:
                await trio.sleep(0.5)
                s = proxy.mirror.statistics()
                print(
                    f"mirror sampled={s.sampled} compared={s.compared} matches={s.matches} skipped={s.skipped} "
                    f"timed_out={s.timed_out} failed={s.failed} abandoned={s.abandoned} in_flight={s.in_flight} "
                    f"rss_kib={_rss_kib()}",
                    flush=True,
                )

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run)


def serve_never_reads(port: int) -> None:
    """An h2 server that takes every stream and never reads its body nor answers."""
    sys.path.insert(0, str(ROOT))
    import trio

    import blocks

    async def handler(request: blocks.Request) -> blocks.Response:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    config = blocks.ListenerConfig(max_concurrent_streams=1000, validate=False)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(functools.partial(blocks.serve_http, handler, host=HOST, port=port, config=config))


def serve_rss_proxy(port: int, worker: int, replica: int) -> None:
    """The ``off`` proxy, printing its resident memory like the mirroring ones."""
    sys.path.insert(0, str(ROOT))
    import trio

    import blocks

    routes = blocks.RouteTable.build(
        {"*": "demo"}, {"demo": [blocks.Replica(name="r0", worker=(HOST, worker), address=(HOST, replica))]}
    )

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(blocks.serve_proxy, routes, host=HOST, port=port))
            while True:
                await trio.sleep(0.5)
                print(f"rss_kib={_rss_kib()}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run)


# -- measuring ------------------------------------------------------------------------------


def settle(proxy: Process, timeout: float = 15.0) -> None:
    """Wait until ``proxy`` (mirroring) has no shadow in flight: the copies that the
    throughput run left behind must not land on the latency run that follows."""

    def idle() -> bool:
        lines = proxy.log.read_text(errors="replace").splitlines()
        return not lines or " in_flight=" not in lines[-1] or " in_flight=0 " in lines[-1]

    deadline = time.monotonic() + timeout
    time.sleep(0.6)  # past the proxy's next line (every 0.5 s): a count from after the run
    while not idle() and time.monotonic() < deadline:
        time.sleep(0.2)


def _log_figures(proc: Process) -> tuple[str, int]:
    """The last mirror line of a proxy's log, and the peak RSS (KiB) it printed."""
    last, peak = "", 0
    for line in proc.log.read_text(errors="replace").splitlines():
        if rss := re.search(r"rss_kib=(\d+)", line):
            peak = max(peak, int(rss.group(1)))
            last = line
    return last, peak


def self_argv(*args: object) -> list[str]:
    return [str(Path(__file__).resolve()), "--serve", *map(str, args)]


def run_benchmark(n: int, m: int, rounds: int) -> int:
    if shutil.which("h2load") is None:
        print("h2load not found: install it with `apt-get install nghttp2-client`", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="proxyblocks-mirror-bench-"))
    procs = Processes(tmp)
    print(
        f"h2load: rps with -n {n} -c 8 -m 32, latency with -n {m} -c 1 -m 1 (GET /); {rounds} interleaved rounds, "
        f"medians; {os.cpu_count()} CPUs; logs in {tmp}"
    )
    print(f"load average before: {load_average()}", flush=True)
    samples: dict[str, list[Result]] = {case: [] for case in CASES}
    proxies: dict[str, Process] = {}
    try:

        def start(name: str, *args: object) -> tuple[int, Process]:
            port = free_port()
            return port, procs.start(name, self_argv(args[0], port, *args[1:]), port)

        replica, _ = start("replica", "replica")
        worker, _ = start("worker", "worker", replica)
        shadow_replica, _ = start("shadow replica", "replica")
        shadow_worker, _ = start("shadow worker", "worker", shadow_replica)
        stuck, _ = start("never-read shadow", "noread")
        edges: dict[str, int] = {}
        for case in CASES:
            if case == "off":
                proxy, proc = start("proxy off", "proxy-off", worker, replica)
            elif case == "100% never reads":
                proxy, proc = start("proxy never-read", "proxy-mirror", worker, replica, 1.0, stuck)
            else:
                fraction = 0.1 if case.startswith("10%") else 1.0
                proxy, proc = start(
                    f"proxy {case}", "proxy-mirror", worker, replica, fraction, shadow_worker, shadow_replica
                )
            proxies[case] = proc
            edges[case], _ = start(f"edge {case}", "edge", proxy)
        for round_no in range(rounds):
            order = CASES[round_no % len(CASES) :] + CASES[: round_no % len(CASES)]
            print(f"... round {round_no + 1}/{rounds}", flush=True)
            for case in order:
                sample = measure(
                    case, edges[case], n, m, tmp, warm=round_no == 0, between=functools.partial(settle, proxies[case])
                )
                for proc in procs.all:
                    if (code := proc.popen.poll()) is not None:
                        sample.problems.append(f"{proc.name} exited with {code} during the run:\n{proc.tail()}")
                samples[case].append(sample)
    finally:
        figures = {case: _log_figures(proc) for case, proc in proxies.items()}
        procs.stop_all()
    print(f"load average after: {load_average()}  (other processes on the machine skew the figures)")
    results = {
        case: Result(
            case,
            rps=statistics.median(r.rps for r in runs),
            p50_us=statistics.median(r.p50_us for r in runs),
            p99_us=statistics.median(r.p99_us for r in runs),
            problems=[p for r in runs for p in r.problems],
        )
        for case, runs in samples.items()
    }
    return report(results, figures)


def report(results: dict[str, Result], figures: dict[str, tuple[str, int]]) -> int:
    off = results["off"]
    print()
    header = f"{'case':<20} {'rps (c8 m32)':>12} {'c1 p50 µs':>10} {'c1 p99 µs':>10} {'p50 / off':>10}"
    print(f"{header} {'peak RSS MiB':>13}")
    ratios = {}
    for case, r in results.items():
        ratios[case] = r.p50_us / off.p50_us if off.p50_us else math.nan
        rss = figures.get(case, ("", 0))[1] / 1024
        print(f"{case:<20} {r.rps:>12.0f} {r.p50_us:>10.0f} {r.p99_us:>10.0f} {ratios[case]:>10.2f} {rss:>13.1f}")
    print()
    for case, (last, _) in figures.items():
        if case != "off":
            print(f"{case}: {last.removeprefix('mirror ')}")
    problems = [(r.name, p) for r in results.values() for p in r.problems]
    if problems:
        print("\nPROBLEMS:")
        for case, problem in problems:
            print(f"[{case}] {problem}")
    worst_case = max((c for c in CASES if c != "off"), key=lambda c: ratios[c])
    off_rss, stuck_rss = figures["off"][1], figures["100% never reads"][1]
    rss_ratio = stuck_rss / off_rss if off_rss else math.nan
    ok = all(ratios[c] <= P50_TARGET for c in CASES) and rss_ratio <= RSS_TARGET and not problems
    text = ", ".join(f"{c} {ratios[c]:.2f}x" for c in CASES if c != "off")
    figures_text = (
        f"c1 p50 vs off: {text} (target <= {P50_TARGET}x each; worst {worst_case}); "
        f"never-read proxy peak RSS {rss_ratio:.2f}x the off proxy's (target <= {RSS_TARGET}x)"
    )
    if problems:
        figures_text += f", failed requests or dead processes in: {', '.join(sorted({c for c, _ in problems}))}"
    print(f"verdict: {'PASS' if ok else 'FAIL'} {figures_text}")
    return 0 if ok else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        role, port, rest = sys.argv[2], int(sys.argv[3]), sys.argv[4:]
        if role == "proxy-mirror":
            serve_mirroring_proxy(port, int(rest[0]), int(rest[1]), float(rest[2]), [int(p) for p in rest[3:]])
        elif role == "proxy-off":
            serve_rss_proxy(port, int(rest[0]), int(rest[1]))
        elif role == "noread":
            serve_never_reads(port)
        else:
            serve_role(role, port, [int(p) for p in rest])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000, help="requests for the rps run (default 20000)")
    parser.add_argument("-m", type=int, default=2000, help="requests for the c1 latency run (default 2000)")
    parser.add_argument("--quick", action="store_true", help="rps run with -n 3000, latency with -m 1000, 3 rounds")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are medians (default 5)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.quick:
            return run_benchmark(3000, 1000, 3)
        return run_benchmark(args.n, args.m, max(1, args.rounds))
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
