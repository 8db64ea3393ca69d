"""What the fair scheduler costs and what it buys: admission cost, a quiet tenant's latency, chain throughput.

Three measurements, in one run:

1. Admission cost, in this process before any server starts: microseconds
   per decision, best of several repeats, rotating over 10 and over 10,000
   tenants, for

       FairQueue.try_acquire + release          the sans-IO core's hot path
       Scheduler.try_acquire + release          the trio driver (in trio.run, via open_scheduler)
       FairQueue.enqueue + release (budget 1)   the queued path: every decision waits in a
                                                queue and is granted by the release before it

   Target: at most 10 µs per decision on this machine, for every path and
   both tenant counts (the verdict takes the worst).

2. Tenant B's latency, over the chain edge -> proxy -> worker -> demo replica
   (one OS process per hop, h2c on 127.0.0.1). Each tenant is a client
   process of its own, with its own connection, as two tenants are (the
   library's own h2 client, as in ``recipes/noisy_neighbour.py``): sharing
   one would measure a client busy with A's answers, not the chain. Tenant
   B (``x-tenant: quiet``) sends ``--rate`` requests per second to
   ``/sleep?ms=20`` for ``--seconds``:

       (a) alone,                               proxy with the scheduler on
       (b) while tenant A keeps --flood requests in flight, scheduler on
       (c) under the same flood,                proxy without a scheduler

   The scheduler is ``recipes.noisy_neighbour.SCHEDULER`` (budget 8, at
   most 6 in flight per tenant, 128 queued for 0.5 s: sized to what the
   chain serves, see docs/scheduler.md). It prints B's p50
   and p99 in each, A's statuses (200/429/503), and the headline, B's p99
   under the flood over its p99 alone (target <= 2), with (c)/(a) beside it
   for comparison. Every B request must get an answer, and in (a) and (b)
   that answer must be a 200.

3. Chain throughput with the scheduler on (``recipes.chain.FAIR``: budget
   512, 256 in flight per tenant, 512 queued for 5 s, so h2load's 256
   streams of one tenant are admitted, never refused: this measures what
   admission costs) and off: ``h2load -n N
   -c 8 -m 32 -H 'x-tenant: a'`` against each chain's edge, in interleaved
   rounds, medians (as bench/chain.py does). Target: on / off >= 0.95. Any
   failed or non-2xx request fails this part.

The last line is ``verdict: PASS|FAIL <figures vs targets>``; PASS needs
all three targets met and nothing failed (no failed request, no dead hop).
Only the ratios from one run mean much: absolute figures drift with the
machine, and on a 2-core machine every hop, h2load and the load generator
share two cores (the load average before and after is printed).

Run it from the repository root (needs h2load: apt-get install nghttp2-client):

    python bench/fairness.py            # 10 s per latency scenario, N=20000, 5 rounds
    python bench/fairness.py --quick    # 5 s per scenario, N=3000, 3 rounds, fewer decisions
    python bench/fairness.py --seconds 30 --flood 256 --rate 20

``python bench/fairness.py --serve ROLE PORT [UPSTREAM_PORT...] [--scheduler small|fair|off]``
is the helper mode that runs one hop per process; ``--serve load EDGE_PORT
--seconds S --flood N`` is tenant A's client and ``--serve load EDGE_PORT
--seconds S --rate R --settle W`` tenant B's (each prints one JSON line).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _harness import HOST, ROOT, Process, Processes, free_port, h2load, load_average, percentile, serve_role

ADMISSION_TARGET_US = 10.0  # µs per admission decision, at most, for 10 and 10,000 tenants
P99_TARGET = 2.0  # B's p99 under A's flood / B's p99 alone (scheduler on), at most
RPS_TARGET = 0.95  # chain rps with the scheduler on / off, at least
TENANT_COUNTS = (10, 10_000)
TENANT_HEADER = ["-H", "x-tenant: a"]
WARMUP = ["-n", "500", "-c", "8", "-m", "32", *TENANT_HEADER]
FLOOD_SETTLE = 1.0  # seconds A floods before B starts, so B meets a flood in full swing
STARTUP = 1.5  # seconds a client process may take to start, added to B's wait for A's flood
FLOOD_TAIL = 3.0  # seconds A floods on after B's last request was sent, while B's last answers come back
REQUEST_TIMEOUT = 10.0  # a B request with no answer by then counts as NO_ANSWER
NO_RESPONSE = 0  # status recorded when the client got an error instead of a response
NO_ANSWER = -1  # status recorded when nothing came back within REQUEST_TIMEOUT
SCHEDULERS = ("small", "fair", "off")  # recipes.noisy_neighbour.SCHEDULER, recipes.chain.FAIR, none


def _import_project() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# -- 1. admission cost, in process -------------------------------------------------------------


@dataclass
class Admission:
    path: str
    us: dict[int, float]  # tenant count -> best µs per decision


def rotation(count: int, decisions: int) -> tuple[list[str], list[str]]:
    """``count`` tenant names, and about ``decisions`` of them in round-robin order."""
    names = [f"tenant-{i}" for i in range(count)]
    return names, names * max(1, decisions // count)


def time_fair_queue_try(count: int, decisions: int, repeats: int) -> float:
    _import_project()
    from blocks.scheduler import FairQueue
    from recipes.chain import FAIR

    names, order = rotation(count, decisions)
    queue = FairQueue(FAIR)
    try_acquire, release = queue.try_acquire, queue.release
    for name in names:  # every tenant known before the clock starts: the steady state
        release(try_acquire(name), 0.0)  # type: ignore[arg-type]  # None would fail loudly here
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for name in order:
            release(try_acquire(name), 0.0)  # type: ignore[arg-type]
        best = min(best, time.perf_counter() - start)
    stats = queue.statistics()
    assert stats.granted == len(names) + repeats * len(order) and stats.in_flight == 0, stats
    return best / len(order) * 1e6


def time_scheduler_try(count: int, decisions: int, repeats: int) -> float:
    _import_project()
    import trio

    from blocks.scheduler import open_scheduler
    from recipes.chain import FAIR

    names, order = rotation(count, decisions)

    async def run() -> float:
        async with open_scheduler(FAIR) as scheduler:
            try_acquire, release = scheduler.try_acquire, scheduler.release
            for name in names:
                release(try_acquire(name))  # type: ignore[arg-type]
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                for name in order:
                    release(try_acquire(name))  # type: ignore[arg-type]
                best = min(best, time.perf_counter() - start)
            stats = scheduler.statistics()
            assert stats.granted == len(names) + repeats * len(order) and stats.in_flight == 0, stats
            return best

    return trio.run(run) / len(order) * 1e6


def time_fair_queue_queued(count: int, decisions: int, repeats: int) -> float:
    """enqueue + release with a budget of one slot: every decision goes through a queue and the DRR."""
    _import_project()
    from blocks import SchedulerConfig, TenantPolicy
    from blocks.scheduler import FairQueue

    # A short queue_timeout and an expire() call per chunk, as the driver's
    # expiry task does, so the deadline heap is trimmed and its pops are paid
    # for in the figure. No ticket waits past its own decision, so none expires.
    config = SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=64, queue_timeout=0.01))
    chunk = 256
    names, order = rotation(count, decisions)
    chunks = [order[i : i + chunk] for i in range(0, len(order), chunk)]
    clock = time.perf_counter
    best = math.inf
    for _ in range(repeats):
        queue = FairQueue(config)
        enqueue, release, expire = queue.enqueue, queue.release, queue.expire
        grant = queue.try_acquire(names[-1])
        for name in names:  # every tenant known before the clock starts
            enqueue(name, clock())
            (ticket,) = release(grant, clock())  # type: ignore[arg-type]
            grant = ticket.grant
        start = clock()
        for names_chunk in chunks:
            for name in names_chunk:
                now = clock()
                enqueue(name, now)
                (ticket,) = release(grant, now)  # type: ignore[arg-type]  # exactly one waiter granted
                grant = ticket.grant
            expire(clock())
        best = min(best, clock() - start)
        assert queue.queued == 0 and queue.in_flight == 1, queue
    return best / len(order) * 1e6


def measure_admission(decisions: int, repeats: int) -> list[Admission]:
    paths: list[tuple[str, Callable[[int, int, int], float]]] = [
        ("FairQueue try_acquire + release", time_fair_queue_try),
        ("Scheduler try_acquire + release (trio)", time_scheduler_try),
        ("FairQueue enqueue + release, queued", time_fair_queue_queued),
    ]
    return [
        Admission(name, {count: timer(count, decisions, repeats) for count in TENANT_COUNTS}) for name, timer in paths
    ]


def print_admission(results: list[Admission], decisions: int, repeats: int) -> float:
    print(f"\n1. admission cost, µs per decision (best of {repeats} x ~{decisions} decisions)")
    print(f"{'path':<44}" + "".join(f"{f'{count} tenants':>16}" for count in TENANT_COUNTS))
    for result in results:
        print(f"{result.path:<44}" + "".join(f"{result.us[count]:>16.2f}" for count in TENANT_COUNTS))
    worst = max(us for result in results for us in result.us.values())
    print(f"worst: {worst:.2f} µs per decision (target <= {ADMISSION_TARGET_US:g})", flush=True)
    return worst


# -- helper mode: one hop, or the load generator, in this process -----------------------------


def serve(role: str, port: int, upstream: list[int], scheduler_name: str) -> None:
    """Run one hop (see ``_harness.serve_role``) with the named scheduler at the proxy."""
    _import_project()
    from recipes.chain import FAIR
    from recipes.noisy_neighbour import SCHEDULER

    serve_role(role, port, upstream, {"small": SCHEDULER, "fair": FAIR, "off": None}[scheduler_name])


def generate_flood(edge_port: int, seconds: float, flood_concurrency: int) -> dict[str, Any]:
    """A's flood (``blocks.testing.flood``) for ``seconds``, from a client process of its own; A's statuses."""
    _import_project()
    import trio

    from blocks import open_upstreams
    from blocks.testing import SLEEP_20MS as PATH
    from blocks.testing import TenantLoad, flood, tenant_request

    edge = (HOST, edge_port)
    noisy = TenantLoad("noisy")

    async def run() -> None:
        async with open_upstreams() as upstreams:
            await tenant_request(upstreams, edge, TenantLoad("noisy"), PATH)  # untimed: opens the connections
            with trio.move_on_after(seconds):
                await flood(upstreams, edge, noisy, flood_concurrency)

    trio.run(run)
    return {"noisy": {"statuses": dict(noisy.statuses)}}


def generate_quiet(edge_port: int, seconds: float, rate: float, settle: float) -> dict[str, Any]:
    """After ``settle`` seconds, B paced at ``rate``/s for ``seconds``; wait for every B answer; report.

    B's requests are ``recipes.noisy_neighbour``'s, plus a timeout and the
    response's Server-Timing, so that the report can say which hop B's time
    went to. B is a client of its own (its process, its connection), as a
    second tenant is: what it measures is the chain, not a load generator
    busy with A's answers.
    """
    _import_project()
    import trio

    from blocks import BlocksError, Request, open_upstreams, parse_server_timing
    from blocks.testing import SLEEP_20MS as PATH
    from blocks.testing import TenantLoad, tenant_request

    edge = (HOST, edge_port)
    quiet = TenantLoad("quiet")
    phases: list[dict[str, float]] = []  # one per B 200: Server-Timing entries and the client's own ms

    async def run() -> int:
        sent = 0
        async with open_upstreams() as upstreams:

            async def quiet_request() -> None:
                start = time.perf_counter()
                status, timing = NO_ANSWER, b""
                with trio.move_on_after(REQUEST_TIMEOUT):
                    try:
                        request = Request(b"GET", b"http", b"demo.local", PATH)
                        response = await upstreams.request(edge, request, [(b"x-tenant", b"quiet")])
                        await response.body.read_all()
                        status = response.status
                        timing = b", ".join(v for k, v in response.headers if k == b"server-timing")
                    except BlocksError:
                        status = NO_RESPONSE
                elapsed = time.perf_counter() - start
                quiet.record(status, elapsed)
                if status == 200:
                    phases.append({**parse_server_timing(timing), "client": elapsed * 1000})

            # Untimed, uncounted: opens the client's connection to the edge and the chain's own.
            await tenant_request(upstreams, edge, TenantLoad("quiet"), PATH)
            await trio.sleep(settle)
            # B's last requests are waited for (not cancelled), so every one of them gets a status.
            async with trio.open_nursery() as quiet_nursery:
                next_at = trio.current_time()
                end = next_at + seconds
                while next_at < end:
                    quiet_nursery.start_soon(quiet_request)
                    sent += 1
                    next_at += 1 / rate
                    await trio.sleep_until(next_at)
        return sent

    sent = trio.run(run)
    return {"sent": sent, "quiet": {"statuses": dict(quiet.statuses), "latencies": quiet.latencies, "phases": phases}}


# -- processes (as in bench/chain.py; each bench script stands alone) --------------------------


def self_argv(role: str, port: int, *upstream: int, scheduler: str | None = None) -> list[str]:
    argv = [str(Path(__file__).resolve()), "--serve", role, str(port), *map(str, upstream)]
    return argv if scheduler is None else [*argv, "--scheduler", scheduler]


def dead(procs: list[Process], reported: set[str]) -> list[str]:
    """What became of the processes that exited (each reported once)."""
    found = []
    for proc in procs:
        if proc.name not in reported and (code := proc.popen.poll()) is not None:
            reported.add(proc.name)
            how = f"killed by signal {-code} (not by this script)" if code < 0 else f"exited with {code}"
            found.append(f"{proc.name} {how} during the run; last lines:\n{proc.tail() or '(empty)'}")
    return found


# -- 2. tenant B's latency ---------------------------------------------------------------------


@dataclass
class Scenario:
    label: str
    sent: int = 0
    quiet: collections.Counter[int] = field(default_factory=collections.Counter)
    noisy: collections.Counter[int] = field(default_factory=collections.Counter)
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase -> (p50, p99) ms
    problems: list[str] = field(default_factory=list)


PHASES: dict[
    str, Callable[[dict[str, float]], float]
] = {  # column -> how to get it from one B request's Server-Timing entries (ms) and client time
    "app": lambda t: t["app"],
    "worker": lambda t: t["worker"],
    "proxy": lambda t: t["proxy"],
    "edge": lambda t: t["edge"],
    "between hops": lambda t: t["total"] - t["edge"] - t["proxy"] - t["worker"] - t["app"],
    "client side": lambda t: t["client"] - t["total"],
}
"""Where B's time went. A hop's own time includes its waits (a proxy's, for a slot) and its
event loop's delays; "between hops" is the transport and the next hop's loop before it reads the
request; "client side" is the load generator and its connection to the edge."""


def statuses(counter: collections.Counter[int]) -> str:
    names = {NO_RESPONSE: "error", NO_ANSWER: "hung"}
    return " ".join(f"{names.get(code, code)}:{n}" for code, n in sorted(counter.items())) or "-"


def _result(code: int | None, out: str, proc: Process) -> dict[str, Any]:
    """A load generator's JSON line; ValueError (with its last lines) if it has none."""
    try:
        if code != 0:
            raise ValueError(f"exit {'(killed: no result in time)' if code is None else code}")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise ValueError(f"load generator failed: {exc}; last lines:\n{proc.tail() or '(empty)'}") from None
    return result


def run_scenario(
    procs: Processes, label: str, edge_port: int, seconds: float, flood: int, rate: float, only_200: bool
) -> Scenario:
    """B's latency, alone or beside A's flood: two client processes, A's started first and outlasting B's."""
    scenario = Scenario(label)
    load = [str(Path(__file__).resolve()), "--serve", "load", str(edge_port)]
    settle = FLOOD_SETTLE + STARTUP if flood else 0.0
    flooding = None
    if flood:
        duration = settle + seconds + FLOOD_TAIL
        flooding = procs.spawn(f"flood {label}", [*load, f"--flood={flood}", f"--seconds={duration}"])
    quiet = [*load, f"--rate={rate}", f"--seconds={seconds}", f"--settle={settle}"]
    try:
        result = _result(*procs.run(f"quiet {label}", quiet, timeout=settle + seconds + REQUEST_TIMEOUT + 30))
        if flooding is not None:
            out, _ = flooding.popen.communicate(timeout=FLOOD_TAIL + 30)
            noisy = _result(flooding.popen.returncode, out.decode(errors="replace"), flooding)
            scenario.noisy.update({int(code): n for code, n in noisy["noisy"]["statuses"].items()})
    except (ValueError, subprocess.TimeoutExpired) as exc:
        scenario.problems.append(str(exc))
        return scenario
    finally:
        if flooding is not None:
            procs.stop([flooding])
    scenario.sent = result["sent"]
    scenario.quiet.update({int(code): n for code, n in result["quiet"]["statuses"].items()})
    latencies = sorted(result["quiet"]["latencies"])
    scenario.p50_ms = percentile(latencies, 0.50) * 1000
    scenario.p99_ms = percentile(latencies, 0.99) * 1000
    for phase, value in PHASES.items():
        try:
            values = sorted(value(timing) for timing in result["quiet"]["phases"])
        except KeyError:  # a response without the entry: no figure for this phase
            continue
        scenario.phases[phase] = (percentile(values, 0.50), percentile(values, 0.99))
    answered = sum(n for code, n in scenario.quiet.items() if code > 0)
    if answered != scenario.sent or sum(scenario.quiet.values()) != scenario.sent:
        scenario.problems.append(
            f"B sent {scenario.sent} requests, {answered} got a status: {statuses(scenario.quiet)}"
        )
    if only_200 and scenario.quiet[200] != scenario.sent:
        scenario.problems.append(f"B must see only 200s here: {statuses(scenario.quiet)}")
    if scenario.noisy[NO_RESPONSE]:
        scenario.problems.append(f"A got {scenario.noisy[NO_RESPONSE]} errors instead of a response")
    return scenario


def print_scenario(scenario: Scenario) -> None:
    print(
        f"{scenario.label:<36} {scenario.p50_ms:>8.1f} {scenario.p99_ms:>8.1f}  "
        f"B [{statuses(scenario.quiet)}]  A [{statuses(scenario.noisy)}]",
        flush=True,
    )


def print_phases(scenarios: dict[str, Scenario]) -> None:
    print("where B's time went (Server-Timing of B's 200s), p50 / p99 ms per phase:")
    print(f"{'':<4}" + "".join(f"{phase:>16}" for phase in PHASES))
    for key, scenario in scenarios.items():
        cells = (scenario.phases.get(phase, (math.nan, math.nan)) for phase in PHASES)
        print(f"({key}) " + "".join(f"{f'{p50:.1f} / {p99:.1f}':>16}" for p50, p99 in cells), flush=True)


# -- 3. chain rps, scheduler on vs off (h2load) --------------------------------------------------


def measure_rps(port: int, n: int, verbose: bool, *, warm: bool) -> tuple[float, list[str]]:
    problems = []
    if warm:
        _, problems = h2load(port, WARMUP, timeout=60)
    out, more = h2load(port, ["-n", str(n), "-c", "8", "-m", "32", *TENANT_HEADER], timeout=60 + n / 100)
    if verbose:
        print(out)
    finished = re.search(r"finished in \S+, ([\d.]+) req/s", out)
    return (float(finished.group(1)) if finished else math.nan), problems + more


# -- the run -------------------------------------------------------------------------------------


@dataclass
class Settings:
    seconds: float
    flood: int
    rate: float
    n: int
    rounds: int
    decisions: int
    repeats: int
    verbose: bool


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def run_benchmark(s: Settings) -> int:
    if shutil.which("h2load") is None:
        print("h2load not found: install it with `apt-get install nghttp2-client`", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="proxyblocks-fairness-"))
    print(
        f"fairness bench: {os.cpu_count()} CPUs; B at {s.rate:g}/s for {s.seconds:g} s per scenario, "
        f"A's flood {s.flood}; rps with h2load -n {s.n} -c 8 -m 32, {s.rounds} interleaved rounds, medians; "
        f"logs in {tmp}"
    )
    print(f"load average before: {load_average()}", flush=True)

    admission = measure_admission(s.decisions, s.repeats)
    worst_us = print_admission(admission, s.decisions, s.repeats)

    procs = Processes(tmp)
    problems: list[tuple[str, str]] = []
    scenarios: dict[str, Scenario] = {}
    rps: dict[str, list[float]] = {"on": [], "off": []}
    try:
        replica_port, worker_port = free_port(), free_port()
        replica = procs.start("replica", self_argv("replica", replica_port), replica_port)
        worker = procs.start("worker", self_argv("worker", worker_port, replica_port), worker_port)
        hops = [replica, worker]
        reported: set[str] = set()
        edges: dict[str, int] = {}
        for name in SCHEDULERS:  # one proxy and one edge per scheduler setting; replica and worker shared
            proxy_port, edge_port = free_port(), free_port()
            hops.append(
                procs.start(
                    f"proxy {name}",
                    self_argv("proxy", proxy_port, worker_port, replica_port, scheduler=name),
                    proxy_port,
                )
            )
            hops.append(procs.start(f"edge {name}", self_argv("edge", edge_port, proxy_port), edge_port))
            edges[name] = edge_port

        print(f"\n2. tenant B ({s.rate:g} req/s to /sleep?ms=20) for {s.seconds:g} s each; chain in 4 processes")
        print(f"{'scenario':<36} {'p50 ms':>8} {'p99 ms':>8}  statuses (B = quiet, A = flood)")
        plan = [
            ("(a) B alone, scheduler on", "small", 0, True),
            (f"(b) A floods {s.flood}, scheduler on", "small", s.flood, True),
            (f"(c) A floods {s.flood}, scheduler off", "off", s.flood, False),
        ]
        for key, (label, name, flood, only_200) in zip("abc", plan, strict=True):
            scenario = scenarios[key] = run_scenario(procs, label, edges[name], s.seconds, flood, s.rate, only_200)
            print_scenario(scenario)
            problems += [(f"latency {key}", p) for p in scenario.problems + dead(hops, reported)]
            time.sleep(1.0)  # the flood's leftovers (queued, cancelled) drain before the next scenario
        print_phases(scenarios)

        print(f"\n3. chain rps, h2load -n {s.n} -c 8 -m 32 -H 'x-tenant: a', scheduler on (FAIR) vs off")
        for round_no in range(s.rounds):
            order = ["on", "off"] if round_no % 2 == 0 else ["off", "on"]
            figures = []
            for which in order:
                value, found = measure_rps(
                    edges["fair" if which == "on" else "off"], s.n, s.verbose, warm=round_no == 0
                )
                rps[which].append(value)
                problems += [(f"rps scheduler {which}", p) for p in found]
                figures.append(f"{which} {value:.0f}")
            print(f"... round {round_no + 1}/{s.rounds}: {', '.join(figures)} req/s", flush=True)
        problems += [("hops", p) for p in dead(hops, reported)]
    except RuntimeError as exc:  # a hop that would not start
        problems.append(("setup", str(exc)))
    finally:
        procs.stop_all()
    print(f"\nload average after: {load_average()}  (other processes on the machine skew the figures)")
    return report(worst_us, scenarios, rps, problems)


def report(
    worst_us: float, scenarios: dict[str, Scenario], rps: dict[str, list[float]], problems: list[tuple[str, str]]
) -> int:
    nan = Scenario("")
    a, b, c = (scenarios.get(key, nan) for key in "abc")
    flood_ratio = ratio(b.p99_ms, a.p99_ms)
    off_ratio = ratio(c.p99_ms, a.p99_ms)
    rps_on = statistics.median(rps["on"]) if rps["on"] else math.nan
    rps_off = statistics.median(rps["off"]) if rps["off"] else math.nan
    rps_ratio = ratio(rps_on, rps_off)

    print()
    print(f"admission cost, worst path and tenant count:   {worst_us:.2f} µs  (target <= {ADMISSION_TARGET_US:g})")
    print(f"B p99 under A's flood / alone, scheduler on:   {flood_ratio:.2f}  (target <= {P99_TARGET:g})  <- headline")
    print(f"B p99 under A's flood / alone, scheduler off:  {off_ratio:.2f}  (for comparison)")
    print(
        f"chain rps scheduler on / off:                  {rps_ratio:.2f}  ({rps_on:.0f} / {rps_off:.0f} req/s, ", end=""
    )
    print(f"target >= {RPS_TARGET:g})")
    if problems:
        print("\nPROBLEMS:")
        for where, problem in problems:
            print(f"[{where}] {problem}")

    ok = worst_us <= ADMISSION_TARGET_US and flood_ratio <= P99_TARGET and rps_ratio >= RPS_TARGET and not problems
    figures = (
        f"admission {worst_us:.2f} µs/decision (target <= {ADMISSION_TARGET_US:g}), "
        f"B p99 under flood / alone {flood_ratio:.2f} ({b.p99_ms:.1f} / {a.p99_ms:.1f} ms, target <= {P99_TARGET:g}), "
        f"rps on / off {rps_ratio:.2f} (target >= {RPS_TARGET:g})"
    )
    if problems:
        figures += f", problems in: {', '.join(sorted({where for where, _ in problems}))} (target: none)"
    print(f"verdict: {'PASS' if ok else 'FAIL'} {figures}")
    return 0 if ok else 1


def helper_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fairness.py --serve", description="one hop, or the load generator")
    parser.add_argument("role", choices=["replica", "worker", "proxy", "edge", "load"])
    parser.add_argument("port", type=int, help="the port to listen on; for load, the edge's")
    parser.add_argument("upstream", type=int, nargs="*", help="upstream ports (see serve)")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="off", help="proxy: small, fair or off")
    parser.add_argument("--seconds", type=float, default=10.0, help="load: how long it sends")
    parser.add_argument("--flood", type=int, default=0, help="load: be A, with this many requests in flight")
    parser.add_argument("--rate", type=float, default=10.0, help="load: be B, at this many requests per second")
    parser.add_argument("--settle", type=float, default=0.0, help="load, B: seconds to wait before sending")
    args = parser.parse_args(argv)
    if args.role == "load" and args.flood:
        print(json.dumps(generate_flood(args.port, args.seconds, args.flood)), flush=True)
    elif args.role == "load":
        print(json.dumps(generate_quiet(args.port, args.seconds, args.rate, args.settle)), flush=True)
    else:
        serve(args.role, args.port, args.upstream, args.scheduler)
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return helper_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 s scenarios, -n 3000, 3 rounds, fewer decisions")
    parser.add_argument("--seconds", type=float, help="seconds per latency scenario (default 10, --quick 5)")
    parser.add_argument("--flood", type=int, default=128, help="A's requests in flight (default 128)")
    parser.add_argument("--rate", type=float, default=10.0, help="B's requests per second (default 10)")
    parser.add_argument("-n", type=int, help="requests per rps run (default 20000, --quick 3000)")
    parser.add_argument("--rounds", type=int, help="interleaved rps rounds (default 5, --quick 3)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print h2load's output")
    args = parser.parse_args()

    def pick(value: Any, normal: Any, quick: Any) -> Any:
        return value if value is not None else (quick if args.quick else normal)

    settings = Settings(
        seconds=pick(args.seconds, 10.0, 5.0),
        flood=args.flood,
        rate=args.rate,
        n=pick(args.n, 20000, 3000),
        rounds=max(1, pick(args.rounds, 5, 3)),
        decisions=30_000 if args.quick else 100_000,
        repeats=3 if args.quick else 5,
        verbose=args.verbose,
    )
    # SIGTERM unwinds like Ctrl-C, so the finally block still stops every process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_benchmark(settings)
    except KeyboardInterrupt:
        print("interrupted; processes stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
