"""Processes per hop: the chain recipe with ``--processes 2`` against one process, side by side.

What it measures, over h2c on 127.0.0.1:

    1 process     python -m recipes.chain                 (edge, proxy, worker and 2 demo
                                                           replicas in one trio process)
    2 processes   python -m recipes.chain --processes 2   (two such processes sharing the edge
                                                           port with SO_REUSEPORT, under a parent)

Both run for the whole benchmark, each with an admin port (so the figures
can say which process served what) and a route file it follows. Rounds
visit both in turn, in a rotated order: throughput with ``h2load -D S -c C
-m M`` (a fixed duration, not a fixed count: a process whose connections
finish early would otherwise idle while the other works), then
one-request-at-a-time latency (``h2load -n N -c 1 -m 1``, p50 and p99 from
its --log-file). Figures are medians over the rounds. For each throughput
run it also reports the CPU the chain's processes and h2load used (cores,
over the run's wall time) and the busiest process's share of the requests
(the kernel spreads connections by a hash of their addresses, not evenly).

For information, each round also loads two one-process chains at once, each
with an h2load of its own (``-c C/2``): two chains that share nothing but the
machine, the most ``--processes 2`` could reach here.

Then, for each target, a route file edit: a new domain routed to a new app;
the time from the file's replacement until every process has answered a
request for that domain by the new route (requests on new connections, so
each lands on a process the kernel picks; counted per process in the merged
``/metrics``).

Targets: 2 processes rps >= 1.8x 1 process (two independent one-process
chains reach 1.93x on a 2-core machine); c1 p50 of 2 processes <= 1.05x of
1 process. The last line is ``verdict: PASS|FAIL ...``.

Run it from the repository root (needs h2load: apt-get install nghttp2-client):

    python bench/_scale_processes.py              # -D 10, 3 rounds, -m 2000
    python bench/_scale_processes.py --quick      # -D 4, 2 rounds, -m 1000

``bench/scale.py`` calls :func:`run_scale_processes` and prints its report.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import math
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import HOST, ROOT, Process, Processes, free_port, h2load, latencies, load_average, percentile

RPS_TARGET = 1.8
"""2 processes' rps / 1 process's, at least."""
P50_TARGET = 1.05
"""2 processes' c1 p50 / 1 process's, at most."""
TARGETS = {"1 process": 1, "2 processes": 2}
APART = "2 chains apart"
"""For information: two one-process chains, each loaded by an h2load of its own at once (the ceiling)."""


@dataclass
class Target:
    """One running chain recipe: its process (the parent, with 2), the ports, the route file."""

    name: str
    count: int
    process: Process
    port: int
    admin: int
    routes: Path
    pids: list[int] = field(default_factory=list)
    worker: str = ""
    replica: str = ""


@dataclass
class Run:
    """One throughput run: rps, the cores the chain and h2load used, the busiest process's share."""

    rps: float
    chain_cores: float
    h2load_cores: float
    busiest: float
    problems: list[str]


@dataclass
class Figures:
    """A target's figures, medians over the rounds, and how long a route change took to reach all."""

    name: str
    rps: float = math.nan
    p50_us: float = math.nan
    p99_us: float = math.nan
    chain_cores: float = math.nan
    h2load_cores: float = math.nan
    busiest: float = math.nan
    propagation_s: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class ScaleReport:
    """What :func:`run_scale_processes` measured: a table, two ratios and a verdict."""

    figures: dict[str, Figures]
    header: list[str]

    @property
    def rps_ratio(self) -> float:
        return _ratio(self.figures["2 processes"].rps, self.figures["1 process"].rps)

    @property
    def p50_ratio(self) -> float:
        return _ratio(self.figures["2 processes"].p50_us, self.figures["1 process"].p50_us)

    @property
    def problems(self) -> list[str]:
        return [f"[{f.name}] {p}" for f in self.figures.values() for p in f.problems]

    @property
    def ok(self) -> bool:
        return self.rps_ratio >= RPS_TARGET and self.p50_ratio <= P50_TARGET and not self.problems

    def lines(self) -> list[str]:
        """The table and the ratios (without the verdict line)."""
        out = [*self.header, ""]
        out.append(
            f"{'target':<14} {'rps':>8} {'c1 p50 µs':>10} {'c1 p99 µs':>10} {'chain cores':>12} "
            f"{'h2load cores':>13} {'busiest':>8} {'route change s (each run)':>26}"
        )
        for f in self.figures.values():
            changes = " ".join(f"{seconds:.2f}" for seconds in f.propagation_s) or "-"
            out.append(
                f"{f.name:<14} {f.rps:>8.0f} {f.p50_us:>10.0f} {f.p99_us:>10.0f} {f.chain_cores:>12.2f} "
                f"{f.h2load_cores:>13.2f} {f.busiest:>8.0%} {changes:>26}"
            )
        out.append("")
        out.append(f"rps 2 processes / 1 process:    {self.rps_ratio:.2f}  (target >= {RPS_TARGET})")
        out.append(f"c1 p50 2 processes / 1 process: {self.p50_ratio:.2f}  (target <= {P50_TARGET})")
        if APART in self.figures and not math.isnan(self.figures[APART].rps):
            apart = self.figures[APART]
            out.append(
                f"for information: two one-process chains apart, each with an h2load of its own, "
                f"{_ratio(apart.rps, self.figures['1 process'].rps):.2f}x 1 process; 2 processes reach "
                f"{_ratio(self.figures['2 processes'].rps, apart.rps):.2f}x of that"
            )
        one, two = self.figures["1 process"], self.figures["2 processes"]
        if not math.isnan(two.chain_cores):
            out.append(
                f"cores in use during the rps runs: 1 process {one.chain_cores + one.h2load_cores:.2f} "
                f"(chain {one.chain_cores:.2f} + h2load {one.h2load_cores:.2f}), 2 processes "
                f"{two.chain_cores + two.h2load_cores:.2f} (chain {two.chain_cores:.2f} + h2load "
                f"{two.h2load_cores:.2f}) of {os.cpu_count()}"
            )
            per_core_one = _ratio(one.rps, one.chain_cores)
            per_core_two = _ratio(two.rps, two.chain_cores)
            out.append(
                f"rps per chain core: 1 process {per_core_one:.0f}, 2 processes {per_core_two:.0f} "
                f"({_ratio(per_core_two, per_core_one):.2f}x); the ratio the cores left for the chain allow: "
                f"{_ratio(two.chain_cores, one.chain_cores) * _ratio(per_core_two, per_core_one):.2f}"
            )
        if self.problems:
            out.append("PROBLEMS:")
            out += [f"  {p}" for p in self.problems]
        return out

    def verdict(self) -> str:
        one, two = self.figures["1 process"], self.figures["2 processes"]
        reach = max(two.propagation_s, default=math.nan)
        figures = (
            f"rps ratio {self.rps_ratio:.2f} (target >= {RPS_TARGET}), c1 p50 ratio {self.p50_ratio:.2f} "
            f"(target <= {P50_TARGET}); a route change reached both processes within {reach:.2f}s "
            f"(one process: {max(one.propagation_s, default=math.nan):.2f}s)"
        )
        if self.problems:
            figures += f", {len(self.problems)} problems (target: none)"
        return f"verdict: {'PASS' if self.ok else 'FAIL'} {figures}"


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def _wait_for_line(proc: Process, pattern: str, timeout: float = 30.0) -> re.Match[str]:
    compiled = re.compile(pattern, re.MULTILINE)
    deadline = time.monotonic() + timeout
    while (match := compiled.search(proc.log.read_text(errors="replace"))) is None:
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not print {pattern!r}:\n{proc.tail()}")
        time.sleep(0.05)
    return match


def _cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return math.nan
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _get(port: int, path: str, host: str | None = None) -> tuple[int, str]:
    """``GET path`` on a new connection: (status, body)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        connection.request("GET", path, headers={"host": host or f"{HOST}:{port}"})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def _counts(target: Target, hop: str, app: str | None = None) -> dict[str, float]:
    """2xx answers of ``hop`` (of ``app``) by process (``"0"`` for a single process), from ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = _get(target.admin, "/metrics")
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name != "proxyblocks_requests_total" or labels.get("hop") != hop:
                continue
            if labels.get("status_class") == "2xx" and (app is None or labels.get("app") == app):
                process = labels.get("process", "0")
                counts[process] = counts.get(process, 0.0) + sample.value
    return counts


def _start(procs: Processes, name: str, count: int, tmp: Path) -> Target:
    port, admin = free_port(), free_port()
    routes = tmp / f"routes-{re.sub(r'[^a-z0-9]+', '-', name)}.toml"
    routes.write_text("[domains]\n")
    argv = ["-m", "recipes.chain", "--port", str(port), "--admin-port", str(admin), "--routes", str(routes)]
    argv += ["--processes", str(count)] if count > 1 else []
    process = procs.start(name, argv, port)
    _wait_for_line(process, r"^admin listening on ")
    target = Target(name, count, process, port, admin, routes)
    if count > 1:
        target.pids = [int(pid) for pid in _wait_for_line(process, r"^processes: ([\d ]+) \(").group(1).split()]
    else:
        target.pids = [process.popen.pid]
    target.worker = _wait_for_line(process, r"^worker listening on h2c://(\S+)$").group(1)
    target.replica = _wait_for_line(process, r"^replica replica-0 listening on h2c://(\S+)$").group(1)
    return target


def _throughput(target: Target, duration: float, connections: int, streams: int, verbose: bool) -> Run:
    before_counts = _counts(target, "edge")
    before_cpu, before_h2load, began = _cpu(target.pids), _children_cpu(), time.monotonic()
    args = ["-D", f"{duration:g}", "-c", str(connections), "-m", str(streams), "-t", "1"]
    out, problems = h2load(target.port, args, timeout=duration + 60)
    wall = time.monotonic() - began
    chain_cores = (_cpu(target.pids) - before_cpu) / wall
    h2load_cores = (_children_cpu() - before_h2load) / wall
    if verbose:
        print(out)
    finished = re.search(r"finished in \S+, ([\d.]+) req/s", out)
    after = _counts(target, "edge")
    served = [after.get(p, 0.0) - before_counts.get(p, 0.0) for p in after]
    busiest = max(served) / sum(served) if sum(served) else math.nan
    rps = float(finished.group(1)) if finished else math.nan
    return Run(rps, chain_cores, h2load_cores, busiest, problems)


def _settle(targets: list[Target], timeout: float = 5.0) -> None:
    """Wait until ``targets`` are idle (under 0.05 cores over 0.1 s, at most ``timeout`` s): a run
    over a duration ends with its last streams in flight, which the chain then cancels."""
    pids = [pid for target in targets for pid in target.pids]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = _cpu(pids)
        time.sleep(0.1)
        if not _cpu(pids) - before >= 0.005:
            return


def _throughput_apart(targets: list[Target], duration: float, connections: int, streams: int, verbose: bool) -> Run:
    """Both ``targets`` at once, each with its own h2load of ``connections / 2``: two chains that share
    nothing but the machine (what ``--processes 2`` at best reaches)."""
    pids = [pid for target in targets for pid in target.pids]
    before_cpu, before_h2load, began = _cpu(pids), _children_cpu(), time.monotonic()
    args = ["-D", f"{duration:g}", "-c", str(max(1, connections // 2)), "-m", str(streams), "-t", "1"]
    with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
        outs = list(pool.map(lambda target: h2load(target.port, args, timeout=duration + 60), targets))
    wall = time.monotonic() - began
    rates, problems = [], []
    for out, trouble in outs:
        if verbose:
            print(out)
        finished = re.search(r"finished in \S+, ([\d.]+) req/s", out)
        rates.append(float(finished.group(1)) if finished else math.nan)
        problems += trouble
    busiest = max(rates) / sum(rates) if sum(rates) else math.nan
    return Run(
        sum(rates), (_cpu(pids) - before_cpu) / wall, (_children_cpu() - before_h2load) / wall, busiest, problems
    )


def _propagation(target: Target, round_no: int, timeout: float = 20.0) -> tuple[float, list[str]]:
    """Seconds from replacing the route file until every process answered by its new route."""
    domain, app = f"new{round_no}.example", f"other{round_no}"
    staged = target.routes.with_suffix(".new")
    lines = [
        "[domains]",
        *(f'"new{i}.example" = "other{i}"' for i in range(round_no + 1)),
        *(
            f'[apps.other{i}.replicas.b]\nworker = "{target.worker}"\naddress = "{target.replica}"\nprotocol = "h2"'
            for i in range(round_no + 1)
        ),
    ]
    staged.write_text("\n".join(lines) + "\n")
    began = time.monotonic()
    staged.replace(target.routes)
    wanted = {str(i) for i in range(target.count)}
    while time.monotonic() - began < timeout:
        status, _ = _get(target.port, "/", host=domain)
        if status != 200:
            return math.nan, [f"{domain}: {status}"]
        if {p for p, n in _counts(target, "proxy", app).items() if n} >= wanted:
            return time.monotonic() - began, []
        time.sleep(0.01)
    return math.nan, [f"{domain} did not reach every process within {timeout:g}s"]


def run_scale_processes(
    *,
    duration: float = 10.0,
    m: int = 2000,
    rounds: int = 3,
    connections: int = 8,
    streams: int = 32,
    changes: int = 3,
    verbose: bool = False,
) -> ScaleReport:
    """Start both targets, measure them in interleaved rounds, stop them: the report."""
    tmp = Path(tempfile.mkdtemp(prefix="proxyblocks-bench-scale-"))
    header = [
        f"h2load: rps with -D {duration:g} -c {connections} -m {streams} -t 1, latency with -n {m} -c 1 -m 1; "
        f"{rounds} interleaved rounds, medians; {os.cpu_count()} CPUs; logs in {tmp}",
        f"load average before: {load_average()}",
    ]
    procs = Processes(tmp)
    figures = {name: Figures(name) for name in [*TARGETS, APART]}
    try:
        targets = {name: _start(procs, name, count, tmp) for name, count in TARGETS.items()}
        second = _start(procs, "1 process again", 1, tmp)  # (with "1 process": two chains apart)
        h2load(second.port, ["-n", "2000", "-c", "8", "-m", "32"], timeout=60)  # warm up
        for target in targets.values():
            h2load(target.port, ["-n", "2000", "-c", "8", "-m", "32"], timeout=60)  # warm up
        runs: dict[str, list[tuple[Run, float, float]]] = {name: [] for name in [*TARGETS, APART]}
        names = list(TARGETS)
        for round_no in range(rounds):
            print(f"... round {round_no + 1}/{rounds}", flush=True)
            for name in names[round_no % 2 :] + names[: round_no % 2]:
                target = targets[name]
                run = _throughput(target, duration, connections, streams, verbose)
                _settle([target])
                elapsed, problems = latencies(target.port, m, tmp, verbose=verbose)
                elapsed.sort()
                run.problems += problems
                runs[name].append((run, percentile(elapsed, 0.5), percentile(elapsed, 0.99)))
            apart = _throughput_apart([targets["1 process"], second], duration, connections, streams, verbose)
            _settle([targets["1 process"], second])
            runs[APART].append((apart, math.nan, math.nan))
        for i in range(changes):
            for name, target in targets.items():
                seconds, problems = _propagation(target, i)
                figures[name].propagation_s.append(seconds)
                figures[name].problems += problems
        for name, target in targets.items():
            if (code := target.process.popen.poll()) is not None:
                figures[name].problems.append(f"{name} exited with {code} during the run")
    finally:
        procs.stop_all()
    header.append(f"load average after: {load_average()}  (other processes on the machine skew the figures)")
    for name, taken in runs.items():
        f = figures[name]
        f.rps = statistics.median(run.rps for run, _, _ in taken)
        f.p50_us = statistics.median(p50 for _, p50, _ in taken)
        f.p99_us = statistics.median(p99 for _, _, p99 in taken)
        f.chain_cores = statistics.median(run.chain_cores for run, _, _ in taken)
        f.h2load_cores = statistics.median(run.h2load_cores for run, _, _ in taken)
        f.busiest = statistics.median(run.busiest for run, _, _ in taken)
        f.problems += [p for run, _, _ in taken for p in run.problems]
    return ScaleReport(figures, header)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-D", "--duration", type=float, default=10.0, help="seconds per rps run (default 10)")
    parser.add_argument("-m", type=int, default=2000, help="requests for the c1 latency run (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians (default 3)")
    parser.add_argument("-c", "--connections", type=int, default=8, help="h2load connections (default 8)")
    parser.add_argument("--streams", type=int, default=32, help="h2load streams per connection (default 32)")
    parser.add_argument("--quick", action="store_true", help="-D 4, -m 1000, 2 rounds")
    parser.add_argument("-v", "--verbose", action="store_true", help="print h2load's output")
    args = parser.parse_args(argv)
    if shutil.which("h2load") is None:
        print("h2load not found: install it with `apt-get install nghttp2-client`", file=sys.stderr)
        return 2
    if args.quick:
        args.duration, args.m, args.rounds = 4.0, 1000, 2
    report = run_scale_processes(
        duration=args.duration,
        m=args.m,
        rounds=max(1, args.rounds),
        connections=args.connections,
        streams=args.streams,
        verbose=args.verbose,
    )
    print("\n".join(report.lines()))
    print(report.verdict())
    return 0 if report.ok else 1


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
