"""The cost of mirroring to the primary: the chain's rps and c1 p50 with the mirror tee off and on.

What it measures, over h2c on 127.0.0.1, every server a separate OS process:

    off                 edge -> proxy (no mirror) -> worker -> replica
    10% healthy         the same proxy mirroring 10 % of requests to a healthy shadow
    100% healthy        mirroring every request to it
    100% never reads    mirroring every request to a server that opens the connection and never reads a byte
    100% to an app on these cores   (for information) mirroring every request to a
                        shadow app of the same make as the primary: a worker and a demo replica

The healthy shadow is nghttpd (Debian's nghttp2-server, in C), answering
``GET /`` with the demo replica's body and content type, so the pairs
compare as matches. It stands for what a shadow is in production: a
deployment on hardware of its own. Here everything shares two cores, and at
one request at a time the primary chain is a row of Python processes that
keeps about one of them busy; a Python shadow app (worker and replica,
about as much CPU per request as the primary's own) at 100 % doubles the
machine's CPU demand, and the primary pays for that CPU whatever the tee
does. The last case shows that cost, beside the target. What the tee itself
costs shows in the proxy's CPU per request during the latency run, printed
for every case.

Each case is its own edge and proxy in front of the same primary worker and
replica (started once and kept up), so the only difference is the proxy's
mirror. Each round (the cases in a rotated order) measures every case's
throughput in turn (h2load -n N -c 8 -m 32, req/s); then, once the
shadows those runs left behind are done, one-request-at-a-time latency
(h2load -c 1 -m 1, M requests per case; p50 and p99 from --log-file) in
eight slices that take turns, so that a drift of the machine's speed lands
on every case alike. Figures are medians over the rounds. The proxy's CPU
per request (user and system, from /proc) is taken over its latency
slices. The mirroring proxies print their mirror statistics and
resident memory to their logs every half second; the last figures and the
peak memory are reported, to show the never-read shadow's cost bounded
(``max_in_flight`` shadows, each given up after ``stall_timeout``).

Target: the c1 p50 of each case but the last within 1.1x of ``off``; no
failed request; the never-read proxy's memory bounded (its peak RSS under
2x the ``off`` proxy's). The last line is ``verdict: PASS|FAIL ...``.

Run it from the repository root (needs h2load and nghttpd:
apt-get install nghttp2-client nghttp2-server):

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
from dataclasses import dataclass
from pathlib import Path

from _harness import (
    HOST,
    ROOT,
    WARMUP,
    Process,
    Processes,
    Result,
    cpu_seconds,
    free_port,
    h2load,
    latencies,
    load_average,
    percentile,
    serve_role,
    throughput,
)

P50_TARGET = 1.1  # each case's c1 p50 / off's, at most
RSS_TARGET = 2.0  # the never-read proxy's peak RSS / the off proxy's, at most
SLICES = 8  # each round's latency run, per case, in this many turns
CASES = ["off", "10% healthy", "100% healthy", "100% never reads"]  # the target applies to each
SHARED = "100% to an app on these cores"  # for information


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
        setting = blocks.routing.MirrorSetting(to="shadow", fraction=fraction)
    else:
        setting = blocks.routing.MirrorSetting(address=(HOST, shadow[0]), fraction=fraction)
    apps = {"demo": [blocks.Replica(name="r0", worker=(HOST, worker), address=(HOST, replica))]}
    if len(shadow) == 2:
        # the shadow worker knows its replica as r0 (bench/_harness.py); the names are per app here
        apps["shadow"] = [blocks.Replica(name="r0", worker=(HOST, shadow[0]), address=(HOST, shadow[1]))]
    routes = blocks.RouteTable.build({"*": "demo"}, apps, {"demo": blocks.routing.AppSettings(mirror=setting)})

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
    """A TCP server that opens each connection as HTTP/2 and then never reads a byte of it, nor answers.

    Its preface (an empty SETTINGS frame) makes the connection usable, so
    the copies' streams open and their heads go out, into a socket nobody
    reads: the tee's every bound at work, and no CPU of this machine spent
    on the shadow's side.
    """
    import trio

    async def hold(stream: trio.SocketStream) -> None:
        await stream.send_all(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # SETTINGS, no parameters (RFC 9113 6.5)
        await trio.sleep_forever()

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(functools.partial(trio.serve_tcp, hold, port, host=HOST))


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


def nghttpd_argv(port: int, htdocs: Path) -> list[str]:
    """nghttpd on h2c ``port``, answering ``GET /`` as the demo replica does (body and content type)."""
    htdocs.mkdir()
    (htdocs / "index.html").write_bytes(b"hello from r0\n")  # the demo replica r0's answer (blocks/testing/_demo.py)
    mime_types = htdocs.parent / "mime.types"
    mime_types.write_text("text/plain html\n")
    return ["nghttpd", "--no-tls", f"--htdocs={htdocs}", f"--mime-types-file={mime_types}", str(port)]


def self_argv(*args: object) -> list[str]:
    return [str(Path(__file__).resolve()), "--serve", *map(str, args)]


@dataclass
class Sample(Result):
    """One case's figures (of a round, or the medians over the rounds), with its proxy's CPU."""

    proxy_cpu_us: float = math.nan  # per request, during the latency runs


def measure_round(
    order: list[str], edges: dict[str, int], proxies: dict[str, Process], n: int, m: int, tmp: Path, warm: bool
) -> list[Sample]:
    """Every case's throughput in turn; once every proxy has settled, the latency runs, in
    ``SLICES`` slices that take turns, so that a drift of the machine's speed lands on every
    case alike. Each case's p50 and p99 are over the requests of all its slices."""
    samples = [Sample(case) for case in order]
    for sample in samples:
        port = edges[sample.name]
        if warm:
            sample.problems += h2load(port, WARMUP, timeout=60)[1]
        sample.rps, problems = throughput(port, n)
        sample.problems += problems
    for case in order:
        settle(proxies[case])
    elapsed: list[list[int]] = [[] for _ in order]
    cpu = [0.0 for _ in order]
    for _ in range(SLICES):
        for i, sample in enumerate(samples):
            proxy = proxies[sample.name]
            before = cpu_seconds(proxy)
            times, problems = latencies(edges[sample.name], m // SLICES, tmp)
            cpu[i] += cpu_seconds(proxy) - before
            elapsed[i] += times
            sample.problems += problems
    for sample, times, seconds in zip(samples, elapsed, cpu, strict=True):
        times.sort()
        sample.p50_us = percentile(times, 0.50)
        sample.p99_us = percentile(times, 0.99)
        sample.proxy_cpu_us = seconds / max(1, len(times)) * 1e6
    return samples


def run_benchmark(n: int, m: int, rounds: int) -> int:
    for tool, package in (("h2load", "nghttp2-client"), ("nghttpd", "nghttp2-server")):
        if shutil.which(tool) is None:
            print(f"{tool} not found: install it with `apt-get install {package}`", file=sys.stderr)
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="proxyblocks-mirror-bench-"))
    procs = Processes(tmp)
    print(
        f"h2load: rps with -n {n} -c 8 -m 32, latency with -n {m} -c 1 -m 1 (GET /); {rounds} interleaved rounds, "
        f"medians; {os.cpu_count()} CPUs; logs in {tmp}"
    )
    print(f"load average before: {load_average()}", flush=True)
    cases = [*CASES, SHARED]
    samples: dict[str, list[Sample]] = {case: [] for case in cases}
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
        healthy = free_port()
        procs.start("healthy shadow (nghttpd)", nghttpd_argv(healthy, tmp / "htdocs"), healthy, python=False)
        edges: dict[str, int] = {}
        for case in cases:
            if case == "off":
                proxy, proc = start("proxy off", "proxy-off", worker, replica)
            elif case == "100% never reads":
                proxy, proc = start("proxy never-read", "proxy-mirror", worker, replica, 1.0, stuck)
            elif case == SHARED:
                proxy, proc = start("proxy app", "proxy-mirror", worker, replica, 1.0, shadow_worker, shadow_replica)
            else:
                fraction = 0.1 if case.startswith("10%") else 1.0
                proxy, proc = start(f"proxy {case}", "proxy-mirror", worker, replica, fraction, healthy)
            proxies[case] = proc
            edges[case], _ = start(f"edge {case}", "edge", proxy)
        for round_no in range(rounds):
            order = cases[round_no % len(cases) :] + cases[: round_no % len(cases)]
            print(f"... round {round_no + 1}/{rounds}", flush=True)
            for case, sample in zip(order, measure_round(order, edges, proxies, n, m, tmp, round_no == 0), strict=True):
                for proc in procs.all:
                    if (code := proc.popen.poll()) is not None:
                        sample.problems.append(f"{proc.name} exited with {code} during the run:\n{proc.tail()}")
                samples[case].append(sample)
    finally:
        figures = {case: _log_figures(proc) for case, proc in proxies.items()}
        procs.stop_all()
    print(f"load average after: {load_average()}  (other processes on the machine skew the figures)")
    results = {
        case: Sample(
            case,
            rps=statistics.median(r.rps for r in runs),
            p50_us=statistics.median(r.p50_us for r in runs),
            p99_us=statistics.median(r.p99_us for r in runs),
            problems=[p for r in runs for p in r.problems],
            proxy_cpu_us=statistics.median(r.proxy_cpu_us for r in runs),
        )
        for case, runs in samples.items()
    }
    return report(results, figures)


def report(results: dict[str, Sample], figures: dict[str, tuple[str, int]]) -> int:
    off = results["off"]
    print()
    header = f"{'case':<30} {'rps (c8 m32)':>12} {'c1 p50 µs':>10} {'c1 p99 µs':>10} {'p50 / off':>10}"
    print(f"{header} {'proxy CPU µs/req (c1)':>22} {'peak RSS MiB':>13}")
    ratios = {}
    for case, r in results.items():
        ratios[case] = r.p50_us / off.p50_us if off.p50_us else math.nan
        rss = figures.get(case, ("", 0))[1] / 1024
        print(
            f"{case:<30} {r.rps:>12.0f} {r.p50_us:>10.0f} {r.p99_us:>10.0f} {ratios[case]:>10.2f} "
            f"{r.proxy_cpu_us:>22.0f} {rss:>13.1f}"
        )
    print("(the last row is for information: its shadow app's CPU comes out of the primary's two cores)\n")
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
